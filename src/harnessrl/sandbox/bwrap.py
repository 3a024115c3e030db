"""The bubblewrap (`bwrap`) command line that wraps every command of a local sandbox.

Responsibility: turn "run argv with this sandbox directory writable" into a `bwrap` argv.

The mount namespace a command sees:
  * read-only: the system directories in `system_paths` that exist (symlinks such as
    `/bin -> usr/bin` are recreated as symlinks), every path of `ro_binds` (an agent's install
    tree), and the running interpreter's `sys.prefix` / `sys.base_prefix` when asked;
  * writable: the sandbox directory only, at the same absolute path as outside (so paths
    printed by the agent mean the same thing to the verifier);
  * private: `/tmp` (a fresh tmpfs), `/proc` (a new PID namespace: the command sees only
    its own processes), `/dev` (a minimal devtmpfs), IPC namespace;
  * invisible: everything else of the host filesystem, including other sandboxes (the
    sandbox root is covered by a tmpfs before this sandbox's directory is bound back).

Deliberately not isolated: the network (the agent must reach the proxy on 127.0.0.1, so the
network namespace is shared: the command can reach anything the host can), the user (we run
as root and stay root inside; root can remount if it has CAP_SYS_ADMIN, which bwrap drops for
the command), CPU and memory beyond the rlimits, and the host kernel.

`--die-with-parent` kills the command when the process that started bwrap dies;
`--unshare-pid` makes bwrap's child the namespace's init, so every process left in the
namespace is killed when it exits, whatever session it moved to. Consequence: a daemon started
by an `exec` command (`setsid ... &`, `nohup ... &`) ends with that command; processes an agent
starts live as long as the agent does.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

DEFAULT_SYSTEM_PATHS: tuple[str, ...] = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/opt",
)
"""Host paths bound read-only into every sandbox (those that exist)."""


@functools.cache
def bwrap_path() -> str | None:
    """Absolute path of a working `bwrap`, or None when absent or unable to create namespaces.

    Checked once per process by running `bwrap --ro-bind / / --unshare-pid true`.
    """
    path = shutil.which("bwrap")
    if path is None:
        return None
    probe = [path, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-pid"]
    try:
        done = subprocess.run([*probe, "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


def _system_args(system_paths: Sequence[str]) -> list[str]:
    args: list[str] = []
    for p in system_paths:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    return args


def bwrap_argv(
    bwrap: str,
    argv: Sequence[str],
    *,
    sandbox_dir: Path,
    sandbox_root: Path,
    cwd: Path,
    ro_binds: Sequence[Path],
    system_paths: Sequence[str] = DEFAULT_SYSTEM_PATHS,
) -> list[str]:
    """The full argv running `argv` inside bubblewrap for the sandbox at `sandbox_dir`.

    The environment is not touched (bwrap passes its own environment to the command), so the
    caller builds it. Mount order matters: later mounts cover earlier ones, so the tmpfs over
    `sandbox_root` comes before the bind of `sandbox_dir`, and `ro_binds` come last.
    """
    args = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc"]
    args += _system_args(system_paths)
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    args += ["--tmpfs", str(sandbox_root)]
    args += ["--bind", str(sandbox_dir), str(sandbox_dir)]
    for p in ro_binds:
        args += ["--ro-bind", str(p), str(p)]
    args += ["--chdir", str(cwd), "--", *argv]
    return args

"""The bubblewrap (`bwrap`) command line that wraps every command of a local sandbox.

Responsibility: turn "run argv with this sandbox directory writable" into a `bwrap` argv.

Who the command is: an unprivileged user (uid/gid `SANDBOX_UID` inside a new user namespace,
mapped to our own uid outside) with no capabilities at all (`--cap-drop ALL`: CapEff,
CapPrm, CapBnd and CapAmb are 0), unable to create further user namespaces
(`--disable-userns`), in a new session (`--new-session`: no TIOCSTI into our terminal).
Without CAP_SYS_ADMIN, CAP_DAC_READ_SEARCH and the rest it cannot mount or remount (and
bind mounts made by a more privileged namespace are locked read-only anyway), cannot use
`open_by_handle_at`, and cannot ptrace or signal anything outside its PID namespace.

The namespaces a command gets: user, PID (`/proc` shows only its own processes), mount, IPC,
UTS and network. The network namespace holds only `lo`: nothing is routed, no DNS. When a
`ProxyRoute` is given, the proxy's agent Unix socket is bound at `INNER_SOCKET` and the
command runs under `sandbox/forward.py`, which listens on `127.0.0.1:<port>` inside the
namespace and relays to that socket: the agent's one reachable address is its proxy endpoint
(the admin listener and every other host port stay out of reach).

The mount namespace a command sees:
  * read-only: the system directories in `system_paths` that exist (symlinks such as
    `/bin -> usr/bin` are recreated as symlinks), every path of `ro_binds` (an agent's install
    tree), the running interpreter's `sys.prefix` / `sys.base_prefix` when asked, `/dev`
    (a minimal device set), the root directory and the sandbox root;
  * writable: the sandbox directory only, at the same absolute path as outside (so paths
    printed by the agent mean the same thing to the verifier), a private `/tmp` and a
    private `/dev/shm`, each a tmpfs of at most `tmp_bytes`;
  * invisible: everything else of the host filesystem, including other sandboxes (the
    sandbox root is covered by a tmpfs before this sandbox's directory is bound back).

Not isolated here: CPU and memory beyond the rlimits, process count and disk use (bounded by
the local sandbox: a pids cgroup and a disk watchdog, see `sandbox/local.py`), and the host
kernel itself (a kernel exploit crosses any namespace).

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
import sys
from collections.abc import Sequence
from dataclasses import dataclass
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

    Checked once per process by running `true` with every namespace and option
    `bwrap_argv` uses (a kernel or container that forbids user or network namespaces fails it).
    """
    path = shutil.which("bwrap")
    if path is None:
        return None
    probe = [path, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-user",
             "--uid", str(SANDBOX_UID), "--disable-userns", "--unshare-pid", "--unshare-net",
             "--cap-drop", "ALL", "--remount-ro", "/"]
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


SANDBOX_UID = 1000
"""uid and gid of every sandboxed command inside its user namespace."""
INNER_DIR = "/run/harnessrl"
"""Directory, inside a sandbox, holding the proxy socket and the forwarder script."""
INNER_SOCKET = f"{INNER_DIR}/proxy.sock"
INNER_FORWARDER = f"{INNER_DIR}/forward.py"
FORWARDER_SCRIPT = Path(__file__).with_name("forward.py")


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """The one way out of a sandbox: `127.0.0.1:port` inside relays to `socket_path` outside.

    `python` is the interpreter (visible inside the sandbox) that runs the forwarder.
    """

    port: int
    socket_path: Path
    python: str


def forwarder_python(system_paths: Sequence[str]) -> tuple[str, list[Path]]:
    """An interpreter to run `forward.py` inside a sandbox, and what must be bound for it.

    A `python3` under the bound system paths needs nothing more; otherwise this process's
    own base interpreter is used and its `sys.base_prefix` must be bound read-only (the
    virtual environment, which may hold task data, is not).
    """
    for directory in ("/usr/bin", "/usr/local/bin", "/bin"):
        candidate = Path(directory) / "python3"
        covered = any(directory == p or directory.startswith(p.rstrip("/") + "/") for p in system_paths)
        if covered and candidate.exists() and Path(os.path.realpath(candidate)).is_relative_to("/usr"):
            return str(candidate), []
    base = Path(sys.base_prefix)
    return str(base / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"), [base]


def bwrap_argv(
    bwrap: str,
    argv: Sequence[str],
    *,
    sandbox_dir: Path,
    sandbox_root: Path,
    cwd: Path,
    ro_binds: Sequence[Path],
    system_paths: Sequence[str] = DEFAULT_SYSTEM_PATHS,
    tmp_bytes: int = 256 << 20,
    proxy: ProxyRoute | None = None,
) -> list[str]:
    """The full argv running `argv` inside bubblewrap for the sandbox at `sandbox_dir`.

    `tmp_bytes` bounds each of the private `/tmp` and `/dev/shm` (bytes). With `proxy`, the
    command runs under the forwarder (see the module docstring), so `127.0.0.1:proxy.port`
    inside reaches the proxy's agent socket.

    The environment is not touched (bwrap passes its own environment to the command), so the
    caller builds it. Mount order matters: later mounts cover earlier ones, so the tmpfs over
    `sandbox_root` comes before the bind of `sandbox_dir`, `ro_binds` come after, and the
    read-only remounts of `/dev`, the sandbox root and `/` come last.
    """
    uid = str(SANDBOX_UID)
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-user", "--uid", uid, "--gid", uid,
            "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts",
            "--cap-drop", "ALL"]
    args += _system_args(system_paths)
    size = str(tmp_bytes)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    args += ["--size", size, "--tmpfs", "/tmp"]
    args += ["--tmpfs", str(sandbox_root)]
    args += ["--bind", str(sandbox_dir), str(sandbox_dir)]
    for p in ro_binds:
        args += ["--ro-bind", str(p), str(p)]
    prefix: list[str] = []
    if proxy is not None:
        args += ["--ro-bind", str(FORWARDER_SCRIPT), INNER_FORWARDER]
        args += ["--bind", str(proxy.socket_path), INNER_SOCKET]
        prefix = [proxy.python, "-I", "-S", INNER_FORWARDER, str(proxy.port), INNER_SOCKET, "--"]
    args += ["--remount-ro", "/dev", "--remount-ro", str(sandbox_root), "--remount-ro", "/"]
    args += ["--chdir", str(cwd), "--", *prefix, *argv]
    return args

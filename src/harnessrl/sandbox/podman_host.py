"""The host side of podman sandboxes: harnessrl's podman store and the containers' cgroups.

Responsibility: what `sandbox/podman.py` needs of the host besides running containers: the
`podman` command line of harnessrl's own store (`podman_argv`), whether podman sandboxes can
run here at all (`podman_problem`), the rlimits a container may ask for (`ulimit_args`), the
sandbox's container cgroups under `/<CGROUP_PARENT>/<sandbox_id>` (their members, SIGKILL from
the host without podman, their removal), and the removal of harnessrl's containers by label
or of those whose run is gone (`remove_containers`, `remove_orphans`).

Containers are found by the labels `SANDBOX_LABEL` (the sandbox id) and `OWNER_LABEL` (the
backend's id, `<pid>-<hex>`); containers without them are never touched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

from harnessrl.sandbox.config import PodmanSandboxConfig

__all__ = ["CGROUP_PARENT", "OWNER_LABEL", "SANDBOX_LABEL", "cgroup_pids", "kill_members", "pids_hierarchy",
           "podman_argv", "podman_problem", "remove_cgroups", "remove_containers", "remove_orphans", "ulimit_args"]

SANDBOX_LABEL = "harnessrl.sandbox"
"""Label carrying the sandbox id on every container of a podman sandbox."""
OWNER_LABEL = "harnessrl.owner"
"""Label carrying the id of the backend (one per process) that started the container."""
CGROUP_PARENT = "harnessrl-podman"
"""Cgroup directory holding one parent per sandbox (`/<CGROUP_PARENT>/<sandbox_id>`)."""


def podman_argv(config: PodmanSandboxConfig) -> list[str]:
    """`podman` with harnessrl's global options: its own store, overlay, cgroupfs, the runtime."""
    store = config.storage_dir
    return [config.podman, "--root", str(store / "storage"), "--runroot", str(store / "run"),
            "--storage-driver", "overlay", "--cgroup-manager", "cgroupfs", "--runtime", config.runtime,
            "--events-backend", "none", "--log-level", "error"]


@functools.cache
def podman_problem(config: PodmanSandboxConfig) -> str | None:
    """Why podman sandboxes of `config` cannot run here (None: they can).

    Checked once per process and config: root, the executable, the image in the store, and
    one real container (`true` with the flags every sandbox command uses).
    """
    if os.geteuid() != 0:
        return "podman sandboxes need root (rootful podman; rootless is not supported)"
    if shutil.which(config.podman) is None:
        return f"podman executable {config.podman!r} not found (apt-get install podman runc)"
    base = podman_argv(config)
    try:
        found = subprocess.run([*base, "image", "exists", config.image], capture_output=True, timeout=60)
        if found.returncode != 0:
            return (f"image {config.image!r} is not in {config.storage_dir / 'storage'} "
                    "(build it: docs/containers.md)")
        probe = subprocess.run([*base, "run", "--rm", "--pull", "never", "--network", "none",
                                *ulimit_args(), config.image, "true"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"podman did not answer: {exc}"
    if probe.returncode != 0:
        return f"podman cannot run a container: {probe.stderr.decode(errors='replace').strip()[-400:]}"
    return None


def ulimit_args(nofile: int | None = None) -> list[str]:
    """podman's default RLIMIT_NOFILE / RLIMIT_NPROC exceed the hard limits of many hosts (the
    runtime then fails with EPERM): give the host's own hard limits instead, RLIMIT_NPROC at
    most `kernel.pid_max` (runc fails above it). `nofile`: the sandbox's RLIMIT_NOFILE
    (`max_open_files`), at most the host's hard limit."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], nofile or (1 << 16))
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 1 << 15
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], pid_max)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def pids_hierarchy() -> Path:
    """The cgroup hierarchy holding the pids controller (v1 `pids`, else the v2 tree)."""
    v1 = Path("/sys/fs/cgroup/pids")
    return v1 if v1.is_dir() else Path("/sys/fs/cgroup")


def cgroup_pids(directory: Path) -> list[int]:
    """Pids in every `libpod-*` cgroup below `directory` (conmon's cgroup is not the sandbox's)."""
    pids: list[int] = []
    for procs in directory.glob("libpod-*/cgroup.procs"):
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except OSError:
            continue
    return pids


def _is_member(pid: int, sandbox_id: str) -> bool:
    """`pid` is alive (not a zombie) and in one of the sandbox's container cgroups."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cgroup") as f:
            groups = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z" and f":/{CGROUP_PARENT}/{sandbox_id}/libpod-" in groups


def kill_members(sandbox_id: str, timeout_s: float = 2.0) -> int:
    """SIGKILL, from the host, every process in the sandbox's container cgroups, scanning again
    until a scan finds none or `timeout_s` seconds passed, then wait (within the same
    `timeout_s`) until every process signalled is dead; returns how many pids were signalled.

    No `podman` process is started (`podman kill` takes about a second to start and reach
    the runtime; this takes milliseconds). Killing a container's PID 1 also ends its whole PID
    namespace. A pid is signalled through a pidfd opened while it was a member, so a pid
    reused by another process after the scan is never hit. The wait is needed because a
    process leaves `cgroup.procs` as soon as it starts exiting, before its memory and files
    are released and it becomes a zombie (the kernel's css_task_iter skips a leader whose
    threads are all exiting): an empty scan alone does not mean dead. The wait polls the
    pidfds (one becomes readable when its process has exited). The containers stay to be
    removed (`podman rm`).

    Raises nothing; a process still dying after `timeout_s` is left to the caller's
    `podman rm`."""
    directory = pids_hierarchy() / CGROUP_PARENT / sandbox_id
    deadline = time.monotonic() + timeout_s
    signalled: dict[int, int] = {}  # pid -> its pidfd, kept open until the process is dead
    try:
        while True:
            live = 0
            for pid in cgroup_pids(directory):
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # gone since the scan
                    continue
                try:
                    if _is_member(pid, sandbox_id):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                        live += 1
                        if pid not in signalled:
                            signalled[pid], fd = fd, -1
                except ProcessLookupError:
                    pass
                finally:
                    if fd >= 0:
                        os.close(fd)
            if not live or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        _wait_dead(list(signalled.values()), deadline)
        return len(signalled)
    finally:
        for fd in signalled.values():
            os.close(fd)


def _wait_dead(pidfds: list[int], deadline: float) -> None:
    """Wait until every pidfd of `pidfds` is readable (its process exited) or `deadline`."""
    waiting = select.poll()
    for fd in pidfds:
        waiting.register(fd, select.POLLIN)
    left = len(pidfds)
    while left and time.monotonic() < deadline:
        for fd, _ in waiting.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            waiting.unregister(fd)
            left -= 1


def remove_cgroups(sandbox_id: str, timeout_s: float = 5.0) -> list[Path]:
    """Remove the sandbox's cgroup parent in every hierarchy, innermost first, retrying while
    conmon (which outlives its container by a moment) still holds one; returns what is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = list(Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}/{sandbox_id}"))
        for parent in left:
            for directory in sorted((p for p in parent.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()
        left = [p for p in left if p.exists()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def remove_containers(config: PodmanSandboxConfig, label: str = SANDBOX_LABEL) -> int:
    """Remove (SIGKILL, no grace) every container of the store carrying `label` (a key, or
    `key=value`): by default every harnessrl sandbox container, e.g. orphans of a run that
    was killed. Containers without the label are never touched. Returns how many there were."""
    base = podman_argv(config)
    listed = subprocess.run([*base, "ps", "-a", "-q", "--filter", f"label={label}"],
                            capture_output=True, text=True, timeout=60, check=True)
    ids = listed.stdout.split()
    if ids:
        subprocess.run([*base, "rm", "-f", "-t", "0", "--ignore", *ids], capture_output=True, timeout=120)
    return len(ids)


def remove_orphans(config: PodmanSandboxConfig) -> int:
    """Remove the harnessrl containers of the store whose owner process (the pid in their
    `harnessrl.owner` label) is gone: what a run killed by SIGKILL left behind. Containers of
    live runs and containers without the label are never touched. Returns how many."""
    base = podman_argv(config)
    listed = subprocess.run([*base, "ps", "-a", "--filter", f"label={OWNER_LABEL}", "--format",
                             f'{{{{.ID}}}} {{{{index .Labels "{OWNER_LABEL}"}}}}'],
                            capture_output=True, text=True, timeout=60, check=True)
    orphans = []
    for line in listed.stdout.splitlines():
        cid, _, owner = line.partition(" ")
        pid = owner.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            orphans.append(cid)
    if orphans:
        subprocess.run([*base, "rm", "-f", "-t", "0", "--ignore", *orphans], capture_output=True, timeout=120)
    return len(orphans)

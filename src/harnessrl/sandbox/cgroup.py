"""A per-sandbox pids cgroup: a bound on a sandbox's task count and a list of all its processes.

Responsibility: when this machine lets us create cgroups with the `pids` controller (cgroup
v1's `/sys/fs/cgroup/pids`, or a cgroup v2 hierarchy where `pids` is enabled), give each
sandbox its own group `<pids root>/harnessrl/<sandbox id>` with `pids.max` set. Every command
of the sandbox is moved into it before it execs (in the child, so nothing it starts is ever
outside), and membership is inherited by every descendant whatever it does to its session,
environment or working directory: the kernel refuses `fork`/`clone` beyond `pids.max`
(EAGAIN), and `close()` finds every member through `cgroup.procs`.

Why a cgroup and not RLIMIT_NPROC: that rlimit counts processes per real user and the kernel
ignores it for root, and sandboxed commands are root outside their user namespace.

Memory: where a memory controller is writable (`memory_available()`: cgroup v1's
`/sys/fs/cgroup/memory`, or v2's `memory.max`), the sandbox also gets
`<memory root>/harnessrl/<sandbox id>` with its limit (`memory.limit_in_bytes` and, with swap
accounting, `memory.memsw.limit_in_bytes`; v2 `memory.max` and `memory.swap.max = 0`): past it
the kernel OOM-kills inside the sandbox. Every command joins both groups before it execs.

CPU: where a cpu controller is writable (`cpu_available()`: cgroup v1's `/sys/fs/cgroup/cpu`,
or v2's `cpu.max`), the sandbox also gets `<cpu root>/harnessrl/<sandbox id>` with a quota of
`cpus` CPUs (v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us`; v2 `cpu.max`), as podman's
`--cpus` gives a container: however many busy processes a sandbox starts, in whatever
sessions, together they get at most that much CPU time per period, and a sibling sandbox keeps
its share.

What it does not do: create a hierarchy where none is writable (then `available()`,
`memory_available()` or `cpu_available()` is None and the sandbox says what is not bounded).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from pathlib import Path

PARENT = "harnessrl"
"""Group under the pids root holding one group per sandbox."""
_CANDIDATES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))
_MEMORY_V1 = (Path("/sys/fs/cgroup/memory"),)
_MEMORY_V2 = (Path("/sys/fs/cgroup"),)
_CPU_V1 = (Path("/sys/fs/cgroup/cpu"),)
CPU_PERIOD_US = 100_000
"""Period of a sandbox's CPU quota, microseconds (the kernel's and podman's default)."""


@functools.cache
def available() -> Path | None:
    """The directory sandbox groups are created in, or None when no pids cgroup is writable.

    Probed once per process by creating (and removing) a group and checking it has `pids.max`.
    """
    return _probe(_CANDIDATES, "pids.max")


@functools.cache
def memory_available() -> Path | None:
    """The directory sandbox memory groups are created in (v1 `memory.limit_in_bytes` or v2
    `memory.max`), or None when no memory cgroup is writable. Probed once per process."""
    return _probe(_MEMORY_V1, "memory.limit_in_bytes") or _probe(_MEMORY_V2, "memory.max")


@functools.cache
def cpu_available() -> Path | None:
    """The directory sandbox cpu groups are created in (v1 `cpu.cfs_quota_us` or v2
    `cpu.max`), or None when no cpu cgroup is writable. Probed once per process."""
    return _probe(_CPU_V1, "cpu.cfs_quota_us") or _probe(_MEMORY_V2, "cpu.max")


def _probe(candidates: tuple[Path, ...], control: str) -> Path | None:
    for root in candidates:
        parent = root / PARENT
        probe = parent / f"probe-{os.getpid()}"
        try:
            parent.mkdir(exist_ok=True)
            probe.mkdir()
        except OSError:
            continue
        try:
            usable = (probe / control).exists() and (probe / "cgroup.procs").exists()
        finally:
            try:
                probe.rmdir()
            except OSError:
                pass
        if usable:
            return parent
    return None


class PidsGroup:
    """The pids cgroup of one sandbox. Create with `PidsGroup.create`."""

    def __init__(self, path: Path | None, memory: Path | None = None, cpu: Path | None = None) -> None:
        self.path = path
        """The pids group (None: only memory or CPU is bounded)."""
        self.memory = memory
        """The memory group when it is a directory of its own (v1, or memory without pids)."""
        self.cpu = cpu
        """The cpu group when it is a directory of its own (v1, or CPU without pids)."""
        dirs = [d for d in (path, memory, cpu) if d is not None]
        self._procs = str(dirs[0] / "cgroup.procs")
        self._joins = [str(d / "cgroup.procs") for d in dirs]

    @classmethod
    def create(cls, parent: Path | None, name: str, max_tasks: int | None,
               memory_parent: Path | None = None, memory_bytes: int | None = None,
               cpu_parent: Path | None = None, cpus: float | None = None) -> PidsGroup:
        """Make `parent/name` and set its `pids.max` (None = unlimited); with `memory_parent`
        and `memory_bytes`, also bound its memory (and swap) to `memory_bytes` bytes, in the
        same directory when both controllers share it (v2), else in `memory_parent/name`; with
        `cpu_parent` and `cpus`, its CPU time to `cpus` CPUs the same way.

        Raises OSError when a group cannot be created or limited.
        """
        path = parent / name if parent is not None else None
        bounded = memory_parent is not None and memory_bytes is not None
        memory = memory_parent / name if bounded and memory_parent != parent else None
        cpu_bounded = cpu_parent is not None and cpus is not None
        shared = [d for d in (parent, memory_parent if bounded else None) if d is not None]
        cpu = cpu_parent / name if cpu_parent is not None and cpus is not None and cpu_parent not in shared else None
        group = cls(path, memory, cpu)
        try:
            if path is not None:
                path.mkdir()
                (path / "pids.max").write_text(str(max_tasks) if max_tasks is not None else "max")
            if memory is not None:
                memory.mkdir()
            if bounded:
                _limit_memory(memory or path, memory_bytes)
            if cpu is not None:
                cpu.mkdir()
            if cpu_bounded:
                assert cpu_parent is not None and cpus is not None
                _limit_cpu(cpu or cpu_parent / name, cpus)
        except OSError:
            group.remove()
            raise
        return group

    def join(self) -> None:
        """Move the calling process into the group(s). Safe in a `preexec_fn` (no
        allocation-heavy work): the child is a member before it execs anything."""
        for procs in self._joins:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

    def pids(self) -> list[int]:
        """Pids of the group's processes (empty when the group is gone)."""
        try:
            with open(self._procs) as f:
                return [int(line) for line in f if line.strip()]
        except OSError:
            return []

    def kill(self, timeout_s: float) -> list[int]:
        """SIGKILL every member until none is left or `timeout_s` passed; returns survivors.

        Blocking (polls every 10 ms). Forks racing the kill are bounded by `pids.max`.
        """
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)
        return self.pids()

    def remove(self, timeout_s: float = 1.0) -> None:
        """Remove the group(s) (they must be empty; a group with members is left in place).
        A group still busy (EBUSY: its last members are exiting; the memory group may lag the
        pids group) is retried every 10 ms for `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        for directory in (self.path, self.memory, self.cpu):
            while directory is not None:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)


def _limit_memory(directory: Path | None, memory_bytes: int | None) -> None:
    """Write the memory (and swap) limit of `directory` (v1 or v2 files, whichever exist)."""
    assert directory is not None and memory_bytes is not None, "only called when bounded"
    if (directory / "memory.limit_in_bytes").exists():
        (directory / "memory.limit_in_bytes").write_text(str(memory_bytes))
        memsw = directory / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(memory_bytes))
    else:
        (directory / "memory.max").write_text(str(memory_bytes))
        swap = directory / "memory.swap.max"
        if swap.exists():
            swap.write_text("0")


def _limit_cpu(directory: Path, cpus: float) -> None:
    """Give `directory` a quota of `cpus` CPUs per `CPU_PERIOD_US` (v1 or v2 files, whichever
    exist), at least 1 ms per period (the kernel's floor)."""
    quota = max(1000, round(cpus * CPU_PERIOD_US))
    if (directory / "cpu.cfs_quota_us").exists():
        (directory / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (directory / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (directory / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")

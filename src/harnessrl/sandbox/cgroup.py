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

What it does not do: limit memory or CPU, or create a hierarchy where none is writable (then
`available()` is None and the sandbox says what is not bounded).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

PARENT = "harnessrl"
"""Group under the pids root holding one group per sandbox."""
_CANDIDATES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))


@functools.cache
def available() -> Path | None:
    """The directory sandbox groups are created in, or None when no pids cgroup is writable.

    Probed once per process by creating (and removing) a group and checking it has `pids.max`.
    """
    for root in _CANDIDATES:
        parent = root / PARENT
        probe = parent / f"probe-{os.getpid()}"
        try:
            parent.mkdir(exist_ok=True)
            probe.mkdir()
        except OSError:
            continue
        try:
            usable = (probe / "pids.max").exists() and (probe / "cgroup.procs").exists()
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

    def __init__(self, path: Path) -> None:
        self.path = path
        self._procs = str(path / "cgroup.procs")

    @classmethod
    def create(cls, parent: Path, name: str, max_tasks: int | None) -> PidsGroup:
        """Make `parent/name` and set its `pids.max` (None = unlimited).

        Raises OSError when the group cannot be created or limited.
        """
        path = parent / name
        path.mkdir()
        group = cls(path)
        try:
            (path / "pids.max").write_text(str(max_tasks) if max_tasks is not None else "max")
        except OSError:
            group.remove()
            raise
        return group

    def join(self) -> None:
        """Move the calling process into the group. Safe in a `preexec_fn` (no allocation-heavy
        work): the child is a member before it execs anything."""
        fd = os.open(self._procs, os.O_WRONLY)
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

    def remove(self) -> None:
        """Remove the group (it must be empty; a group with members is left in place)."""
        try:
            self.path.rmdir()
        except OSError:
            pass

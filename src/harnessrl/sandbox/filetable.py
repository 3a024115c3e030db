"""How much of the host's open-file table the sandboxes of a run can take, checked at start.

Responsibility: one sandbox's processes can hold at most `max_processes * max_open_files`
descriptors (its pids cgroup bounds the processes, RLIMIT_NOFILE, soft = hard, each process's
descriptors), so a run's sandboxes together at most that times its concurrent rollouts. A run
checks at start that this stays within `FILE_TABLE_SHARE` of the host's `fs.file-max`, so
no agent (an eventfd or socket hog) can leave the trainer, the engine or the host without
descriptors (ENFILE), and its isolation report prints the figure.

What it does not do: bound descriptors that are not a process's (the kernel has no per-cgroup
file count); a sandbox without a pids cgroup has no bound on its process count here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from harnessrl.errors import SandboxError

log = logging.getLogger(__name__)

FILE_TABLE_SHARE = 0.5
"""Most of `fs.file-max` the sandboxes of one run may hold at once, worst case; the rest is
the trainer's, the engine's and the host's."""
FILE_MAX = Path("/proc/sys/fs/file-max")


def file_max() -> int | None:
    """The host's `fs.file-max` (open files, system-wide), or None where it cannot be read."""
    try:
        return int(FILE_MAX.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def file_table_use(max_processes: int | None, max_open_files: int, concurrency: int) -> tuple[str, bool]:
    """(a line for the isolation report, whether the run fits): the descriptors the run's
    sandboxes can hold at once, `max_processes * max_open_files * concurrency`, against
    `FILE_TABLE_SHARE` of `fs.file-max`. Unbounded processes (None) never fit; an unreadable
    `fs.file-max` is reported and fits."""
    limit = file_max()
    if max_processes is None:
        return ("open files: unbounded (sandbox.max_processes is unset, so "
                f"{max_open_files} descriptors per process times any number of processes)", False)
    worst = max_processes * max_open_files * concurrency
    if limit is None:
        return f"open files: at most {worst:,} ({FILE_MAX} unreadable)", True
    share = worst / limit
    line = (f"open files: at most {max_processes} processes x {max_open_files} descriptors x "
            f"{concurrency} sandboxes = {worst:,}, {share:.0%} of fs.file-max {limit:,} "
            f"(bound: {FILE_TABLE_SHARE:.0%})")
    return line, share <= FILE_TABLE_SHARE


def check_file_table(max_processes: int | None, max_open_files: int, concurrency: int) -> str:
    """Log `file_table_use`'s line and return it. Raises SandboxError naming the keys to lower
    when the run does not fit (with unbounded processes: only a warning, the isolation report
    already names the missing pids cgroup)."""
    line, fits = file_table_use(max_processes, max_open_files, concurrency)
    if not fits and max_processes is not None:
        raise SandboxError(f"sandboxes could take the host's file table: {line}. Lower sandbox.max_open_files "
                           "or sandbox.max_processes, or run fewer rollouts at once "
                           "(rollout.max_concurrent_rollouts)")
    (log.info if fits else log.warning)("sandbox isolation: %s", line)
    return line

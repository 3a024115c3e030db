"""Process-leak checks of the tests that signal a real run: what the run started, stopping its
process group, and the assertion that nothing of it (processes, sandbox processes, sandbox
directories) is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from harnessrl.sandbox.local import leftover_sandboxes
from harnessrl.sandbox.procs import leftover_processes


def alive(p: psutil.Process) -> bool:
    """`p` still runs (a zombie or a vanished process does not)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cmdline(p: psutil.Process) -> list[str]:
    """`p`'s argv, or [] once it is gone or unreadable."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of `pid` ([] once it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals, timeout_s: float = 60.0) -> float:
    """Send `sig` to `proc`'s process group and wait at most `timeout_s` seconds for `proc` to
    exit; past that the group gets SIGKILL, `proc` is reaped and `subprocess.TimeoutExpired`
    raised. Returns the seconds `proc` took to exit."""
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return time.monotonic() - t0


def assert_nothing_left(processes: Iterable[psutil.Process], sandboxes: Path, grace_s: float = 5.0) -> None:
    """Within `grace_s` seconds (orphans are reaped by init shortly after an exit) none of
    `processes` runs; and no sandbox process or directory is left under `sandboxes`."""
    processes = list(processes)
    deadline = time.monotonic() + grace_s
    left = [p for p in processes if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in processes if alive(p)]
    assert left == [], f"processes left: {[(p.pid, ' '.join(cmdline(p))[:120]) for p in left]}"
    assert leftover_processes(sandboxes) == []
    assert leftover_sandboxes(sandboxes) == []

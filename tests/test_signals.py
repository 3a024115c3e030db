"""The run's signal handler: the first SIGINT/SIGTERM cancels the run (its cleanup runs, then
RunStopped with 128 + signum), a second one exits at once even when the cleanup hangs; on the
default loop and on `run_loop`'s (uvloop), which `train` and `rollout` run on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

SCRIPT = """
import asyncio, sys
from harnessrl.proxy.server import run_loop
from harnessrl.signals import RunStopped, run_until_signal

async def main(hang):
    try:
        print("ready", flush=True)
        await asyncio.sleep(100)
    finally:
        print("cleanup", flush=True)
        if hang:
            import subprocess
            child = subprocess.Popen(["sleep", "1000"])  # a process the forced exit must not leave
            print(f"child {child.pid}", flush=True)
            await asyncio.shield(asyncio.sleep(100))  # a teardown that never ends
    return "completed"

run = run_loop if sys.argv[2] == "run_loop" else asyncio.run
try:
    print(run(run_until_signal(main(sys.argv[1] == "hang"))), flush=True)
except RunStopped as stop:
    print(f"stopped {stop.exit_code}", flush=True)
    sys.exit(stop.exit_code)
"""


LOOPS = pytest.mark.parametrize("loop", ["asyncio", "run_loop"])


def _start(mode: str, loop: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, loop], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
@LOOPS
def test_first_signal_runs_the_cleanup_then_stops(sig: signal.Signals, loop: str) -> None:
    proc = _start("clean", loop)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=10)
    assert out.splitlines() == ["cleanup", f"stopped {128 + sig}"]
    assert proc.returncode == 128 + sig


@LOOPS
def test_second_signal_forces_exit_when_cleanup_hangs(loop: str) -> None:
    proc = _start("hang", loop)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout is not None and proc.stdout.readline() == "cleanup\n"
    child = psutil.Process(int(proc.stdout.readline().split()[1]))
    time.sleep(0.5)
    assert proc.poll() is None, "the first signal waits for the cleanup"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=5)
    assert proc.returncode == 130 and time.monotonic() - t0 < 2.0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the forced exit killed the run's child process"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_completed_run_returns_its_result() -> None:
    import asyncio

    from harnessrl.signals import run_until_signal

    async def quick() -> int:
        return 7

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the test run started in the background
    assert asyncio.run(run_until_signal(quick())) == 7
    assert signal.getsignal(signal.SIGINT) is before, "handlers restored"

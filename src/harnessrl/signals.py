"""Stop signals of a run: the first Ctrl-C (SIGINT) or SIGTERM stops the run cleanly, a second
one forces the process out.

Responsibility: the one signal handler of a `harnessrl train` / `harnessrl rollout` process,
owned by the run rather than by any server inside it (the proxy's uvicorn installs none). The
first signal cancels the run's main task; the cancellation unwinds through the orchestrator
(dispatch stops, in-flight rollouts are cancelled and release their processes, directories and
keys) and the runtime (proxy, engine), so nothing produced after the signal is recorded as data.
A second signal kills the run's descendant processes and exits at once (`os._exit`) with the
same code, for a teardown that hangs.

Exit codes: 128 + the signal number: 130 for SIGINT, 143 for SIGTERM (`RunStopped.exit_code`).

Handlers are Python-level (`signal.signal`), so they run in the main thread even while the event
loop is blocked in synchronous code (model loading); the stop itself is scheduled on the loop
with `call_soon_threadsafe`. Outside the main thread nothing is installed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Coroutine
from types import FrameType, TracebackType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run was stopped by a signal before it completed."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        """130 for SIGINT, 143 for SIGTERM."""
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class StopSignals:
    """`with StopSignals(task, loop):` the first SIGINT/SIGTERM cancels `task`, a second exits.

    Attributes:
        signum: the first signal received, or None.
        cancelled: True once `task` was cancelled because of it (the task was still running).
    """

    def __init__(self, task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop) -> None:
        self._task = task
        self._loop = loop
        self._previous: dict[int, Any] = {}
        self.signum: int | None = None
        self.cancelled = False

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            # a second signal: the clean stop is taking too long, or the user insists
            os.write(2, f"\nharnessrl: second {signal.Signals(signum).name}: killing the run's processes "
                        f"and exiting now (sandbox directories of rollouts in flight may remain)\n".encode())
            kill_descendants()
            os._exit(128 + self.signum)
        self.signum = signum
        try:
            self._loop.call_soon_threadsafe(self._stop)
        except RuntimeError:  # the loop is closed: nothing left to stop
            pass

    def _stop(self) -> None:
        assert self.signum is not None
        name = signal.Signals(self.signum).name
        if self._task.done():
            return
        log.warning("%s received: stopping (dispatch stopped, rollouts in flight cancelled); "
                    "send it again to exit at once", name)
        self.cancelled = True
        self._task.cancel(msg=f"stopped by {name}")


def kill_descendants() -> None:
    """SIGKILL every live descendant of this process (agents, sandboxes, their children); used
    by the forced exit, which skips the orderly teardown. Processes that left the tree (double
    forks re-parented to init) are not found here."""
    import psutil  # lazy: optional

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


async def run_until_signal(main: Coroutine[Any, Any, T]) -> T:
    """Await `main` in the current task; the first SIGINT/SIGTERM cancels it.

    Returns what `main` returns when it completes.

    Raises:
        RunStopped: a signal cancelled `main` (after every `finally` inside it ran).
    """
    task = asyncio.current_task()
    assert task is not None, "run_until_signal must run inside a task"
    with StopSignals(task, asyncio.get_running_loop()) as stop:
        try:
            result = await main
        except asyncio.CancelledError:
            if not stop.cancelled:
                raise
            task.uncancel()
            assert stop.signum is not None
            raise RunStopped(stop.signum) from None
        if stop.cancelled:  # `main` swallowed the cancellation: it still did not complete
            task.uncancel()
            assert stop.signum is not None
            raise RunStopped(stop.signum)
        return result

"""A rollout's `Sandbox` for blocking code on worker threads.

Responsibility: the seam of `sandbox/base.py` with its coroutines turned into blocking calls,
for code that runs on a worker thread while the rollout's event loop runs (an OpenEnv
session's `create`, `wait_for_completion` and `close`, `tasks/openenv.py`). Each blocking
call runs the sandbox's own coroutine on the loop that owns the sandbox
(`asyncio.run_coroutine_threadsafe`) and waits for it, so a process started here is the
sandbox's like any other: `kill_processes` kills it before verification and `close()` kills
it and removes the directory on every exit path (the runner's, `rollout/runner.py`),
whichever thread started it. Paths, the endpoint and file access pass straight through.

Not offered: `close()` (the runner owns the sandbox's lifetime).

Errors: a blocking method called from the event loop's own thread (it would wait on itself)
or after that loop has closed raises `SandboxError`; otherwise the seam's errors, as
documented in `sandbox/base.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from harnessrl.errors import SandboxError
from harnessrl.sandbox.base import READ_MAX_BYTES, Base, ExecResult, Sandbox, SandboxProcess, tree_path
from harnessrl.types import Endpoint

T = TypeVar("T")


def _run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise SandboxError("a blocking sandbox call was made on the event loop's own thread; "
                           "call it from a worker thread (asyncio.to_thread) or use the Sandbox itself")
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except RuntimeError as exc:  # the loop is closed
        coro.close()
        raise SandboxError(f"the sandbox's event loop is gone: {exc}") from exc
    return future.result()


class BlockingProcess:
    """A `SandboxProcess` (started by `BlockingSandbox.spawn`) with blocking `wait`/`kill_tree`."""

    def __init__(self, proc: SandboxProcess, loop: asyncio.AbstractEventLoop) -> None:
        self.process = proc
        """The sandbox's own handle (its coroutines run on the sandbox's loop)."""
        self._loop = loop

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once it has exited and been reaped (negative: its signal), else None."""
        return self.process.returncode

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Block at most `timeout_s` seconds (None: without limit); its exit status, or None
        when it still runs at the timeout."""
        return _run(self._loop, self.process.wait(timeout_s))

    def kill_tree(self) -> int:
        """Kill it and its descendants (SIGTERM, `kill_grace_s`, SIGKILL); how many were alive.
        Raises `SandboxError` when some survive SIGKILL."""
        return _run(self._loop, self.process.kill_tree())


class BlockingSandbox:
    """`sandbox` (owned by `loop`) for blocking callers on other threads; see the module docstring."""

    def __init__(self, sandbox: Sandbox, loop: asyncio.AbstractEventLoop) -> None:
        self.sandbox = sandbox
        """The rollout's `Sandbox` itself (its coroutines belong to `loop`)."""
        self._loop = loop

    @property
    def workdir(self) -> Path:
        return self.sandbox.workdir

    @property
    def home(self) -> Path:
        return self.sandbox.home

    def agent_path(self, base: Base, rel_path: str = "") -> str:
        """As `Sandbox.agent_path`: the path a process inside the sandbox sees."""
        return self.sandbox.agent_path(base, rel_path)

    def tree_path(self, host_path: Path) -> str:
        """As `sandbox.base.tree_path`: where a process inside the sandbox finds `host_path`, a
        file of an agent install tree."""
        return tree_path(self.sandbox, host_path)

    def agent_endpoint(self, endpoint: Endpoint) -> Endpoint:
        """As `Sandbox.agent_endpoint`: `endpoint` as an agent inside the sandbox addresses it."""
        return self.sandbox.agent_endpoint(endpoint)

    def read_file(self, rel_path: str, *, base: Base = "work", max_bytes: int = READ_MAX_BYTES,
                  tail: bool = False) -> bytes:
        """As `Sandbox.read_file` (bounded, no symlink followed)."""
        return self.sandbox.read_file(rel_path, base=base, max_bytes=max_bytes, tail=tail)

    def write_file(self, rel_path: str, data: str | bytes, *, base: Base = "work", mode: int = 0o644) -> None:
        """As `Sandbox.write_file` (no symlink followed, parents created)."""
        self.sandbox.write_file(rel_path, data, base=base, mode=mode)

    def exec(self, cmd: str | list[str], timeout_s: float, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> ExecResult:
        """As `Sandbox.exec`, blocking until the command ends or is killed at `timeout_s`."""
        return _run(self._loop, self.sandbox.exec(cmd, timeout_s, env=env, cwd=cwd))

    def spawn(self, argv: list[str], env: dict[str, str] | None = None,
              log_file: str | None = None) -> BlockingProcess:
        """As `Sandbox.spawn`: a background process in the work dir, owned by the sandbox."""
        return BlockingProcess(_run(self._loop, self.sandbox.spawn(argv, env=env, log_file=log_file)), self._loop)

    def kill_processes(self) -> int:
        """As `Sandbox.kill_processes`: every process of the sandbox killed, files kept."""
        return _run(self._loop, self.sandbox.kill_processes())

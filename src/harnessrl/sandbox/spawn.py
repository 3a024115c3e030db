"""Child processes started from the event loop without leaking descriptors, on any loop.

Responsibility: start a sandbox's host process (a command, an agent, a podman client) with
`subprocess.Popen` and wait for it and read its pipes on the running asyncio loop, so that
the child gets exactly stdin, stdout and stderr and nothing else, whichever loop runs.

Why not `asyncio.create_subprocess_exec`: under uvloop (0.23) the child inherits more than
its three stdio descriptors (a second copy of its stdout and stderr sockets, /dev/null, a
loop pipe), whatever `close_fds` says. A background child of the command (`sleep 3 &`) then
holds the stdout socket open after the command exited, and its reader never sees EOF.
`Popen` closes every descriptor above 2 in the child after its dup2s (and after
`preexec_fn`), on every loop.

Semantics, the same on every loop: `Child.wait()` returns when the process exited (not when
its pipes closed: background children may keep them open; the caller decides how long to
read after); the exit status is `Popen`'s (negative signal number for a signal). The exit is
noticed through a pidfd registered with the loop (`add_reader`), or, where the kernel has no
`pidfd_open`, a thread blocked in `waitpid` for this one pid. Only this pid is ever reaped.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

__all__ = ["DEVNULL", "PIPE", "STDOUT", "Child", "start"]


class Child:
    """A running host process: `pid`, `returncode` (None while running), `stdout` / `stderr`
    (`asyncio.StreamReader` when started with PIPE, else None), `wait()`, `send_signal()`,
    `kill()`, `close_pipes()`. Create with `start`."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen  # kept: a collected Popen of a live child would reap it later itself
        self._loop = loop
        self._exited: asyncio.Future[int] = loop.create_future()
        self._transports: list[asyncio.BaseTransport] = []
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._pidfd: int | None = None

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        """The exit status, once the process exited (cancelling the caller does not cancel
        the watch)."""
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        """Signal the process unless it was already reaped."""
        if not self._exited.done():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(9)

    def close_pipes(self) -> None:
        """Close the parent's ends of stdout/stderr (unread bytes are dropped)."""
        for transport in self._transports:
            transport.close()

    async def _attach(self, pipe, limit: int) -> asyncio.StreamReader:
        reader = asyncio.StreamReader(limit=limit, loop=self._loop)
        transport, _ = await self._loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        self._transports.append(transport)
        return reader

    def _watch(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            threading.Thread(target=self._wait_in_thread, name=f"wait-{self.pid}", daemon=True).start()
            return
        self._loop.add_reader(self._pidfd, self._poll)
        self._poll()  # it may have exited before the reader was added

    def _poll(self) -> None:
        code = self._popen.poll()  # waitpid(pid, WNOHANG), this pid only
        if code is None or self._exited.done():
            return
        assert self._pidfd is not None, "polled through the pidfd"
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        self._exited.set_result(code)

    def _wait_in_thread(self) -> None:
        code = self._popen.wait()
        try:
            self._loop.call_soon_threadsafe(self._set_exited, code)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _set_exited(self, code: int) -> None:
        if not self._exited.done():
            self._exited.set_result(code)


async def start(
    argv: Sequence[str], *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
    stdin: int = DEVNULL, stdout: int = DEVNULL, stderr: int = DEVNULL,
    start_new_session: bool = False, preexec_fn: Callable[[], None] | None = None,
    limit: int = 1 << 16, pass_fds: Sequence[int] = (),
) -> Child:
    """Start `argv` with only descriptors 0, 1 and 2 (`stdin` / `stdout` / `stderr`: PIPE,
    DEVNULL, STDOUT for stderr, or an open descriptor the caller closes afterwards); piped
    outputs become `Child.stdout` / `Child.stderr` stream readers (buffer `limit` bytes).
    `pass_fds`: descriptors the child keeps besides those (e.g. for `bwrap --seccomp FD`).

    Raises what `subprocess.Popen` raises (FileNotFoundError for a missing executable,
    PermissionError, OSError, or `preexec_fn`'s failure as `SubprocessError`).
    """
    loop = asyncio.get_running_loop()
    popen = subprocess.Popen(
        list(argv), cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
        close_fds=True, start_new_session=start_new_session, preexec_fn=preexec_fn,
        pass_fds=tuple(pass_fds),
    )
    child = Child(popen, loop)
    try:
        if popen.stdout is not None:
            child.stdout = await child._attach(popen.stdout, limit)
        if popen.stderr is not None:
            child.stderr = await child._attach(popen.stderr, limit)
    except BaseException:
        child.close_pipes()
        popen.kill()
        popen.wait()
        raise
    child._watch()
    return child

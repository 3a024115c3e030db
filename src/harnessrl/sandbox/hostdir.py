"""What the local and the podman sandboxes share: a sandbox directory on the host.

Responsibility: the parts of the `Sandbox` seam that do not depend on how a command is
started. `HostDirSandbox` holds the directory `<root_dir>/<sandbox_id>/{work,home,tmp}`, the
relative-path checks (`_rel`, `agent_path`), the command environment built from scratch
(`base_env`, `_env`: PATH, LANG, HOME, TMPDIR, XDG_*, then the caller's variables, then the
markers `HARNESSRL_SANDBOX_ID` / `HARNESSRL_SANDBOX_DIR`), `read_file`, the `spawn` log file,
the `exec` skeleton (capped pipes, timeout, cancellation), the disk watchdog and the
cancellation-proof `close()`. `HostProcess` is the `wait` half of a `SandboxProcess`.

A backend subclass supplies how a command starts and stops (`_start_exec`, `_exec_exited`,
`_exec_timed_out`, `_exec_cancelled`), `kill_processes`, `_remove_rest` and `write_file`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from harnessrl.errors import SandboxError, SandboxLimitError
from harnessrl.sandbox.base import BASES, READ_MAX_BYTES, Base, ExecResult
from harnessrl.sandbox.fsread import UnsafePathError, open_file_beneath, read_beneath
from harnessrl.sandbox.procs import DIR_VAR, MARKER_VAR
from harnessrl.sandbox.spawn import DEVNULL, Child
from harnessrl.types import Endpoint

log = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n[harnessrl: output truncated, {dropped} more bytes]\n"
"""Appended to captured output that hit the cap."""
_XDG = {
    "XDG_CONFIG_HOME": "home/.config",
    "XDG_CACHE_HOME": "home/.cache",
    "XDG_DATA_HOME": "home/.local/share",
    "XDG_STATE_HOME": "home/.local/state",
    "XDG_RUNTIME_DIR": "tmp",
}

T = TypeVar("T")


def loopback_url(url: str) -> str:
    """`url` with its host replaced by 127.0.0.1 (scheme, port and path kept)."""
    parts = urlsplit(url)
    netloc = f"127.0.0.1:{parts.port}" if parts.port is not None else "127.0.0.1"
    return urlunsplit(parts._replace(netloc=netloc))


def loopback_endpoint(endpoint: Endpoint) -> Endpoint:
    """`endpoint` with the host of `base_url` (and of `keyed_base_url`, when set) on 127.0.0.1."""
    keyed = loopback_url(endpoint.keyed_base_url) if endpoint.keyed_base_url else ""
    return dataclasses.replace(endpoint, base_url=loopback_url(endpoint.base_url), keyed_base_url=keyed)


def disk_usage(root: Path) -> int:
    """Allocated bytes (st_blocks * 512) of every file and directory under `root`, symlinks not
    followed; entries vanishing mid-walk are skipped."""
    total = 0
    stack = [str(root)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                except OSError:
                    continue
    return total


def resolve_inside(base: Path, rel_path: str | Path) -> Path:
    """`base / rel_path` with symlinks resolved; raises SandboxError when it leaves `base`."""
    candidate = (base / rel_path).resolve()
    if not candidate.is_relative_to(base):
        raise SandboxError(f"path {str(rel_path)!r} escapes the sandbox directory {base}")
    return candidate


class Capture:
    """What a drained stream gave so far: the first `cap_bytes` bytes (`kept`) and how many
    more were dropped."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.kept = bytearray()
        self.dropped = 0

    def text(self) -> str:
        """`kept` as UTF-8 (invalid bytes replaced), plus `TRUNCATION_MARKER` when bytes were
        dropped."""
        text = self.kept.decode("utf-8", errors="replace")
        return text + TRUNCATION_MARKER.format(dropped=self.dropped) if self.dropped else text


async def drain(stream: asyncio.StreamReader, capture: Capture) -> None:
    """Read `stream` to EOF into `capture` (which keeps what was read if this is cancelled)."""
    while chunk := await stream.read(1 << 16):
        room = capture.cap_bytes - len(capture.kept)
        capture.kept += chunk[:room]
        capture.dropped += max(0, len(chunk) - room)


async def complete_shielded(make: Callable[[], Awaitable[T]]) -> T:
    """Await `make()` to completion even when the awaiting task is cancelled (which then gets
    CancelledError once it completed)."""
    task = asyncio.ensure_future(make())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


class HostProcess:
    """The `wait` half of a `SandboxProcess` whose handle is the host process `proc`."""

    def __init__(self, proc: Child) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self, timeout_s: float | None = None) -> int | None:
        """Exit status, or None when still running after `timeout_s` seconds."""
        if self._proc.returncode is not None:
            return self._proc.returncode
        try:
            return await asyncio.wait_for(asyncio.shield(self._proc.wait()), timeout_s)
        except asyncio.TimeoutError:
            return None


class HostDirSandbox:
    """A sandbox whose directory `root` (`work/`, `home/`, `tmp/`) is on the host at the same
    path its processes see. `config` needs `path`, `output_cap_bytes`, `disk_bytes` and
    `disk_poll_s`."""

    _disk_action = "killing its processes"
    """What the disk watchdog's warning says it does."""

    def __init__(self, sandbox_id: str, root: Path, config: Any) -> None:
        self.sandbox_id = sandbox_id
        self._root = root
        self.config = config
        self._watchdog: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self.disk_exceeded = False
        """True once the sandbox directory outgrew `disk_bytes` (its processes were killed)."""
        self.closed = False
        """True once `close()` started; no command can start after that."""

    @property
    def root(self) -> Path:
        """The sandbox directory (parent of workdir, home, tmp)."""
        return self._root

    @property
    def workdir(self) -> Path:
        return self._root / "work"

    @property
    def home(self) -> Path:
        return self._root / "home"

    def _rel(self, base: Base, rel_path: str) -> str:
        """`rel_path` under `base` relative to the sandbox root; SandboxError when unsafe."""
        if base not in BASES:
            raise SandboxError(f"sandbox {self.sandbox_id}: base={base!r} must be one of {', '.join(BASES)}")
        parts = Path(rel_path).parts
        if Path(rel_path).is_absolute() or ".." in parts:
            raise SandboxError(f"sandbox {self.sandbox_id}: path {rel_path!r} escapes the {base} dir "
                               "(must be relative, without '..' components)")
        return "/".join([base, *parts])

    def agent_path(self, base: Base, rel_path: str = "") -> str:
        """`rel_path` under `base` as processes in this sandbox see it: the host path, since the
        sandbox directory is bound at its own path wherever they run."""
        return str(self._root / self._rel(base, rel_path))

    def base_env(self) -> dict[str, str]:
        """The environment every command starts from (before the caller's additions)."""
        env = {
            "PATH": self.config.path,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(self.home),
            "TMPDIR": str(self._root / "tmp"),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.update({k: str(self._root / v) for k, v in _XDG.items()})
        return env

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = self.base_env()
        env.update(extra or {})
        # The markers are set last: a caller cannot remove them (leak detection relies on them).
        env[MARKER_VAR] = self.sandbox_id
        env[DIR_VAR] = str(self._root)
        return env

    def _check_startable(self, argv0: str) -> None:
        """Raises SandboxError when the sandbox is closed, SandboxLimitError when it is over its
        disk budget."""
        if self.closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed; cannot run {argv0!r}")
        if self.disk_exceeded:  # the agent's doing: its rollout scores as a failure (rewards/base.py)
            raise SandboxLimitError(f"sandbox {self.sandbox_id} exceeded disk_bytes="
                               f"{self.config.disk_bytes}; cannot run {argv0!r}")

    def _run_dir(self, cwd: Path | None) -> Path:
        """Where a command runs: `cwd` (inside the sandbox directory), else the workdir."""
        return resolve_inside(self._root, cwd) if cwd is not None else self.workdir

    def _started(self) -> None:
        """Called after each command started: starts the disk watchdog once, when bounded."""
        if self.config.disk_bytes is not None and self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch_disk(self.config.disk_bytes))

    async def _watch_disk(self, limit: int) -> None:
        """Every `disk_poll_s`, sum the sandbox directory's allocated bytes; past `limit`, kill
        every process of the sandbox and refuse further commands."""
        while not self.closed:
            await asyncio.sleep(self.config.disk_poll_s)
            used = await asyncio.to_thread(disk_usage, self._root)
            if used > limit:
                self.disk_exceeded = True
                log.warning("sandbox %s holds %d bytes > disk_bytes=%d: %s",
                            self.sandbox_id, used, limit, self._disk_action)
                await self._disk_stop()
                return

    async def _disk_stop(self) -> None:
        """The watchdog's kill, once the directory outgrew `disk_bytes`: `kill_processes`
        (a backend whose kill is slow to start stops the writers faster first)."""
        await self.kill_processes()

    def _open_log(self, log_file: str | None) -> int:
        """A descriptor appending to `log_file` under home (opened without following links), or
        DEVNULL when None; SandboxError when the path is unsafe. The caller closes it."""
        if log_file is None:
            return DEVNULL
        try:
            return open_file_beneath(self._root, self._rel("home", log_file), append=True)
        except UnsafePathError as e:
            raise SandboxError(f"sandbox {self.sandbox_id}: log {log_file!r} not opened: {e.strerror}") from None

    def read_file(
        self, rel_path: str, *, base: Base = "work", max_bytes: int = READ_MAX_BYTES, tail: bool = False
    ) -> bytes:
        """At most `max_bytes` of `rel_path` under `base` (its first bytes, or its last with
        `tail`), no symlink followed at any component (`sandbox/fsread.py`). Raises
        FileNotFoundError, or SandboxError for a symlink, a special file or a `..` component."""
        try:
            return read_beneath(self._root, self._rel(base, rel_path), max_bytes, tail=tail)
        except UnsafePathError as e:
            raise SandboxError(f"sandbox {self.sandbox_id}: {rel_path!r} not read (escapes the {base} dir or "
                               f"crosses a link): {e.strerror}") from None

    # --- exec: the skeleton, with the backend's hooks -------------------------------------

    async def _start_exec(self, argv: list[str], env: dict[str, str] | None,
                          cwd: Path | None) -> tuple[Any, Child]:
        """Start `argv` with piped stdout/stderr; (the backend's handle, the host process).
        A FileNotFoundError makes `exec` return 127."""
        raise NotImplementedError

    async def _exec_exited(self, handle: Any) -> None:
        """After the command exited by itself, before its pipes are read to the end."""

    async def _exec_timed_out(self, handle: Any, proc: Child) -> None:
        """Kill the command at its timeout and reap it."""
        raise NotImplementedError

    def _exec_cancelled(self, handle: Any) -> Awaitable[Any] | None:
        """Kill the command now (the awaiting task was cancelled); an awaitable to finish the
        kill shielded, or None."""
        raise NotImplementedError

    @property
    def _pipe_grace_s(self) -> float:
        """How long a command's pipes may stay open after it exited (background children)."""
        raise NotImplementedError

    async def exec(
        self, cmd: str | list[str], timeout_s: float, env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ExecResult:
        """Run `cmd` (a string runs under `bash -c`) for at most `timeout_s` wall seconds.

        At the timeout (or when the awaiting task is cancelled) the command is killed. stdout
        and stderr keep `output_cap_bytes` each, then a marker. A missing executable comes
        back as returncode 127, like a shell's.
        """
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
        started = time.monotonic()
        try:
            handle, proc = await self._start_exec(argv, env, cwd)
        except FileNotFoundError as e:
            return ExecResult(127, "", f"{argv[0]}: {e}", False, time.monotonic() - started)
        assert proc.stdout is not None and proc.stderr is not None, "exec pipes were requested"
        captures = [Capture(self.config.output_cap_bytes) for _ in range(2)]
        readers = [asyncio.ensure_future(drain(s, c)) for s, c in zip((proc.stdout, proc.stderr), captures)]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
            await self._exec_exited(handle)
            # Background children may keep the pipes open; give them a moment, not forever.
            await asyncio.wait(readers, timeout=self._pipe_grace_s)
        except asyncio.TimeoutError:
            timed_out = True
            await self._exec_timed_out(handle, proc)
            await asyncio.wait(readers, timeout=self._pipe_grace_s)
        except BaseException:
            stopping = self._exec_cancelled(handle)
            for reader in readers:
                reader.cancel()
            proc.close_pipes()
            if stopping is not None:
                await asyncio.shield(stopping)
            raise
        # what a pipe still held open by a background child gave until now is kept
        for reader in readers:
            reader.cancel()
        proc.close_pipes()
        outputs = [c.text() for c in captures]
        assert proc.returncode is not None, "the command was waited for"
        return ExecResult(proc.returncode, outputs[0], outputs[1], timed_out, time.monotonic() - started)

    # --- teardown -------------------------------------------------------------------------

    async def kill_processes(self) -> int:
        raise NotImplementedError

    async def _remove_rest(self) -> None:
        """What the backend removes after the directory (its cgroups, its private state)."""

    async def _teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        try:
            await self.kill_processes()
        finally:
            await asyncio.to_thread(shutil.rmtree, self._root, ignore_errors=True)
            await self._remove_rest()

    async def close(self) -> None:
        """Kill every process, remove the directory; idempotent and shielded from cancellation
        (a cancelled caller gets CancelledError while the teardown still completes)."""
        self.closed = True
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._teardown())
        await asyncio.shield(self._close_task)

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
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from harnessrl.errors import SandboxError, SandboxLimitError
from harnessrl.sandbox.base import BASES, READ_MAX_BYTES, Base, ExecResult
from harnessrl.sandbox.bwrap import map_tree_path
from harnessrl.sandbox.fsread import (
    UnsafePathError,
    escaped,
    open_dir_beneath,
    open_file_beneath,
    open_root,
    read_beneath,
    write_beneath,
)
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


MAX_WALK_DEPTH = 256
"""Deepest directory level `tree_usage` descends to; a tree deeper than this counts as over
every bound (`Usage.too_deep`): no task needs it, and it would cost a descriptor per level."""
_WALKS = threading.BoundedSemaphore(4)
"""Walks of this process at once (each holds up to `MAX_WALK_DEPTH` descriptors): many
sandboxes' deep trees cannot take the process to its descriptor limit together."""
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclasses.dataclass
class Usage:
    """What `tree_usage` counted: allocated bytes (st_blocks * 512), inodes (entries, the top
    directory included), and whether a level deeper than `MAX_WALK_DEPTH` exists."""

    bytes: int = 0
    inodes: int = 0
    too_deep: bool = False


def tree_usage(root: Path, setid_strip: bool = False) -> Usage:
    """Count every file and directory under `root` by walking directory descriptors
    (`openat` / `fstatat` relative to the parent's descriptor), so no path is ever longer
    than one name: a tree deeper than PATH_MAX is counted like any other. Links are not
    followed; entries vanishing mid-walk are skipped. With `setid_strip`, setuid / setgid
    bits are cleared from every regular file met (`fchmod` through a descriptor opened
    without following links) and nothing is counted past `MAX_WALK_DEPTH` (`strip_setid`).

    Holds one descriptor per level of the current branch (at most `MAX_WALK_DEPTH`); at most
    four walks run at once in a process (the others wait).
    """
    with _WALKS:
        return _tree_usage(root, setid_strip)


def _tree_usage(root: Path, setid_strip: bool) -> Usage:
    usage = Usage()
    try:
        top = os.open(root, _DIR_OPEN)
    except OSError:
        return usage
    usage.inodes, usage.bytes = 1, os.fstat(top).st_blocks * 512
    stack: list[tuple[int, Any]] = [(top, os.scandir(top))]
    try:
        while stack:
            fd, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                entries.close()
                os.close(fd)
                stack.pop()
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            usage.inodes += 1
            usage.bytes += st.st_blocks * 512
            if setid_strip and stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                _strip(fd, entry.name)
            if not stat.S_ISDIR(st.st_mode):
                continue
            if len(stack) >= MAX_WALK_DEPTH:
                usage.too_deep = True
                continue
            try:
                sub = os.open(entry.name, _DIR_OPEN, dir_fd=fd)
            except OSError:
                continue
            try:
                stack.append((sub, os.scandir(sub)))
            except OSError:
                os.close(sub)
    finally:
        for fd, entries in stack:
            entries.close()
            os.close(fd)
    return usage


def _strip(dir_fd: int, name: str) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dir_fd)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
    except OSError:
        pass
    finally:
        os.close(fd)


def strip_setid(root: Path) -> Usage:
    """Clear setuid / setgid bits of every regular file under `root` (no link followed), so
    that nothing an agent planted runs with its owner's ids for a host user; called once the
    sandbox's processes are dead, before the host reads or runs anything of it. A tree deeper
    than `MAX_WALK_DEPTH` is stripped to that depth (the levels below are out of every host
    reader's reach: they copy and read at most 32 levels)."""
    return tree_usage(root, setid_strip=True)


def disk_usage(root: Path) -> int:
    """Allocated bytes (st_blocks * 512) of every file and directory under `root`, symlinks not
    followed (`tree_usage`)."""
    return tree_usage(root).bytes


def remove_tree(root: Path) -> list[str]:
    """Remove `root` and everything under it, at any depth, without recursion and holding at
    most two descriptors: descend through `openat`, climb back through `..` (checked to be the
    directory descended from, by device and inode), `unlinkat` on the way. A directory that
    cannot be read is made 0700 first (a non-root host user owns what it removes). An entry
    that cannot be removed is recorded and skipped; the rest is still removed. Returns the
    errors (empty when `root` is gone or never existed). Call it once no process writes there.
    """
    errors: list[str] = []
    try:
        cur = os.open(root, _DIR_OPEN)
    except FileNotFoundError:
        return errors
    except OSError as e:
        try:
            os.chmod(root, 0o700, follow_symlinks=False)
            cur = os.open(root, _DIR_OPEN)
        except OSError:
            return [f"{root}: {e}"]
    names: list[str] = []  # the branch below root, by name
    idents: list[tuple[int, int]] = [_ident(cur)]
    skipped: list[set[str]] = [set()]
    try:
        while True:
            descended = False
            try:
                with os.scandir(cur) as entries:
                    listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            except OSError as e:
                errors.append(f"{'/'.join([str(root), *names])}: {e}")
                listed = []
            for name, is_dir in listed:
                if name in skipped[-1]:
                    continue
                if not is_dir:
                    try:
                        os.unlink(name, dir_fd=cur)
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        errors.append(f"{'/'.join([str(root), *names, name])}: {e}")
                        skipped[-1].add(name)
                    continue
                try:
                    os.rmdir(name, dir_fd=cur)  # an empty directory goes at once
                    continue
                except FileNotFoundError:
                    continue
                except OSError:
                    pass
                try:
                    sub = _open_dir_for_removal(name, cur)
                except OSError as e:
                    errors.append(f"{'/'.join([str(root), *names, name])}: {e}")
                    skipped[-1].add(name)
                    continue
                os.close(cur)
                cur = sub
                names.append(name)
                idents.append(_ident(cur))
                skipped.append(set())
                descended = True
                break
            if descended:
                continue
            if not names:
                break
            # this level is as empty as it gets: climb back and remove it
            parent = os.open("..", _DIR_OPEN, dir_fd=cur)
            os.close(cur)
            cur = parent
            name = names.pop()
            idents.pop()
            skipped.pop()
            if _ident(cur) != idents[-1]:
                errors.append(f"{root}: a directory moved during removal; stopped")
                return errors
            try:
                os.rmdir(name, dir_fd=cur)
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append(f"{'/'.join([str(root), *names, name])}: {e}")
                skipped[-1].add(name)
    finally:
        os.close(cur)
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError as e:
        errors.append(f"{root}: {e}")
    return errors


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_dir_for_removal(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR_OPEN, dir_fd=dir_fd)
    except PermissionError:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{fd}", 0o700)
        finally:
            os.close(fd)
        return os.open(name, _DIR_OPEN, dir_fd=dir_fd)


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
    path its processes see. `config` needs `path`, `output_cap_bytes`, `disk_bytes`,
    `disk_inodes` and `disk_poll_s`."""

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
        self._tree_points: dict[Path, str] = {}
        """Read-only tree (host path) -> its mount point inside (`bwrap.inner_tree_points`);
        empty where commands see the host's paths."""

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

    def tree_path(self, host_path: Path) -> str:
        """`host_path` (a file of a read-only tree) as this sandbox's processes see it
        (`sandbox.base.MountsTrees`)."""
        return map_tree_path(self._tree_points, host_path)

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
            raise SandboxLimitError(f"sandbox {self.sandbox_id} exceeded disk_bytes={self.config.disk_bytes} "
                                    f"or disk_inodes={self.config.disk_inodes}; cannot run {argv0!r}")

    def _run_dir(self, cwd: Path | None) -> Path:
        """Where a command runs: `cwd` (inside the sandbox directory), else the workdir."""
        return resolve_inside(self._root, cwd) if cwd is not None else self.workdir

    def _started(self) -> None:
        """Called after each command started: starts the disk watchdog once, when bounded."""
        bounded = self.config.disk_bytes is not None or self.config.disk_inodes is not None
        if bounded and self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch_disk())

    async def _watch_disk(self) -> None:
        """Every `disk_poll_s`, count the sandbox directory's allocated bytes and inodes
        (`tree_usage`, by descriptors: any depth); past `disk_bytes` or `disk_inodes`, or
        deeper than `MAX_WALK_DEPTH`, kill every process of the sandbox and refuse further
        commands (`disk_exceeded`)."""
        cfg = self.config
        while not self.closed:
            await asyncio.sleep(cfg.disk_poll_s)
            used = await asyncio.to_thread(tree_usage, self._root)
            over = [f"{used.bytes} bytes > disk_bytes={cfg.disk_bytes}"
                    if cfg.disk_bytes is not None and used.bytes > cfg.disk_bytes else "",
                    f"{used.inodes} inodes > disk_inodes={cfg.disk_inodes}"
                    if cfg.disk_inodes is not None and used.inodes > cfg.disk_inodes else "",
                    f"directories deeper than {MAX_WALK_DEPTH} levels" if used.too_deep else ""]
            if any(over):
                self.disk_exceeded = True
                log.warning("sandbox %s holds %s: %s", self.sandbox_id, ", ".join(o for o in over if o),
                            self._disk_action)
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

    def _exit_status(self, handle: object, code: int) -> int:
        """The exit status to report for the command `handle` whose host process exited with
        `code` (the backend's correction of its runtime's status; `code` as it is here)."""
        return code

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
        return ExecResult(self._exit_status(handle, proc.returncode), outputs[0], outputs[1], timed_out,
                          time.monotonic() - started)

    # --- teardown -------------------------------------------------------------------------

    async def kill_processes(self) -> int:
        raise NotImplementedError

    async def _remove_rest(self) -> None:
        """What the backend removes after the directory (its cgroups, its private state)."""

    async def _teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()  # and let a kill in progress unwind before ours starts
            await asyncio.gather(self._watchdog, return_exceptions=True)
        try:
            await self.kill_processes()
        finally:
            try:
                errors = await asyncio.to_thread(remove_tree, self._root)
                if errors:
                    log.warning("sandbox %s: %d entries not removed: %s", self.sandbox_id, len(errors),
                                escaped("; ".join(errors[:3])))
            finally:
                await self._remove_rest()

    def _strip_setid(self) -> None:
        """Clear setuid / setgid bits under the sandbox directory (`strip_setid`); called by
        `kill_processes` once no process of the sandbox is left."""
        strip_setid(self._root)

    def _write_owned(self, rel: str, raw: bytes, mode: int, owner: tuple[int, int] | None) -> None:
        """Write `rel` (relative to the root, no link followed); with `owner` (uid, gid), the
        file and every directory of `rel` below the root belong to it. Raises UnsafePathError."""
        write_beneath(self._root, rel, raw, mode, owner=owner)
        if owner is not None:
            self._own_parents(rel, owner)

    def _own_parents(self, rel: str, owner: tuple[int, int]) -> None:
        """chown to `owner` every directory of `rel` below the root, through descriptors
        opened without following links."""
        parts = rel.split("/")[:-1]
        root_fd = open_root(self._root)
        try:
            for depth in range(1, len(parts) + 1):
                fd = open_dir_beneath(root_fd, "/".join(parts[:depth]), shown=str(self._root))
                try:
                    st = os.fstat(fd)
                    if (st.st_uid, st.st_gid) != owner:
                        os.fchown(fd, *owner)
                finally:
                    os.close(fd)
        finally:
            os.close(root_fd)

    async def close(self) -> None:
        """Kill every process, remove the directory; idempotent and shielded from cancellation
        (a cancelled caller gets CancelledError while the teardown still completes)."""
        self.closed = True
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._teardown())
        await asyncio.shield(self._close_task)

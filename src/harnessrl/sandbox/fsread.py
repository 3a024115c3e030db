"""Host-side file access to a sandbox tree that never follows a path the agent controls.

Responsibility: the only way host code (`LocalSandbox.read_file` / `write_file` / `spawn`'s log,
which harnesses use; verifiers) reads files an agent could have touched, or creates files and
directories inside a sandbox. DESIGN.md §10: "host-side code never
follows a path the agent controls".

How: the sandbox root (the common parent of `Sandbox.workdir` and `Sandbox.home`, a path the
host created and resolved) is opened with `O_NOFOLLOW | O_DIRECTORY`; every component below it
is opened relative to its parent's descriptor (`dir_fd`) with `O_NOFOLLOW`, so a symlink at
any component (`work` itself, `home/.harnessrl`, the file) fails the open with ELOOP/ENOTDIR
instead of being followed. `..` components, absolute and empty paths are refused before any open.
Files are opened `O_NONBLOCK` and must be regular files after `fstat` (a FIFO, socket or device
planted by the agent is refused without blocking); reads are bounded.

Errors: `UnsafePathError` (a symlink or a non-regular file where a file or directory was
expected; the agent's doing) and `FileNotFoundError`. The `*_or_none` helpers turn both into
None and log unsafe paths at WARNING, so a planted link reads as "missing", noted.

What it does not do: run anything, or defend against an agent process that is still running
(callers read after the agent's processes are dead).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 20
"""Default read bound of one file, bytes."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A component of a sandbox path is a symlink or not the kind of file expected."""


class _HasDirs(Protocol):
    @property
    def workdir(self) -> Path: ...

    @property
    def home(self) -> Path: ...


def escaped(text: object) -> str:
    """`str(text)` with every character that is not printable written as a Python escape
    (`\\x1b`, `\\n`): a file name an agent chose reaches a log line, and through it a terminal,
    without acting on it (an OSC 52 clipboard write, a screen clear) or forging a line."""
    shown = str(text)
    return shown if shown.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)


def sandbox_root(sandbox: _HasDirs) -> Path:
    """The directory holding a sandbox's `workdir` and `home` (their common parent)."""
    return Path(os.path.commonpath([sandbox.workdir, sandbox.home]))


def _parts(rel_path: str | os.PathLike[str]) -> list[str]:
    parts = PurePosixPath(os.fspath(rel_path)).parts
    if not parts or parts[0] == "/" or ".." in parts:
        raise UnsafePathError(errno.EINVAL, f"path {os.fspath(rel_path)!r} must be relative, "
                                            "without '..' components")
    return list(parts)


def relative_to_root(root: Path, path: Path) -> str:
    """`path` relative to `root` (both absolute host paths); UnsafePathError when outside."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(root))
    except ValueError:
        raise UnsafePathError(errno.EXDEV, f"{path} is not inside the sandbox root {root}") from None


def _open_component(name: str, flags: int, dir_fd: int, shown: str, mode: int = 0o600) -> int:
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise UnsafePathError(e.errno, f"{shown}: a symlink (not followed)") from None
        if e.errno == errno.ENOTDIR:
            raise UnsafePathError(e.errno, f"{shown}: a symlink or not a directory (not followed)") from None
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, f"{shown}: no such file") from None
        raise


def open_root(root: Path) -> int:
    """A directory descriptor of the sandbox root (its last component not followed)."""
    parent_fd = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _open_component(root.name, _DIR_FLAGS, parent_fd, str(root))
    finally:
        os.close(parent_fd)


def open_dir_beneath(root_fd: int, rel_path: str | os.PathLike[str], *, shown: str = "") -> int:
    """Descriptor of directory `rel_path` below `root_fd`, no component followed if a symlink."""
    fd = os.dup(root_fd)
    walked = shown
    try:
        for part in _parts(rel_path):
            walked = f"{walked}/{part}"
            nxt = _open_component(part, _DIR_FLAGS, fd, walked)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _opened_file(root: Path, rel_path: str | os.PathLike[str]) -> Iterator[int]:
    parts = _parts(rel_path)
    root_fd = open_root(root)
    try:
        dir_fd = open_dir_beneath(root_fd, "/".join(parts[:-1]), shown=str(root)) if len(parts) > 1 \
            else os.dup(root_fd)
    finally:
        os.close(root_fd)
    try:
        fd = _open_component(parts[-1], _FILE_FLAGS, dir_fd, f"{root}/{'/'.join(parts)}")
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(errno.EINVAL, f"{root}/{'/'.join(parts)}: not a regular file")
        yield fd
    finally:
        os.close(fd)


def _read_up_to(fd: int, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    left = max_bytes
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_beneath(
    root: Path, rel_path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES, *, tail: bool = False
) -> bytes:
    """At most `max_bytes` of regular file `root/rel_path` (the first ones, or the last ones
    with `tail`), following no symlink at any component below `root`.

    Raises:
        FileNotFoundError: a component does not exist.
        UnsafePathError: a component is a symlink, a non-directory, or the file is not regular.
        ValueError: `max_bytes` < 0.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    with _opened_file(root, rel_path) as fd:
        if tail:
            size = os.fstat(fd).st_size
            os.lseek(fd, max(0, size - max_bytes), os.SEEK_SET)
        return _read_up_to(fd, max_bytes)


def read_text_or_none(
    root: Path, rel_path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES, *, tail: bool = False
) -> str | None:
    """`read_beneath` decoded as UTF-8 with replacement; None when missing, and None (logged at
    WARNING as "not followed") when unsafe: a symlink or special file reads as missing."""
    try:
        return read_beneath(root, rel_path, max_bytes, tail=tail).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except (UnsafePathError, IsADirectoryError) as e:
        log.warning("sandbox file not read: %s", escaped(e))
        return None


def open_file_beneath(root: Path, rel_path: str | os.PathLike[str], mode: int = 0o644, *,
                      append: bool = False) -> int:
    """A write descriptor of regular file `root/rel_path` (created when missing; truncated, or
    positioned at its end with `append`), creating missing parent directories, following no
    symlink at any component below `root`. The caller closes it.

    Raises:
        UnsafePathError: a component is a symlink or not a directory, the file is a symlink or
            not a regular file, or the path has `..` components.
    """
    parts = _parts(rel_path)
    root_fd = open_root(root)
    fd = root_fd
    try:
        walked = str(root)
        for part in parts[:-1]:
            walked = f"{walked}/{part}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            nxt = _open_component(part, _DIR_FLAGS, fd, walked)
            os.close(fd)
            fd = nxt
        shown = f"{root}/{'/'.join(parts)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        out = _open_component(parts[-1], flags | (os.O_APPEND if append else 0), fd, shown, mode)
    finally:
        os.close(fd)
    try:
        if not stat.S_ISREG(os.fstat(out).st_mode):
            raise UnsafePathError(errno.EINVAL, f"{shown}: not a regular file")
        if not append:
            os.ftruncate(out, 0)
        os.fchmod(out, mode)
    except BaseException:
        os.close(out)
        raise
    return out


def write_beneath(root: Path, rel_path: str | os.PathLike[str], data: bytes, mode: int = 0o644, *,
                  owner: tuple[int, int] | None = None) -> None:
    """Write `data` to `root/rel_path` (created or truncated, file mode `mode`, owned by `owner`
    (uid, gid) when given), creating missing parent directories, following no symlink at any
    component below `root`.

    Raises:
        UnsafePathError: a component is a symlink or not a directory, the file is a symlink,
            or the path has `..` components.
        OSError: the write itself failed.
    """
    _write_all(open_file_beneath(root, rel_path, mode), data, owner)


def write_new_file(dir_fd: int, name: str, data: bytes, mode: int = 0o600, *,
                   owner: tuple[int, int] | None = None) -> None:
    """Create `name` (one component) in `dir_fd` exclusively (never through a link) with `data`,
    owned by `owner` (uid, gid) when given."""
    (part,) = _parts(name)
    _write_all(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                       dir_fd=dir_fd), data, owner)


def _write_all(fd: int, data: bytes, owner: tuple[int, int] | None) -> None:
    """Give open file `fd` to `owner` (uid, gid) when given, write all of `data`, close it."""
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


@dataclass
class CopyReport:
    """What `copy_tree_beneath` copied and what it left out (and why)."""

    files: int = 0
    bytes: int = 0
    entries: int = 0
    """Directory entries looked at (files, directories, links, special files)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Relative path -> reason (`symlink`, `special file`, `size bound`, `exists`, ...); at most
    `SKIPPED_KEPT` are listed."""
    truncated: bool = False
    """True when a bound (entries, files, bytes, depth) left something out."""
    exceeded: str | None = None
    """The first bound the tree went past (`max_entries=N`, `max_files=N`, `max_bytes=N`,
    `max_depth=N`), None when everything fitted."""

    def _skip(self, rel: str, why: str) -> None:
        if len(self.skipped) < SKIPPED_KEPT:
            self.skipped[rel] = why

    def _bound(self, rel: str, bound: str) -> None:
        self._skip(rel, "depth bound" if bound.startswith("max_depth") else "size bound")
        self.truncated = True
        self.exceeded = self.exceeded or bound


SKIPPED_KEPT = 1000
"""At most this many skipped paths are listed in a `CopyReport`."""


def copy_tree_beneath(
    src_fd: int, dst_fd: int, *, max_files: int = 10_000, max_bytes: int = 64 << 20,
    max_depth: int = 32, max_entries: int = 100_000, owner: tuple[int, int] | None = None,
) -> CopyReport:
    """Copy the regular files and directories of `src_fd` into `dst_fd`, following no link.

    Symlinks and special files (FIFOs, sockets, devices) are skipped and listed; a name that
    already exists in the destination is kept (the destination's file wins). Bounds: a file
    that would pass `max_files` files or `max_bytes` bytes, and a directory deeper than
    `max_depth`, is skipped; past `max_entries` directory entries looked at (of any kind) the
    walk stops. Each sets `truncated` and, the first one, `exceeded`. The walk keeps an
    explicit stack of open descriptors (at most `max_depth` + 1 pairs), never recursion, and
    reads each directory as a stream, so neither depth nor a directory of millions of entries
    costs more than the bounds. Files are created `O_EXCL | O_NOFOLLOW`, mode 0600
    (directories 0700), owned by `owner` (uid, gid) when given.
    """
    report = CopyReport()
    stack: list[tuple[int, int, str, int]] = [(os.dup(src_fd), os.dup(dst_fd), "", 0)]
    try:
        while stack:
            src, dst, prefix, depth = stack.pop()
            try:
                if not _copy_dir(src, dst, prefix, depth, stack, report, max_files=max_files,
                                 max_bytes=max_bytes, max_depth=max_depth, max_entries=max_entries,
                                 owner=owner):
                    return report
            finally:
                os.close(src)
                os.close(dst)
    finally:
        for src, dst, _, _ in stack:
            os.close(src)
            os.close(dst)
    return report


def _copy_dir(
    src: int, dst: int, prefix: str, depth: int, stack: list[tuple[int, int, str, int]], report: CopyReport,
    *, max_files: int, max_bytes: int, max_depth: int, max_entries: int, owner: tuple[int, int] | None,
) -> bool:
    """Copy the entries of one directory, pushing its subdirectories on `stack`; False once
    `max_entries` stopped the walk."""
    with os.scandir(src) as it:
        for entry in it:
            rel = f"{prefix}{entry.name}"
            report.entries += 1
            if report.entries > max_entries:
                report._bound(rel, f"max_entries={max_entries}")
                return False
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                report._skip(rel, "symlink")
            elif stat.S_ISDIR(st.st_mode):
                if depth + 1 > max_depth:
                    report._bound(rel, f"max_depth={max_depth}")
                    continue
                try:
                    os.mkdir(entry.name, 0o700, dir_fd=dst)
                except FileExistsError:
                    report._skip(rel, "exists")
                    continue
                try:
                    sub_src = _open_component(entry.name, _DIR_FLAGS, src, rel)
                except (UnsafePathError, FileNotFoundError):
                    report._skip(rel, "symlink")  # replaced between scan and open
                    continue
                try:
                    sub_dst = _open_component(entry.name, _DIR_FLAGS, dst, rel)
                    if owner is not None:
                        os.fchown(sub_dst, *owner)
                except BaseException:
                    os.close(sub_src)
                    raise
                stack.append((sub_src, sub_dst, f"{rel}/", depth + 1))
            elif stat.S_ISREG(st.st_mode):
                if report.files >= max_files:
                    report._bound(rel, f"max_files={max_files}")
                    continue
                if report.bytes + st.st_size > max_bytes:
                    report._bound(rel, f"max_bytes={max_bytes}")
                    continue
                try:
                    fd = _open_component(entry.name, _FILE_FLAGS, src, rel)
                except (UnsafePathError, FileNotFoundError):
                    report._skip(rel, "symlink")  # replaced between scan and open
                    continue
                try:
                    data = _read_up_to(fd, max_bytes - report.bytes)
                finally:
                    os.close(fd)
                try:
                    write_new_file(dst, entry.name, data, owner=owner)
                except FileExistsError:
                    report._skip(rel, "exists")
                    continue
                report.files += 1
                report.bytes += len(data)
            else:
                report._skip(rel, "special file")
    return True


def make_private_dir(root: Path, prefix: str, owner: tuple[int, int] | None = None) -> tuple[Path, int]:
    """Create a fresh directory `root/<prefix><random hex>` (mode 0700, owned by `owner` (uid,
    gid) when given) through the root's descriptor; returns its host path and an open
    descriptor of it (caller closes).

    The directory is new (`mkdir` fails on any existing name, link or not), so nothing the
    agent planted can redirect what is written into it. It belongs to this process's user and
    to the group of `root` (the sandbox owner's group, `sandbox/owner.py`), mode 2770: the
    verifier's commands, run as the sandbox's owner, may read it and create or remove files in
    it (files written with the default modes are 0640 and inherit the group); no other host
    user may enter it.
    """
    root_fd = open_root(root)
    try:
        name = f"{prefix}{secrets.token_hex(8)}"
        os.mkdir(name, 0o700, dir_fd=root_fd)
        fd = _open_component(name, _DIR_FLAGS, root_fd, f"{root}/{name}")
        if owner is not None:
            try:
                os.fchown(fd, *owner)
            except BaseException:
                os.close(fd)
                raise
        return root / name, fd
    finally:
        os.close(root_fd)


def owner_of_root(root: Path) -> tuple[int, int]:
    """(uid, gid) owning the sandbox root directory itself (its last component not followed):
    the user its commands run as, where the backend gives the sandbox to one."""
    fd = open_root(root)
    try:
        st = os.fstat(fd)
        return st.st_uid, st.st_gid
    finally:
        os.close(fd)

"""Getting the agent's submission out of a finished sandbox, and staging it for verification.

Responsibility: read what the agent submitted (a file in its workdir, or, for text-only
harnesses, a fenced code block / the text of its final answer) and create the fresh directory
the verifier runs in.

Invariants (DESIGN.md §3.5, §10):
  * nothing the agent wrote can change the verifier's code: the verify directory
    `<sandbox root>/verify-<random hex>/` is created at verify time, after every agent process
    is dead, beside (not inside) the workdir, by `mkdir` through a descriptor of the sandbox
    root, so no link the agent planted (a symlinked `work`, a pre-made directory) can redirect
    it. The verifier's own files (runner script, hidden tests, the copy of the submission) are
    written into it first, exclusively; then the workspace is copied in without following
    links (symlinks and special files skipped, the verifier's files win), on a worker thread
    (`stage_verify_dir`: the event loop keeps serving sibling rollouts), within `CopyLimits`
    (entries, files, bytes, depth). A workspace past them, or a filesystem the agent filled,
    raises `SandboxLimitError`: the agent's failure, scored 0 with its cause, never None.
    Everything in it belongs to the owner of the sandbox root, so a backend whose commands run
    as an unprivileged user (the sandbox's own uid) can read it; a sandbox root the agent made
    unenterable gets its owner's `u+rwx` back first.
    Verifier programs run there with `python3 -I` (isolated mode: no script-directory or user
    site-packages on sys.path, no PYTHON* environment variables), so a `sitecustomize.py`,
    `conftest.py` or module shadowing the standard library left by the agent is never imported;
  * the submission is read through `sandbox/fsread.py`: a symlink at any component of
    `work/<file>` reads as no submission. The directory goes with the sandbox at `close()`.

What this module deliberately does not do: run anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from harnessrl.errors import SandboxError, SandboxLimitError
from harnessrl.rewards.base import FULL_ERRNOS
from harnessrl.sandbox.base import Sandbox
from harnessrl.sandbox.fsread import (
    UnsafePathError,
    escaped,
    copy_tree_beneath,
    make_private_dir,
    open_dir_beneath,
    open_root,
    owner_of_root,
    read_text_or_none,
    relative_to_root,
    sandbox_root,
    write_new_file,
)

log = logging.getLogger(__name__)

_FENCED = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
MAX_SUBMISSION_BYTES = 1 << 20
"""The submission file is read up to this many bytes."""


def read_submission(sandbox: Sandbox, rel_path: str) -> str | None:
    """Text of `rel_path` in the sandbox's workdir (at most `MAX_SUBMISSION_BYTES`); None when
    missing, unreadable, or reached through a symlink at any component (the agent's doing:
    scored as no submission)."""
    root = sandbox_root(sandbox)
    try:
        rel = f"{relative_to_root(root, sandbox.workdir)}/{rel_path}"
    except UnsafePathError:
        return None
    try:
        return read_text_or_none(root, rel, MAX_SUBMISSION_BYTES)
    except (OSError, ValueError):
        return None


def code_from_answer(final_answer: str | None) -> str | None:
    """The last fenced code block of `final_answer` (```python ... ```), or None."""
    if not final_answer:
        return None
    blocks = _FENCED.findall(final_answer)
    return blocks[-1] if blocks else None


@dataclass(frozen=True, slots=True)
class CopyLimits:
    """Bounds of the workspace copy a verifier runs beside (`copy_tree_beneath`'s). A workspace
    past any of them is refused: `SandboxLimitError`, which the verifiers score as the agent's
    failure (reward 0, cause recorded), never as an unscored rollout."""

    max_entries: int = 100_000
    """Directory entries looked at, of any kind (files, directories, links, special files)."""
    max_files: int = 10_000
    max_bytes: int = 64 << 20
    max_depth: int = 32


def new_verify_dir(sandbox: Sandbox, files: dict[str, str], copy_workspace: bool = True,
                   limits: CopyLimits = CopyLimits()) -> Path:
    """Create a fresh `<sandbox root>/verify-<hex>/` holding `files` (name -> text, single
    path components) and, with `copy_workspace`, a link-free copy of the workdir; returns its
    host path (pass it as `cwd` to `sandbox.exec`). The directory and everything in it belong
    to the owner of the sandbox root (the user the backend runs commands as: the sandbox's own
    uid), mode 0700 / 0600. Blocking (it walks the agent's tree): call it through
    `stage_verify_dir` on an event loop.

    Raises:
        SandboxLimitError: the workspace goes past `limits` (named), or the filesystem is full
            (ENOSPC, EDQUOT: no blocks or inodes left) while staging; both the agent's doing.
        SandboxError: the directory cannot be created or written otherwise (the sandbox root
            is gone or not a directory).
    """
    root = sandbox_root(sandbox)
    try:
        owner = owner_of_root(root)
        _restore_owner_access(root)
        path, dir_fd = make_private_dir(root, "verify-", owner)
    except OSError as e:
        raise _staging_error(f"cannot create the verify directory under {root}", e) from e
    try:
        for name, text in files.items():
            write_new_file(dir_fd, name, text.encode("utf-8"), owner=owner)
        if copy_workspace:
            _copy_workspace(sandbox, root, dir_fd, owner, limits)
    except OSError as e:
        raise _staging_error(f"cannot write the verify directory {path}", e) from e
    finally:
        os.close(dir_fd)
    return path


async def stage_verify_dir(sandbox: Sandbox, files: dict[str, str], copy_workspace: bool = True,
                           limits: CopyLimits = CopyLimits()) -> Path:
    """`new_verify_dir` on a worker thread, so that copying a large workspace never holds up
    the event loop (the proxy's calls of sibling rollouts run on it). Same result and errors."""
    return await asyncio.to_thread(new_verify_dir, sandbox, files, copy_workspace, limits)


def _restore_owner_access(root: Path) -> None:
    """Give the sandbox root's owner back read, write and search on it (`u+rwx`): an agent may
    have made its own directory unenterable (`chmod 0`), which would stop the verifier's
    commands, run as that owner, from reaching the verify directory below it."""
    fd = open_root(root)
    try:
        mode = os.fstat(fd).st_mode & 0o7777
        if mode & 0o700 != 0o700:
            os.fchmod(fd, mode | 0o700)
    finally:
        os.close(fd)


def _staging_error(what: str, e: OSError) -> SandboxError:
    if e.errno in FULL_ERRNOS:
        return SandboxLimitError(f"{what}: the sandbox's filesystem is full ({e.strerror})")
    return SandboxError(f"{what}: {e}")


def _copy_workspace(sandbox: Sandbox, root: Path, dst_fd: int, owner: tuple[int, int], limits: CopyLimits) -> None:
    root_fd = open_root(root)
    try:
        src_fd = open_dir_beneath(root_fd, relative_to_root(root, sandbox.workdir), shown=str(root))
    except (FileNotFoundError, UnsafePathError) as e:
        log.warning("workspace not copied for verification: %s", escaped(e))
        return
    finally:
        os.close(root_fd)
    try:
        report = copy_tree_beneath(src_fd, dst_fd, max_files=limits.max_files, max_bytes=limits.max_bytes,
                                   max_depth=limits.max_depth, max_entries=limits.max_entries, owner=owner)
    finally:
        os.close(src_fd)
    if report.exceeded is not None:
        raise SandboxLimitError(f"the workspace goes past the verifier's copy bound {report.exceeded} "
                                f"({report.entries} entries looked at, {report.files} files, {report.bytes} bytes "
                                "copied)")
    if report.skipped:
        shown = escaped(", ".join(f"{k} ({v})" for k, v in list(report.skipped.items())[:5]))
        log.info("verify copy of %s skipped %d entries: %s", sandbox.workdir, len(report.skipped), shown)

"""Running one loop-owning CLI agent process in a sandbox: start, wall-clock timeout, tree kill.

Responsibility: the machinery every CLI harness shares.
  * where an agent's private files go: `<sandbox home>/.harnessrl/<agent>/` for its config
    and state, `<sandbox home>/.harnessrl/<agent>.log` for its stdout+stderr; both outside the
    workdir the verifier scores;
  * the base environment an agent gets (built from scratch: HOME, XDG dirs, PATH, locale;
    never the endpoint or the key, which reach the agents through their own config files);
  * `run_agent_process`: spawn through `Sandbox.spawn`, wait at most `timeout_s`, then kill
    the agent's whole process tree (SIGTERM, `kill_grace_s`, then SIGKILL) whether it exited,
    timed out, or the awaiting task was cancelled.

Invariants:
  * When `run_agent_process` returns or raises, no process of the agent's tree is alive: its
    process group and every descendant found at kill time (including ones that left the group
    with `setsid`) got SIGKILL if SIGTERM did not end them within `kill_grace_s`.
  * The process group of the calling process is never signalled.

  * Files the agent could have touched are read back with `read_log_tail` /
    `read_agent_file` only: relative to the sandbox root, following no symlink, bounded.

What this module deliberately does not do: interpret the agent's output (harness modules do),
or remove files (the sandbox owns its directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from harnessrl.sandbox.base import Sandbox
from harnessrl.sandbox.fsread import (
    UnsafePathError,
    read_beneath,
    read_sandbox_text,
    relative_to_root,
    sandbox_root,
)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""PATH for agents: system directories only (not the project's venv)."""
LOG_TAIL_BYTES = 4000
"""How much of the end of an agent's log goes into `HarnessResult.log_tail`."""
AGENT_FILE_BYTES = 8 << 20
"""How much of the end of an agent's output file (log, answer, trajectory) a harness reads."""
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class AgentRun:
    """Outcome of one agent process."""

    exit_code: int | None
    """Exit status (negative: killed by that signal); None when killed at the timeout."""
    timed_out: bool
    duration_s: float
    """Wall seconds from spawn to exit or kill."""
    log_tail: str
    """Last `LOG_TAIL_BYTES` of the agent's stdout+stderr, decoded with replacement."""
    killed_pids: int
    """Processes of the agent's tree still alive after it ended and killed by us."""


def agent_state_dir(sandbox: Sandbox, agent: str) -> Path:
    """Private directory for `agent`'s config and outputs: `<home>/.harnessrl/<agent>` (created)."""
    path = sandbox.home / ".harnessrl" / agent
    path.mkdir(parents=True, exist_ok=True)
    return path


def agent_log_path(sandbox: Sandbox, agent: str) -> Path:
    """Log file for `agent`'s stdout+stderr: `<home>/.harnessrl/<agent>.log`."""
    path = sandbox.home / ".harnessrl" / f"{agent}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def base_env(sandbox: Sandbox, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment built from scratch for an agent: HOME and XDG dirs inside the sandbox home,
    system PATH, UTF-8 locale, no colours; `extra` is applied last. (The sandbox adds its own
    entries such as TMPDIR and its markers.)"""
    home = sandbox.home
    env = {
        "HOME": str(home),
        "PATH": DEFAULT_PATH,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "PYTHONUNBUFFERED": "1",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
    }
    env.update(extra or {})
    return env


async def run_agent_process(
    sandbox: Sandbox,
    argv: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
    kill_grace_s: float = 2.0,
) -> AgentRun:
    """Run `argv` in `sandbox.workdir` for at most `timeout_s` wall seconds, then kill its tree.

    Args:
        argv: the agent command; `argv[0]` an absolute executable path.
        env: the complete environment (see `base_env`).
        log_path: where stdout and stderr go (inside the sandbox home).
        timeout_s: wall-clock limit from spawn.
        kill_grace_s: seconds between SIGTERM and SIGKILL.

    Raises:
        SandboxError: from `sandbox.spawn` when the sandbox cannot start processes. The agent's
            own failures (non-zero exit, crash, hang) never raise.
    """
    start = time.monotonic()
    proc = await sandbox.spawn(argv, env=env, cwd=sandbox.workdir, log_path=log_path)
    pgid = _pgid_of(proc.pid)
    exit_code: int | None = None
    timed_out = False
    killed = 0
    try:
        try:
            exit_code = await asyncio.wait_for(proc.wait(), timeout=timeout_s)
        except TimeoutError:
            timed_out = True
    finally:
        killed = await _kill_tree(proc, pgid, kill_grace_s)
    return AgentRun(
        exit_code=None if timed_out else exit_code,
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
        log_tail=read_log_tail(sandbox, log_path),
        killed_pids=killed,
    )


def read_log_tail(sandbox: Sandbox, log_path: Path, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last `max_bytes` of the agent's log file `log_path` (a host path inside the
    sandbox) as text: "" when it does not exist, a one-line note when it is a symlink or not a
    regular file (never followed: `sandbox/fsread.py`)."""
    root = sandbox_root(sandbox)
    try:
        data = read_beneath(root, relative_to_root(root, log_path), max_bytes, tail=True)
    except FileNotFoundError:
        return ""
    except (UnsafePathError, IsADirectoryError) as e:
        return f"[harnessrl: agent log not read: {e}]"
    return data.decode("utf-8", errors="replace")


def read_agent_file(
    sandbox: Sandbox, path: Path, max_bytes: int = AGENT_FILE_BYTES, *, tail: bool = False
) -> str | None:
    """Text of an agent's output file `path` (a host path inside the sandbox: its log, its
    final-answer or trajectory file), at most its first (or with `tail` last) `max_bytes`;
    None when missing, or when a symlink or special file stands at any component (not
    followed; logged as a warning)."""
    return read_sandbox_text(sandbox, path, max_bytes, tail=tail)


def _pgid_of(pid: int) -> int | None:
    """The process group of `pid`, unless it is our own (then None: never signal ourselves)."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return None
    return None if pgid == os.getpgrp() else pgid


def _tree(pid: int) -> list[psutil.Process]:
    """`pid` and all its live descendants (empty when `pid` is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _group_members(pgid: int | None) -> list[psutil.Process]:
    """Live, non-zombie processes of group `pgid` (found by scanning /proc)."""
    if pgid is None:
        return []
    members: list[psutil.Process] = []
    for p in psutil.process_iter():
        # a process may exit between the scan and these calls
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p)
    return members


def _signal_all(procs: list[psutil.Process], pgid: int | None, sig: signal.Signals) -> None:
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


async def _kill_tree(proc: asyncio.subprocess.Process, pgid: int | None, grace_s: float) -> int:
    """SIGTERM the agent's group and descendants, SIGKILL what is left after `grace_s`, reap.

    Runs to completion even when the awaiting task is cancelled meanwhile (then it skips the
    grace period and goes straight to SIGKILL). Returns how many processes were alive."""
    procs = {p.pid: p for p in [*_tree(proc.pid), *_group_members(pgid)]}
    alive = [p for p in procs.values() if _is_alive(p)]
    if not alive and proc.returncode is not None:
        return 0
    _signal_all(alive, pgid, signal.SIGTERM)
    cancelled = False
    try:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_is_alive(p) for p in alive):
            await asyncio.sleep(_POLL_S)
    except asyncio.CancelledError:
        cancelled = True
    survivors = [p for p in alive if _is_alive(p)] + _group_members(pgid)
    _signal_all(survivors, pgid, signal.SIGKILL)
    if proc.returncode is None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(proc.wait())
    if cancelled:
        raise asyncio.CancelledError
    return len(alive)


def _is_alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

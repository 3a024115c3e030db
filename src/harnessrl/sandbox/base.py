"""The `Sandbox` seam: an isolated working directory and process space for one rollout.

A sandbox owns everything a rollout starts: its directory tree and every process in its
process group. It also owns the agent's route to the proxy (`agent_endpoint`). `close()` is idempotent, kills the whole group (SIGTERM, then SIGKILL),
removes the directory, and completes even when the awaiting task is cancelled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from harnessrl.types import Endpoint


@dataclass(frozen=True, slots=True)
class ExecResult:
    """Outcome of one command run to completion (or killed at its timeout)."""

    returncode: int
    """Exit status; negative for a signal, as in `subprocess`."""
    stdout: str
    """Captured stdout, decoded as UTF-8 (replacement on errors), truncated at the cap."""
    stderr: str
    timed_out: bool
    duration_s: float


@runtime_checkable
class Sandbox(Protocol):
    """One rollout's directory and processes."""

    @property
    def workdir(self) -> Path:
        """The directory the agent works in (the task's workspace copy)."""
        ...

    @property
    def home(self) -> Path:
        """HOME for processes in the sandbox (inside the sandbox tree)."""
        ...

    def agent_endpoint(self, endpoint: Endpoint) -> Endpoint:
        """`endpoint` (the proxy's, as the host sees it) as an agent inside this sandbox must
        address it; the harness hands the agent this one. A sandbox with its own network
        translates the address to its route to the proxy."""
        ...

    async def exec(
        self,
        cmd: str | list[str],
        timeout_s: float,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ExecResult:
        """Run a command (a string runs under `bash -c`) and wait for it.

        Never raises for the command's own failure; raises `SandboxError` only when the
        sandbox cannot start processes at all.
        """
        ...

    async def spawn(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        log_path: Path | None = None,
    ) -> asyncio.subprocess.Process:
        """Start a background process (an agent) in the sandbox's process group."""
        ...

    def read_file(self, rel_path: str) -> bytes:
        """Read a file relative to `workdir`. Raises FileNotFoundError."""
        ...

    def write_file(self, rel_path: str, data: str | bytes) -> None:
        """Write a file relative to `workdir`, creating parents."""
        ...

    async def kill_processes(self) -> int:
        """Kill every process started in the sandbox (and any that escaped into new sessions),
        keeping the directory; returns how many were killed. Called before verification."""
        ...

    async def close(self) -> None:
        """Kill every process of the sandbox and remove its directory; idempotent."""
        ...


class SandboxBackend(Protocol):
    """Creates sandboxes."""

    async def create(self, rollout_id: str, workspace: dict[str, str]) -> Sandbox:
        """Create a sandbox whose `workdir` holds a fresh copy of `workspace`
        (relative path -> file text)."""
        ...

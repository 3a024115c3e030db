"""The `Sandbox` seam: an isolated working directory and process space for one rollout.

What every backend promises (a local directory with bubblewrap today; a container or a remote
machine next):
  * Files: a work dir (the task's workspace copy, what the verifier scores) and a home (the
    agent's private config and logs). Host code reaches them only through `read_file` and
    `write_file`, with paths relative to one of them (`base="work"` or `"home"`): no symlink
    is followed at any component, `..` and absolute paths are refused, reads are bounded.
  * Paths as the agent sees them (its HOME, its work dir, a config file it is told about)
    come from `agent_path`: a container's paths differ from the host's.
  * Agent install trees are found where the sandbox mounts them: `tree_path(sandbox, host
    path)` (bubblewrap and podman mount them under `/run/harnessrl/agents/<name>`, not at their
    host path).
  * The agent's route to the proxy comes from `agent_endpoint` (a sandbox with its own network
    translates the proxy's address into the one it can reach).
  * Processes: `exec` runs a command to completion; `spawn` starts a background agent and
    returns a `SandboxProcess` handle the sandbox owns (`wait(timeout_s)`, `kill_tree()`).
    One kill path: SIGTERM, the sandbox config's `kill_grace_s`, then SIGKILL, for a handle's
    tree (`kill_tree`) and for the whole sandbox (`kill_processes`, `close`).
  * `close()` is idempotent, kills every process of the sandbox, removes its files, and
    completes even when the awaiting task is cancelled.

`workdir` and `home` are host paths of the local backend, used by host-side verifiers that run
programs beside the workspace; harnesses never use them (they speak `agent_path`,
`read_file`, `write_file`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from harnessrl.types import Endpoint

Base = Literal["work", "home"]
"""Which sandbox directory a relative path is relative to."""
BASES: tuple[Base, ...] = ("work", "home")
READ_MAX_BYTES = 64 << 20
"""Default bound of one `read_file`, bytes."""


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
class SandboxProcess(Protocol):
    """A background process started by `Sandbox.spawn`, owned by its sandbox."""

    @property
    def pid(self) -> int:
        """Its process id (as the sandbox's host sees it)."""
        ...

    @property
    def returncode(self) -> int | None:
        """Exit status once it has exited (negative: killed by that signal), else None."""
        ...

    async def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait at most `timeout_s` seconds (None: without limit) for it to exit; returns its
        exit status, or None when it is still running at the timeout."""
        ...

    async def kill_tree(self) -> int:
        """Kill it and every process it started, including ones that left its process group
        (SIGTERM, the sandbox's `kill_grace_s`, SIGKILL), and reap it. Returns how many were
        alive. Completes even when the awaiting task is cancelled (CancelledError is raised
        after). Raises `SandboxError` when some survive SIGKILL."""
        ...


@runtime_checkable
class MountsTrees(Protocol):
    """A sandbox that mounts the backend's read-only trees (agent install trees) somewhere
    other than their host paths."""

    def tree_path(self, host_path: Path) -> str:
        """`host_path`, a file under one of the backend's read-only trees, as the sandbox's
        processes see it (any other path unchanged)."""
        ...


def tree_path(sandbox: object, host_path: Path) -> str:
    """Where `sandbox`'s processes find `host_path` (a file of an agent install tree): its
    `tree_path` when it mounts trees elsewhere (`MountsTrees`), else the host path itself."""
    return sandbox.tree_path(host_path) if isinstance(sandbox, MountsTrees) else str(host_path)


@runtime_checkable
class Sandbox(Protocol):
    """One rollout's directory and processes."""

    @property
    def workdir(self) -> Path:
        """Host path of the directory the agent works in (for host-side verifiers)."""
        ...

    @property
    def home(self) -> Path:
        """Host path of HOME for processes in the sandbox (for host-side verifiers)."""
        ...

    def agent_path(self, base: Base, rel_path: str = "") -> str:
        """Absolute path, as a process inside the sandbox sees it, of `rel_path` under `base`
        (`agent_path("home")` is the agent's HOME). Raises `SandboxError` for a `..`
        component, an absolute `rel_path` or an unknown `base`."""
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
        log_file: str | None = None,
    ) -> SandboxProcess:
        """Start a background process (an agent) in the work dir, stdin closed, stdout and
        stderr appended to `log_file` (relative to home; discarded when None).

        Raises `SandboxError` when the sandbox is closed or cannot start it.
        """
        ...

    def read_file(
        self, rel_path: str, *, base: Base = "work", max_bytes: int = READ_MAX_BYTES, tail: bool = False
    ) -> bytes:
        """At most `max_bytes` of file `rel_path` under `base` (the first bytes, or the last
        with `tail`), following no symlink. Raises FileNotFoundError, or `SandboxError` for a
        symlink, a special file, a `..` component or an absolute path."""
        ...

    def write_file(self, rel_path: str, data: str | bytes, *, base: Base = "work", mode: int = 0o644) -> None:
        """Write `data` (str as UTF-8) to `rel_path` under `base` (created or truncated, file
        mode `mode`), creating parent directories, following no symlink. Raises
        `SandboxError` for a symlink, a non-directory parent, a `..` component or an
        absolute path."""
        ...

    async def kill_processes(self) -> int:
        """Kill every process started in the sandbox (and any that escaped into new sessions),
        keeping the directory; returns how many were killed. Called before verification.
        Raises `SandboxError` when some survive SIGKILL."""
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

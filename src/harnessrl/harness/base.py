"""The `Harness` seam: runs an agent against an endpoint inside a sandbox until it exits.

Two kinds share this seam and produce identical traces (DESIGN.md §2):
  * loop-owning CLI agents (mini-swe-agent, opencode, any command) talk HTTP to the proxy;
  * the white-box Python loop samples the engine directly through the same recorder.
A harness never raises for the agent's own failure: it reports it in `HarnessResult`. It speaks
only the `Sandbox` seam (sandbox-relative files, `agent_path`, the `SandboxProcess` handle),
never host paths or pids, and the endpoint it is given is the sandbox's
(`Sandbox.agent_endpoint`, applied by the rollout runner).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint


@dataclass(frozen=True, slots=True)
class HarnessResult:
    exit_code: int | None
    """Agent process exit status; None when it was killed at the timeout."""
    timed_out: bool
    final_answer: str | None = None
    """The agent's submission / last message, when the harness can tell."""
    error: str | None = None
    """Why the agent failed, when it did (non-zero exit, crash)."""
    log_tail: str = ""
    """Last part of the agent's stdout/stderr, for inspection."""


@dataclass(frozen=True, slots=True)
class HarnessRequirements:
    """What a harness needs from the engine and the run's sampling to work at all.

    A run checks these at config time, before any model loads (`config.RunConfig`), and uses
    them as the defaults of `engine.max_context_tokens` and `sampling.max_tokens` when the
    config leaves those unset (`harness/options.py`).
    """

    protocol: str
    """Wire protocol the agent speaks: `chat.completions`, `responses`, `messages`, `white_box`,
    or `any` (a user's own command)."""
    min_context_tokens: int = 0
    """Smallest `engine.max_context_tokens` (prompt + reply tokens) the agent works with."""
    min_reply_tokens: int = 0
    """Smallest `sampling.max_tokens` cap that does not cut the replies the agent asks for."""
    why: str = ""
    """Where the numbers come from (shown in the error and by `harnessrl harness options`)."""


class Harness(Protocol):
    name: str

    async def run(
        self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float
    ) -> HarnessResult:
        """Run the agent on `task` in `sandbox`, pointed at `endpoint`, for at most
        `timeout_s` wall seconds; kill its whole process tree before returning."""
        ...

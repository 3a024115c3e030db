"""The `Harness` seam: runs an agent against an endpoint inside a sandbox until it exits.

Two kinds share this seam and produce identical traces (DESIGN.md §2):
  * loop-owning CLI agents (mini-swe-agent, opencode, any command) talk HTTP to the proxy;
  * the white-box Python loop samples the engine directly through the same recorder.
A harness never raises for the agent's own failure: it reports it in `HarnessResult`.
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


class Harness(Protocol):
    name: str

    async def run(
        self, task: Task, sandbox: Sandbox, endpoint: Endpoint, timeout_s: float
    ) -> HarnessResult:
        """Run the agent on `task` in `sandbox`, pointed at `endpoint`, for at most
        `timeout_s` wall seconds; kill its whole process tree before returning."""
        ...

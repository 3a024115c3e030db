"""The `Verifier` seam: scores a finished workspace with hidden tests.

A verifier runs only after the agent's processes are dead and its proxy key revoked. It
returns a `Reward`; its own failures (crash, timeout) come back as `Reward.error`, which the
rollout runner records as status `verifier_error`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task


@dataclass(frozen=True, slots=True)
class Reward:
    value: float | None
    """Scalar reward in the task family's range (usually [0, 1]); None when unscorable."""
    parts: dict[str, float] = field(default_factory=dict)
    """Named components (e.g. `tests_passed`, `tests_total`, `format_ok`)."""
    error: str | None = None
    """Set when the verifier itself failed (crash, timeout): the rollout is `verifier_error`."""


class Verifier(Protocol):
    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        """Score the sandbox's workspace (and/or the agent's final answer) for `task`."""
        ...

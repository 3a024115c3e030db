"""The `Task` record and the `TaskSource` protocol.

A task is what one group of rollouts works on: an instruction (or prompt messages), the files
the agent starts with, and hidden tests the agent never sees (they reach the verifier only
after every agent process is dead, DESIGN.md §3.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Task:
    task_id: str
    """Stable id, e.g. `HumanEval/0` or `arith/seed=7/diff=2`."""
    family: str
    """Task family name (`humaneval`, `stdio`, `procedural`, ...); picks the verifier."""
    instruction: str
    """What the agent is asked to do, as plain text."""
    workspace: dict[str, str] = field(default_factory=dict)
    """Files the agent starts with: relative path -> text."""
    hidden_tests: dict[str, Any] = field(default_factory=dict)
    """What the verifier needs (family-specific); never written where the agent can read it."""
    system_prompt: str | None = None
    """Optional system message for harnesses that take one (the white-box loop)."""
    metadata: dict[str, Any] = field(default_factory=dict)


class TaskSource(Protocol):
    """A finite, indexable collection of tasks; the task for a group is `get(group_id)`."""

    def __len__(self) -> int: ...

    def get(self, seed: int) -> Task:
        """The task for seed `seed` (= group_id): deterministic, spread over the source."""
        ...

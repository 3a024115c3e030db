"""Which verifier scores a task: one `match` on the task's family.

Responsibility: the single place mapping `Task.family` to its `Verifier` (DESIGN.md §2: one
implementation per seam picked with one `match`). Verifiers are built with their defaults;
construct one directly for other settings.
"""

from __future__ import annotations

from harnessrl.errors import TaskError
from harnessrl.rewards.base import Verifier
from harnessrl.rewards.exact_match import ExactMatchVerifier
from harnessrl.rewards.stdio_tests import StdioVerifier
from harnessrl.rewards.unit_tests import UnitTestVerifier
from harnessrl.tasks.base import Task


def verifier_for(task: Task) -> Verifier:
    """The verifier of `task.family`. Raises TaskError for a family without one."""
    match task.family:
        case "humaneval":
            return UnitTestVerifier()
        case "stdio":
            return StdioVerifier()
        case "procedural":
            return ExactMatchVerifier()
        case other:
            raise TaskError(
                f"task {task.task_id!r}: no verifier for family {other!r} "
                "(known: humaneval, stdio, procedural)"
            )

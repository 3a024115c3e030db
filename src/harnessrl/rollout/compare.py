"""`harnessrl rollout --compare A B`: which tasks two evaluations disagree on.

Responsibility: read `rollouts.jsonl` of two evaluation directories (`harnessrl rollout --out`,
or a training run's `RUN/eval/step-K`), and per task (`task_id`) compare whether it was solved:
a task is *solved* in a directory when at least one of its scored rollouts passed (reward >=
`pass_threshold`; scored and error as in `rollout/summary.py`). A task is *fixed* when solved in
B and not in A, *regressed* when solved in A and not in B; a task whose rollouts in a directory
are all errors is *unscored* there and counted neither way. Tasks present in one directory only
are listed apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.errors import HarnessRLError
from harnessrl.jsonl import read_jsonl
from harnessrl.rollout.summary import ERROR_STATUSES


@dataclass(frozen=True)
class TaskScore:
    """One task's rollouts in one directory: scored ones, passing ones, errors."""

    scored: int = 0
    passed: int = 0
    errors: int = 0

    @property
    def solved(self) -> bool:
        return self.passed > 0


@dataclass
class Comparison:
    """Per-task scores of A and B and the tasks that changed (module docstring)."""

    a: dict[str, TaskScore]
    b: dict[str, TaskScore]
    fixed: list[str] = field(default_factory=list)
    regressed: list[str] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    unscored: list[str] = field(default_factory=list)
    """Tasks in both with no scored rollout in A or in B."""

    def lines(self) -> list[str]:
        """The comparison as readable lines: counts, then each fixed and regressed task with its
        passes/scored in A and B."""
        both = sorted(set(self.a) & set(self.b))
        solved_a = sum(self.a[t].solved for t in both)
        solved_b = sum(self.b[t].solved for t in both)
        out = [f"{len(both)} tasks in both: solved {solved_a} in A, {solved_b} in B; "
               f"{len(self.fixed)} fixed, {len(self.regressed)} regressed, {len(self.unscored)} unscored"]
        for name, tasks in (("fixed", self.fixed), ("regressed", self.regressed)):
            for t in tasks:
                a, b = self.a[t], self.b[t]
                out.append(f"{name:9} {t}  A {a.passed}/{a.scored}  B {b.passed}/{b.scored}")
        if self.only_a or self.only_b:
            out.append(f"only in A: {len(self.only_a)} tasks; only in B: {len(self.only_b)} tasks")
        return out


def task_scores(rows: list[dict[str, Any]], pass_threshold: float = 1.0) -> dict[str, TaskScore]:
    """Per `task_id`: scored, passed and error counts of the rollout records `rows`."""
    counts: dict[str, list[int]] = {}
    for row in rows:
        c = counts.setdefault(str(row.get("task_id")), [0, 0, 0])
        reward = row.get("reward")
        if row.get("status") in ERROR_STATUSES:
            c[2] += 1
        elif isinstance(reward, (int, float)):
            c[0] += 1
            c[1] += reward >= pass_threshold
    return {t: TaskScore(*c) for t, c in counts.items()}


def read_rollouts(directory: Path) -> list[dict[str, Any]]:
    """The rollout records of `directory/rollouts.jsonl` (unreadable lines skipped).

    Raises:
        HarnessRLError: the directory has no rollouts.jsonl.
    """
    path = directory / "rollouts.jsonl"
    if not path.is_file():
        raise HarnessRLError(f"{directory} is not an evaluation directory: {path} does not exist")
    return read_jsonl(path).rows


def compare_dirs(a: Path, b: Path, pass_threshold: float = 1.0) -> Comparison:
    """Compare the evaluations in directories `a` and `b` (module docstring).

    Raises:
        HarnessRLError: either directory has no rollouts.jsonl.
    """
    sa = task_scores(read_rollouts(a), pass_threshold)
    sb = task_scores(read_rollouts(b), pass_threshold)
    cmp = Comparison(a=sa, b=sb, only_a=sorted(set(sa) - set(sb)), only_b=sorted(set(sb) - set(sa)))
    for task in sorted(set(sa) & set(sb)):
        if not sa[task].scored or not sb[task].scored:
            cmp.unscored.append(task)
        elif sb[task].solved and not sa[task].solved:
            cmp.fixed.append(task)
        elif sa[task].solved and not sb[task].solved:
            cmp.regressed.append(task)
    return cmp

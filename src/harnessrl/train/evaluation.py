"""Held-out evaluation during training (`train.eval_every`).

Responsibility: split a run's task source into training tasks and a disjoint held-out set of
`train.eval_size` tasks, and score the held-out set through the run's own harness, sandbox,
proxy and verifier (the same path as training rollouts; nothing of it trains).

Held-out tasks: for `tasks.kind = "procedural"` the same generator with its seed offset moved
by `EVAL_SEED_OFFSET` (task indexes no training seed reaches: training draws indexes
`seed_offset + [0, 1000)`); for any other source the last `eval_size` tasks, which training
then never draws (its source is cut to the first `len - eval_size`).

Sampling: the run's own (`[sampling]`, enforced by the proxy for every request), not greedy,
with `train.eval_samples` rollouts per task (default: `rollout.group_size`), so `eval/pass@k`
is defined for k up to that number. Metrics (keys of the returned dict and of `metrics.jsonl`):
`eval/pass_rate`, `eval/pass@k` (each k), `eval/pass_at_k` (k = `eval/k`, the largest),
`eval/error_rate` and `eval/errors` (agent, infra or verifier errors, counted apart from wrong
answers, as in `rollout/summary.py`), `eval/reward_mean` (the verifier's), `eval/tasks`,
`eval/s`. Each evaluation's rollouts go to `RUN/eval/step-K/rollouts.jsonl` (K = the number of
updates before it; 0 is before the first), a directory `harnessrl rollout --compare` reads.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from harnessrl.preflight import check_eval_size
from harnessrl.rollout.orchestrator import Orchestrator
from harnessrl.rollout.summary import summarize_groups
from harnessrl.runtime import make_task_source
from harnessrl.tasks.base import Task, TaskSource
from harnessrl.tasks.config import ProceduralTasks
from harnessrl.types import Group

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_000
"""Shift of a procedural source's seed offset for its held-out set."""


class SeedRange:
    """Tasks `start .. start + size - 1` of `inner` as a source of `size` tasks:
    `get(seed) = inner.get(start + seed % size)`."""

    def __init__(self, inner: TaskSource, start: int, size: int) -> None:
        if size < 1:
            raise ValueError(f"SeedRange size must be >= 1, got {size}")
        self._inner, self._start, self._size = inner, start, size

    def __len__(self) -> int:
        return self._size

    def get(self, seed: int) -> Task:
        return self._inner.get(self._start + seed % self._size)


def held_out_split(tasks_cfg: Any, source: TaskSource, eval_size: int) -> tuple[TaskSource, TaskSource]:
    """(training source, held-out source of `eval_size` tasks), disjoint (module docstring).

    Raises:
        ConfigError: a non-procedural source with no more than `eval_size` tasks (nothing
            would be left to train on).
    """
    if isinstance(tasks_cfg, ProceduralTasks):
        shifted = tasks_cfg.model_copy(update={"seed_offset": tasks_cfg.seed_offset + EVAL_SEED_OFFSET,
                                               "limit": None})
        return source, SeedRange(make_task_source(shifted), 0, eval_size)
    check_eval_size(len(source), eval_size)
    n = len(source)
    return SeedRange(source, 0, n - eval_size), SeedRange(source, n - eval_size, eval_size)


def eval_metrics(groups: list[Group], seconds: float) -> dict[str, float]:
    """The `eval/*` metrics of one held-out evaluation's groups (module docstring)."""
    summary = summarize_groups(groups)
    out: dict[str, float] = {"eval/tasks": float(len(groups)), "eval/s": seconds,
                             "eval/error_rate": summary.get("error_rate", 0.0),
                             "eval/errors": summary.get("errors", 0.0)}
    if "pass_rate" in summary:
        out["eval/pass_rate"] = summary["pass_rate"]
    if "reward/verifier_mean" in summary:
        out["eval/reward_mean"] = summary["reward/verifier_mean"]
    if "turns_passing_mean" in summary:
        out["eval/turns_passing_mean"] = summary["turns_passing_mean"]
    ks = sorted(int(key.removeprefix("pass@")) for key in summary if key.startswith("pass@"))
    for k in ks:
        out[f"eval/pass@{k}"] = summary[f"pass@{k}"]
    if ks:
        out["eval/k"] = float(ks[-1])
        out["eval/pass_at_k"] = summary[f"pass@{ks[-1]}"]
    return out


async def evaluate_held_out(rt: Any, source: TaskSource, *, samples: int, max_concurrent: int,
                            limits: Any, out_dir: Path) -> dict[str, float]:
    """Run every task of `source` `samples` times through `rt`'s harness, sandbox, proxy and
    verifier; write the rollouts to `out_dir/rollouts.jsonl`; return `eval_metrics`.

    Raises:
        The error of a group that could not run at all (as `Orchestrator.get_group`).
    """
    t0 = time.monotonic()
    orch = Orchestrator(source, rt.harness, rt.backend, rt.proxy, rt.verifier_for, group_size=samples,
                        max_concurrent_rollouts=max_concurrent, limits=limits)
    groups: list[Group] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    orch.allow(len(source))
    orch.start()
    try:
        with (out_dir / "rollouts.jsonl").open("w", encoding="utf-8") as fh:
            while len(groups) < len(source):
                group = await orch.get_group()
                for r in group.rollouts:
                    fh.write(r.model_dump_json() + "\n")
                groups.append(group)
    finally:
        await orch.close()
    metrics = eval_metrics(groups, time.monotonic() - t0)
    log.info("eval (%d tasks x %d): pass %.3f pass@%d %.3f errors %d (%.0f s) -> %s", len(groups), samples,
             metrics.get("eval/pass_rate", float("nan")), int(metrics.get("eval/k", 0)),
             metrics.get("eval/pass_at_k", float("nan")), int(metrics["eval/errors"]), metrics["eval/s"], out_dir)
    return metrics

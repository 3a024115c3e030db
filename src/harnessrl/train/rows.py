"""The rows of one training step: rewards to advantages, traces to rows, stale rows dropped.

Responsibility: for the groups a step pulled (already shaped by the reward hook as they
completed, `hooks.shape_group`), compute each group's advantages from the training rewards
(`loss/advantages.py`), build each rollout's rows from its trace (`train/samples.build_rows`,
DESIGN.md §5), stamp them with the rollout's advantage, and drop (and count) the rows nothing
can be learned from: an unscored rollout's, a zero-variance group's, and any row whose oldest
trained token was sampled more than `max_staleness` policy versions before `version`
(DESIGN.md §1). A rollout gives at most `max_rows` rows and `max_tokens` tokens
(`cap_rollout_rows`; the excess is dropped and counted: `rows_capped_dropped`,
`tokens_capped_dropped`, `rollouts_capped`). The result also carries the step's reward, merge and staleness metrics, and
every row built before dropping (the step-0 check scores those).

What it does not do: shape rewards (the orchestrator's `on_group` did), decide which groups a
step gets (`train/dynamic_sampling.py`), or train (`train/step.py`).

Invariant: every main-chain sampled token trains in exactly one row or is counted
(`untrained_sampled_tokens`, 0 by construction; `invariant/untraceable_trained_tokens`, a
trained token that is no sampled id of its rollout, must stay 0).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from harnessrl.hooks import Hooks, training_reward
from harnessrl.loss.advantages import AdvantageFn, stamp_advantage
from harnessrl.rollout.summary import summarize_groups
from harnessrl.train.checks import untraceable_trained_tokens
from harnessrl.train.samples import MergeStats, build_rows
from harnessrl.types import Group, Row

SUMMARY_KEYS = ("reward/verifier_mean", "reward/verifier_std", "reward/train_mean", "reward/train_std",
                "pass_rate", "scored", "errors", "error_rate", "turns_mean", "turns_passing_mean",
                "prompt_tokens", "completion_tokens", "agent_s_mean", "total_s_max", "sandbox_s_mean", "verify_s_mean")
"""Keys of `rollout.summary.summarize_groups` a step's metrics carry (plus `status/*`, `pass@*`)."""


@dataclass(frozen=True, slots=True)
class StepRows:
    """What `rows_for_step` returns."""

    rows: list[Row]
    """The rows to train, advantage stamped, in group then rollout order."""
    metrics: dict[str, float]
    """Counts of dropped rows (`rows_unscored_dropped`, `rows_zero_variance_dropped`,
    `rows_stale_dropped`; `rows_capped_dropped` and `tokens_capped_dropped` past a rollout's
    bound, `rollouts_capped`), `groups_zero_variance`, the groups' summary (`SUMMARY_KEYS`),
    the samples builder's accounting over every rollout of the step (`samples/*`,
    `MergeStats.as_metrics`: `samples/rows_per_rollout`, `samples/frac_clean` / `frac_realign`
    / `frac_fork` / `frac_bridged`, `samples/trained_token_share/turn_1` .. `turn_4plus`,
    counts), `rows`, `rows_built`, `staleness_mean` / `staleness_max` (policy versions; NaN
    without rows) and the invariant counters."""
    built: list[Row] = field(default_factory=list)
    """Every row built, before any was dropped (what the step-0 check scores)."""


@dataclass
class _Tally:
    rows: list[Row] = field(default_factory=list)
    built: list[Row] = field(default_factory=list)
    stats: MergeStats = field(default_factory=MergeStats)
    counts: Counter[str] = field(default_factory=Counter)
    staleness: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RolloutBound:
    """What one rollout may give a step (`TrainConfig.max_rows_per_rollout`, `max_tokens_per_rollout`)."""

    max_rows: int = 8
    max_tokens: int = 32768


def cap_rollout_rows(rows: list[Row], bound: RolloutBound) -> tuple[list[Row], list[Row]]:
    """Split one rollout's rows (in order of creation) into those kept, the longest prefix with
    at most `bound.max_rows` rows and `bound.max_tokens` tokens (`len(input_ids)` summed), and
    those dropped (the rest). Unbounded, one rollout's thousands of one-token calls, each a row
    of its shared context, would be thousands of rows of one step (the trainer's memory, and
    the loss's weight moved to that rollout)."""
    tokens = 0
    for i, row in enumerate(rows):
        tokens += len(row.input_ids)
        if i >= bound.max_rows or tokens > bound.max_tokens:
            return rows[:i], rows[i:]
    return rows, []


def rows_for_step(groups: list[Group], *, hooks: Hooks, advantage_fn: AdvantageFn, version: int,
                  max_staleness: int, train_auxiliary: bool = False,
                  bound: RolloutBound = RolloutBound()) -> StepRows:
    """Rows and metrics of one step's `groups` at policy `version` (module docstring).

    Args:
        groups: the step's groups, shaped.
        hooks: the run's hooks (`train_turn_fn`, `agent_turn_fn` reach the samples builder).
        advantage_fn: group rewards -> advantages (`loss/advantages.advantage_fn_for`).
        version: the policy version the step trains (the trainer's current one).
        max_staleness: `train.max_staleness`, in policy versions.
        train_auxiliary: `train.train_auxiliary` (train turns off the main chain too).
        bound: rows and tokens one rollout may give (`cap_rollout_rows`).
    """
    tally = _Tally()
    for group in groups:
        _add_group(tally, group, hooks, advantage_fn, version, max_staleness, train_auxiliary, bound)
    return StepRows(rows=tally.rows, metrics=_metrics(tally, groups), built=tally.built)


def _add_group(tally: _Tally, group: Group, hooks: Hooks, advantage_fn: AdvantageFn, version: int,
               max_staleness: int, train_auxiliary: bool, bound: RolloutBound) -> None:
    adv = advantage_fn([training_reward(r) for r in group.rollouts])
    if adv.zero_variance:
        tally.counts["groups_zero_variance"] += 1
    for rollout, advantage in zip(group.rollouts, adv.advantages_G):
        built, stats = build_rows(rollout, train_turn_fn=hooks.train_turn_fn, agent_turn_fn=hooks.agent_turn_fn,
                                  train_auxiliary=train_auxiliary)
        built, capped = cap_rollout_rows(built, bound)
        if capped:
            tally.counts["rollouts_capped"] += 1
            tally.counts["rows_capped_dropped"] += len(capped)
            tally.counts["tokens_capped_dropped"] += sum(len(r.input_ids) for r in capped)
        tally.stats = tally.stats.merge(stats)
        tally.built.extend(built)
        if advantage is None:
            tally.counts["rows_unscored_dropped"] += len(built)
            continue
        if adv.zero_variance:
            tally.counts["rows_zero_variance_dropped"] += len(built)
            continue
        for row in stamp_advantage(built, advantage):
            oldest = min(v for v, m in zip(row.policy_versions, row.completion_mask) if m)
            if version - oldest > max_staleness:
                tally.counts["rows_stale_dropped"] += 1
                continue
            tally.staleness.append(version - oldest)
            tally.rows.append(row)


def _metrics(tally: _Tally, groups: list[Group]) -> dict[str, float]:
    metrics: dict[str, float] = {k: float(v) for k, v in tally.counts.items()}
    for name in ("rows_stale_dropped", "rows_capped_dropped", "tokens_capped_dropped", "rollouts_capped"):
        metrics.setdefault(name, 0.0)
    summary = summarize_groups(groups)
    metrics.update({k: summary[k] for k in SUMMARY_KEYS if k in summary})
    metrics.update({k: v for k, v in summary.items() if k.startswith(("status/", "pass@"))})
    metrics.update(tally.stats.as_metrics())
    metrics["untrained_sampled_tokens"] = float(tally.stats.untrained_sampled_tokens)
    metrics["rows"] = float(len(tally.rows))
    metrics["rows_built"] = float(len(tally.built))
    staleness = tally.staleness
    metrics["staleness_mean"] = sum(staleness) / len(staleness) if staleness else math.nan
    metrics["staleness_max"] = float(max(staleness)) if staleness else math.nan
    metrics["invariant/untraceable_trained_tokens"] = float(
        untraceable_trained_tokens(tally.rows, [r for g in groups for r in g.rollouts]))
    return metrics

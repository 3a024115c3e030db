"""Summary numbers of a set of rollout groups: pass rate, pass@k, rewards, statuses, tokens, time.

Responsibility: one pure function per number shown in `harnessrl rollout`'s table and in the
trainer's step metrics, so every dashboard figure comes from one tested place.

A rollout *passes* when its reward is >= `pass_threshold` (1.0 by default: every hidden test).
pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1): per task with n samples of which c pass,
`pass@k = 1 - C(n - c, k) / C(n, k)`, averaged over tasks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb

from harnessrl.types import Group, Rollout


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task: n samples, c passing (Chen et al. 2021, eq. 1).

    Raises:
        ValueError: k > n, or c outside [0, n].
    """
    if not 0 <= c <= n:
        raise ValueError(f"c={c} must be within [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be within [1, n={n}]")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize_groups(groups: Sequence[Group], pass_threshold: float = 1.0) -> dict[str, float]:
    """Flat dict of summary numbers over `groups`.

    Keys: tasks, rollouts, pass_rate, pass@k for k in 1..min group size, reward_mean,
    reward_std (population), scored (rollouts with a reward), status/<name> counts,
    turns_mean, prompt_tokens, completion_tokens, agent_s_mean, total_s_mean.
    """
    rollouts = [r for g in groups for r in g.rollouts]
    out: dict[str, float] = {"tasks": float(len(groups)), "rollouts": float(len(rollouts))}
    if not rollouts:
        return out
    rewards = [r.reward for r in rollouts if r.reward is not None]
    out["scored"] = float(len(rewards))
    out["pass_rate"] = sum(1 for r in rollouts if _passed(r, pass_threshold)) / len(rollouts)
    if rewards:
        mean = sum(rewards) / len(rewards)
        out["reward_mean"] = mean
        out["reward_std"] = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
    k_max = min(len(g.rollouts) for g in groups) if groups else 0
    for k in range(1, k_max + 1):
        per_task = [
            pass_at_k(len(g.rollouts), sum(_passed(r, pass_threshold) for r in g.rollouts), k)
            for g in groups
        ]
        out[f"pass@{k}"] = sum(per_task) / len(per_task)
    for status, count in Counter(r.status for r in rollouts).items():
        out[f"status/{status}"] = float(count)
    out["turns_mean"] = sum(len(r.trace.turns) for r in rollouts) / len(rollouts)
    out["prompt_tokens"] = float(sum(len(t.prompt_ids) for r in rollouts for t in r.trace.turns))
    out["completion_tokens"] = float(sum(len(t.completion_ids) for r in rollouts for t in r.trace.turns))
    out["agent_s_mean"] = sum(r.timings_s.get("agent_s", 0.0) for r in rollouts) / len(rollouts)
    out["total_s_mean"] = sum(r.timings_s.get("total_s", 0.0) for r in rollouts) / len(rollouts)
    return out


def _passed(rollout: Rollout, threshold: float) -> bool:
    return rollout.reward is not None and rollout.reward >= threshold

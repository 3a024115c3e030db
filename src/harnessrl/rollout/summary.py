"""Summary numbers of a set of rollout groups: pass rate, error rate, pass@k, rewards, statuses,
tokens, time; and the one-line summary of a rollout.

Responsibility: one pure function per number shown in `harnessrl rollout`'s table and in the
trainer's step metrics, so every dashboard figure comes from one tested place.

Errors are counted apart from scores: a rollout with status `agent_error`, `infra_error` or
`verifier_error` is an *error* (the agent crashed or could not reach the model, the sandbox or
the verifier failed), not a failed attempt; `error_rate` = errors / rollouts. A rollout is
*scored* when its status is `ok` or `timeout` (a timed-out agent's workspace is still verified)
and it has a reward; `pass_rate`, `reward/verifier_mean`, `reward/verifier_std` and pass@k
are over scored rollouts only.

Two rewards: `reward/verifier_*` is the verifier's (`Rollout.reward`, never overwritten; pass
rate and pass@k count it); `reward/train_*` is the reward the advantage uses (the shaping hook's
`Rollout.train_reward`, or the verifier's when no shaping ran), over scored rollouts with one. A scored rollout *passes* when its reward is >= `pass_threshold` (1.0 by default:
every hidden test). pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code", eq. 1): per task with n scored samples of which c pass,
`pass@k = 1 - C(n - c, k) / C(n, k)`, averaged over tasks with at least k scored samples.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb

from harnessrl.hooks import training_reward
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


ERROR_STATUSES = frozenset({"agent_error", "infra_error", "verifier_error"})
"""Statuses counted as errors, apart from scores (module docstring)."""


def is_scored(rollout: Rollout) -> bool:
    """True when the rollout counts in pass rate and reward statistics: status `ok` or `timeout`
    with a reward."""
    return rollout.status not in ERROR_STATUSES and rollout.reward is not None


def summarize_groups(groups: Sequence[Group], pass_threshold: float = 1.0) -> dict[str, float]:
    """Flat dict of summary numbers over `groups` (see the module docstring for the definitions).

    Keys: tasks, rollouts, scored, errors, error_rate, pass_rate (absent when nothing was
    scored), pass@k for k in 1..(smallest number of scored rollouts of a task that has any),
    reward/verifier_mean and reward/verifier_std (population; over scored rollouts),
    reward/train_mean and reward/train_std (the same for the training reward), status/<name> counts,
    turns_mean, turns_passing_mean (the mean turns of the scored rollouts that passed; absent
    when none did: how many model calls a solved task took), prompt_tokens, completion_tokens,
    agent_s_mean, total_s_mean, total_s_max (the slowest rollout's seconds, sandbox to verdict),
    and sandbox_s_mean / verify_s_mean (seconds to create the sandbox, and to verify, over the
    rollouts that reached that phase; absent when none did).
    """
    rollouts = [r for g in groups for r in g.rollouts]
    out: dict[str, float] = {"tasks": float(len(groups)), "rollouts": float(len(rollouts))}
    if not rollouts:
        return out
    scored = [r for r in rollouts if is_scored(r)]
    errors = sum(1 for r in rollouts if r.status in ERROR_STATUSES)
    out["scored"] = float(len(scored))
    out["errors"] = float(errors)
    out["error_rate"] = errors / len(rollouts)
    if scored:
        out["pass_rate"] = sum(1 for r in scored if passed(r, pass_threshold)) / len(scored)
        for name, values in (("verifier", [r.reward for r in scored]),
                             ("train", [training_reward(r) for r in scored])):
            rewards = [x for x in values if x is not None]
            if rewards:
                mean = sum(rewards) / len(rewards)
                out[f"reward/{name}_mean"] = mean
                out[f"reward/{name}_std"] = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
    per_group = [[r for r in g.rollouts if is_scored(r)] for g in groups]
    per_group = [g for g in per_group if g]
    k_max = min(len(g) for g in per_group) if per_group else 0
    for k in range(1, k_max + 1):
        per_task = [pass_at_k(len(g), sum(passed(r, pass_threshold) for r in g), k) for g in per_group]
        out[f"pass@{k}"] = sum(per_task) / len(per_task)
    for status, count in Counter(r.status for r in rollouts).items():
        out[f"status/{status}"] = float(count)
    out["turns_mean"] = sum(len(r.trace.turns) for r in rollouts) / len(rollouts)
    passing = [r for r in scored if passed(r, pass_threshold)]
    if passing:
        out["turns_passing_mean"] = sum(len(r.trace.turns) for r in passing) / len(passing)
    out["prompt_tokens"] = float(sum(len(t.prompt_ids) for r in rollouts for t in r.trace.turns))
    out["completion_tokens"] = float(sum(len(t.completion_ids) for r in rollouts for t in r.trace.turns))
    out["agent_s_mean"] = sum(r.timings_s.get("agent_s", 0.0) for r in rollouts) / len(rollouts)
    out["total_s_mean"] = sum(r.timings_s.get("total_s", 0.0) for r in rollouts) / len(rollouts)
    out["total_s_max"] = max(r.timings_s.get("total_s", 0.0) for r in rollouts)
    for phase in ("sandbox_s", "verify_s"):
        seconds = [r.timings_s[phase] for r in rollouts if phase in r.timings_s]
        if seconds:
            out[f"{phase}_mean"] = sum(seconds) / len(seconds)
    return out


def rollout_line(rollout: Rollout, error_chars: int = 100) -> str:
    """One readable line per rollout: task id, status, reward, turns, tokens (prompt+completion),
    seconds, and the first line of its error cut to `error_chars` (the full record stays in
    `rollouts.jsonl`).

    Example: `procedural/add/i=3/d=1 ok reward 1.00 turns 3 tok 812+96 12.3s`.
    """
    reward = "-" if rollout.reward is None else f"{rollout.reward:.2f}"
    prompt = sum(len(t.prompt_ids) for t in rollout.trace.turns)
    completion = sum(len(t.completion_ids) for t in rollout.trace.turns)
    line = (f"{rollout.task_id} {rollout.status} reward {reward} turns {len(rollout.trace.turns)} "
            f"tok {prompt}+{completion} {rollout.timings_s.get('total_s', 0.0):.1f}s")
    if rollout.error:
        first = rollout.error.strip().splitlines()[0] if rollout.error.strip() else ""
        line += f" error: {first[:error_chars]}{'…' if len(first) > error_chars else ''}"
    return line


def passed(rollout: Rollout, threshold: float = 1.0) -> bool:
    """Whether `rollout` passes: it has a reward >= `threshold` (module docstring)."""
    return rollout.reward is not None and rollout.reward >= threshold

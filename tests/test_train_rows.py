"""Rows of a step: advantages stamped per rollout, stale and zero-variance rows dropped and counted."""

from __future__ import annotations

import pytest

from harnessrl.config import load_config
from harnessrl.train.advantages import grpo_advantages
from harnessrl.train.run import _rows_for_step
from harnessrl.types import Group, Rollout, Trace, Turn


def _rollout(i: int, group_id: int, reward: float | None, version: int) -> Rollout:
    turn = Turn(turn_index=0, request={"messages": []}, prompt_ids=[1, 2, 3], completion_ids=[10 + i, 11],
                completion_logprobs=[-0.5, -0.25], policy_version=version, usage={"completion_tokens": 2})
    return Rollout(rollout_id=f"r{group_id}-{i}", group_id=group_id, task_id="t", harness="h", status="ok",
                   reward=reward, trace=Trace(session_id=f"s{i}", turns=[turn]))


def test_advantages_stamped_and_stale_rows_dropped() -> None:
    cfg = load_config(None, ["train.max_staleness=1", 'hooks.rollout_reward_fn=""'])
    fresh = Group(group_id=0, task_id="t", rollouts=[_rollout(0, 0, 1.0, 2), _rollout(1, 0, 0.0, 2)])
    stale = Group(group_id=1, task_id="t", rollouts=[_rollout(0, 1, 1.0, 0), _rollout(1, 1, 0.0, 0)])
    flat = Group(group_id=2, task_id="t", rollouts=[_rollout(0, 2, 0.0, 2), _rollout(1, 2, 0.0, 2)])
    rows, m, _ = _rows_for_step([fresh, stale, flat], cfg, {}, grpo_advantages, version=2)
    # fresh group: rewards 1, 0 -> mean 0.5, population std 0.5 -> advantages +1, -1 (eps 1e-6)
    assert [r.rollout_id for r in rows] == ["r0-0", "r0-1"]
    assert rows[0].advantage == pytest.approx(1.0, abs=1e-5) and rows[1].advantage == pytest.approx(-1.0, abs=1e-5)
    # stale group: sampled at version 0, trained at version 2 > max_staleness 1
    assert m["rows_stale_dropped"] == 2
    assert m["groups_zero_variance"] == 1 and m["rows_zero_variance_dropped"] == 2
    assert m["staleness_max"] == 0.0
    assert m["invariant/untraceable_trained_tokens"] == 0
    assert m["reward/verifier_mean"] == pytest.approx(2 / 6)
    assert m["reward/train_mean"] == m["reward/verifier_mean"], "no shaping: the same reward"


def test_unscored_rollouts_get_no_rows() -> None:
    cfg = load_config(None, ['hooks.rollout_reward_fn=""'])
    group = Group(group_id=0, task_id="t", rollouts=[_rollout(0, 0, 1.0, 0), _rollout(1, 0, None, 0), _rollout(2, 0, 0.0, 0)])
    rows, m, _ = _rows_for_step([group], cfg, {}, grpo_advantages, version=0)
    assert sorted(r.rollout_id for r in rows) == ["r0-0", "r0-2"]
    assert m["rows_unscored_dropped"] == 1


def test_a_shaped_step_reports_both_rewards_and_passes_on_the_verifiers() -> None:
    cfg = load_config(None, ['hooks.rollout_reward_fn=""'])
    # verifier: 1, 0, 0; the shaping hook gives the failed ones partial credit 0.5 and 0.25
    credit = {"r0-0": 1.0, "r0-1": 0.5, "r0-2": 0.25}
    hooks = {"rollout_reward_fn": lambda outcome: credit[outcome.rollout.rollout_id]}
    group = Group(group_id=0, task_id="t",
                  rollouts=[_rollout(0, 0, 1.0, 0), _rollout(1, 0, 0.0, 0), _rollout(2, 0, 0.0, 0)])
    rows, m, _ = _rows_for_step([group], cfg, hooks, grpo_advantages, version=0)
    assert m["reward/verifier_mean"] == pytest.approx(1 / 3)
    assert m["reward/train_mean"] == pytest.approx(1.75 / 3)
    assert m["pass_rate"] == pytest.approx(1 / 3), "pass rate counts the verifier's reward"
    assert m["pass@1"] == pytest.approx(1 / 3)
    # the advantage uses the training reward: three distinct values, three distinct advantages
    adv = {r.rollout_id: r.advantage for r in rows}
    assert adv["r0-0"] > adv["r0-1"] > adv["r0-2"]
    assert adv["r0-1"] != adv["r0-2"], "with the verifier's reward these two would tie"
    assert group.rollouts[1].reward == 0.0, "the verifier's reward is never overwritten"

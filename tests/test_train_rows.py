"""Rows of a step: advantages stamped per rollout, stale and zero-variance rows dropped and counted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from harnessrl.config import load_config
from harnessrl.loss.advantages import grpo_advantages
from harnessrl.hooks import Hooks, shape_group
from harnessrl.train.dynamic_sampling import DynamicSampling, has_signal, is_fresh
from harnessrl.rollout.orchestrator import ReplacementTickets
from harnessrl.train.rows import RolloutBound, rows_for_step
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
    rows, m, _ = _rows_for_step([fresh, stale, flat], cfg, Hooks(), grpo_advantages, version=2)
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
    rows, m, _ = _rows_for_step([group], cfg, Hooks(), grpo_advantages, version=0)
    assert sorted(r.rollout_id for r in rows) == ["r0-0", "r0-2"]
    assert m["rows_unscored_dropped"] == 1


def test_a_shaped_step_reports_both_rewards_and_passes_on_the_verifiers() -> None:
    cfg = load_config(None, ['hooks.rollout_reward_fn=""'])
    # verifier: 1, 0, 0; the shaping hook gives the failed ones partial credit 0.5 and 0.25
    credit = {"r0-0": 1.0, "r0-1": 0.5, "r0-2": 0.25}
    hooks = Hooks(rollout_reward_fn=lambda outcome: credit[outcome.rollout.rollout_id])
    group = Group(group_id=0, task_id="t",
                  rollouts=[_rollout(0, 0, 1.0, 0), _rollout(1, 0, 0.0, 0), _rollout(2, 0, 0.0, 0)])
    rows, m, _ = _rows_for_step([shape_group(group, hooks.rollout_reward_fn)], cfg, hooks, grpo_advantages,
                                version=0)
    assert m["reward/verifier_mean"] == pytest.approx(1 / 3)
    assert m["reward/train_mean"] == pytest.approx(1.75 / 3)
    assert m["pass_rate"] == pytest.approx(1 / 3), "pass rate counts the verifier's reward"
    assert m["pass@1"] == pytest.approx(1 / 3)
    # the advantage uses the training reward: three distinct values, three distinct advantages
    adv = {r.rollout_id: r.advantage for r in rows}
    assert adv["r0-0"] > adv["r0-1"] > adv["r0-2"]
    assert adv["r0-1"] != adv["r0-2"], "with the verifier's reward these two would tie"
    assert group.rollouts[1].reward == 0.0, "the verifier's reward is never overwritten"


def _rows_for_step(groups: list[Group], cfg: Any, hooks: Hooks, advantage_fn: Any, version: int) -> Any:
    step = rows_for_step(groups, hooks=hooks, advantage_fn=advantage_fn, version=version,
                         max_staleness=cfg.train.max_staleness, train_auxiliary=cfg.train.train_auxiliary,
                         bound=RolloutBound(cfg.train.max_rows_per_rollout, cfg.train.max_tokens_per_rollout))
    return step.rows, step.metrics, step.built


class _Queue(ReplacementTickets):
    """The orchestrator's tickets as dynamic sampling uses them (its replacement bookkeeping is
    the orchestrator's own, `ReplacementTickets`), over a fixed list of groups."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups, self.granted, self.pulled = list(groups), 0, 0
        self.replacing: list[int | None] = []
        self._replaced = set()

    def allow(self, n: int, replacing: int | None = None) -> None:
        self.granted += n
        self.replacing.append(replacing)

    async def get_group(self) -> Group:
        assert self.granted > self.pulled, "a group pulled without a ticket granted for it"
        self.pulled += 1
        return self.groups.pop(0)


def _group(group_id: int, rewards: list[float]) -> Group:
    return Group(group_id=group_id, task_id="t",
                 rollouts=[_rollout(i, group_id, r, 0) for i, r in enumerate(rewards)])


def _sampling(max_extra: int, orch: _Queue) -> DynamicSampling:
    ds = DynamicSampling(max_extra, None, grpo_advantages)
    ds.bind(orch)
    return ds


def test_dynamic_sampling_draws_until_enough_groups_carry_signal() -> None:
    flat, mixed = _group(0, [1.0, 1.0]), _group(1, [1.0, 0.0])
    assert not has_signal(flat, grpo_advantages) and has_signal(mixed, grpo_advantages)
    assert not has_signal(_group(9, [1.0]), grpo_advantages), "one scored rollout: no advantage"
    orch = _Queue([_group(2, [0.0, 0.0]), _group(3, [0.0, 1.0]), _group(4, [1.0, 0.0])])
    groups = [flat, mixed]
    assert asyncio.run(_sampling(5, orch).draw(groups, 2)) == 2
    # group 2 is flat too, group 3 gives the second group with signal: no further draw
    assert orch.granted == 2 and [g.group_id for g in groups] == [0, 1, 2, 3]
    orch = _Queue([_group(5, [0.0, 0.0]), _group(6, [0.0, 0.0]), _group(7, [0.0, 1.0])])
    groups = [_group(0, [1.0, 1.0])]
    assert asyncio.run(_sampling(2, orch).draw(groups, 1)) == 2
    assert [g.group_id for g in groups] == [0, 5, 6], "at most max_extra draws, signal or not"
    orch = _Queue([_group(8, [0.0, 1.0])])
    groups = [_group(0, [1.0, 1.0])]
    ds = _sampling(0, orch)
    assert asyncio.run(ds.draw(groups, 1)) == 0 and ds.on_group(flat) is flat
    assert orch.granted == 0 and len(groups) == 1, "0 turns it off"
    with pytest.raises(ValueError, match="dynamic_sampling_max_groups"):
        DynamicSampling(-1, None, grpo_advantages)


def test_a_flat_group_is_replaced_as_it_completes_within_the_bound() -> None:
    orch = _Queue([_group(3, [0.0, 1.0])])
    ds = _sampling(2, orch)
    for gid in (0, 1, 2):  # three flat groups complete; two early grants, the bound
        ds.on_group(_group(gid, [0.0, 0.0]))
    ds.on_group(_group(4, [1.0, 0.0]))  # a group with signal gets no replacement
    assert orch.granted == 2 and orch.pending_replacements == 2
    assert orch.replacing == [0, 1], "each replacement joins the grant of the group it replaces"
    groups = [_group(0, [0.0, 0.0])]
    assert asyncio.run(ds.draw(groups, 1)) == 1
    assert orch.granted == 2 and orch.pending_replacements == 1, "the draw spent an early grant, granted nothing"
    assert [g.group_id for g in groups] == [0, 3]


def _versioned(group_id: int, rewards: list[float], versions: list[int]) -> Group:
    return Group(group_id=group_id, task_id="t",
                 rollouts=[_rollout(i, group_id, r, v) for i, (r, v) in enumerate(zip(rewards, versions))])


def test_a_group_too_stale_to_train_is_replaced_like_a_flat_one() -> None:
    """At policy version 5 with max_staleness 1, a group sampled at version 3 would have every
    row dropped as stale: the draw replaces it, and stops at the fresh group with signal."""
    stale, fresh = _versioned(0, [1.0, 0.0], [3, 3]), _versioned(1, [1.0, 0.0], [4, 5])
    half = _versioned(2, [1.0, 0.0], [3, 4])  # one rollout fresh: its rows train
    assert not is_fresh(stale, 5, 1) and is_fresh(fresh, 5, 1) and is_fresh(half, 5, 1)
    assert is_fresh(stale, 5, 2) and not is_fresh(_versioned(3, [], []), 5, 1), "no turn: not fresh"
    orch = _Queue([_versioned(4, [0.0, 1.0], [3, 3]), _versioned(5, [0.0, 1.0], [5, 5]), _group(6, [0.0, 1.0])])
    ds = DynamicSampling(3, None, grpo_advantages, max_staleness=1)
    ds.bind(orch)
    groups = [stale, fresh]
    assert asyncio.run(ds.draw(groups, 2, version=5)) == 2
    assert [g.group_id for g in groups] == [0, 1, 4, 5], "group 4 is stale too; group 5 is the second usable"
    cfg = load_config(None, ["train.max_staleness=1", 'hooks.rollout_reward_fn=""'])
    rows, m, _ = _rows_for_step(groups, cfg, Hooks(), grpo_advantages, version=5)
    assert {r.group_id for r in rows} == {1, 5} and m["rows_stale_dropped"] == 4
    # without a version (or without max_staleness) every group counts as fresh: no draw
    groups = [stale, fresh]
    assert asyncio.run(ds.draw(groups, 2)) == 0 and len(groups) == 2
    ds = _sampling(3, _Queue([]))
    assert asyncio.run(ds.draw([stale, fresh], 2, version=5)) == 0


def test_a_group_whose_only_fresh_rollout_has_advantage_0_is_replaced() -> None:
    """Rewards 1, 0.5, 0 give GRPO advantages +1.22, 0, -1.22: at version 5 with max_staleness 1
    only the middle rollout (advantage 0) is fresh, so the group would train one zero-advantage
    row and nothing else; the draw replaces it, and the step trains the replacement."""
    group = _versioned(0, [1.0, 0.5, 0.0], [3, 5, 3])
    assert has_signal(group, grpo_advantages) and is_fresh(group, 5, 1)
    orch = _Queue([_versioned(1, [1.0, 0.5, 0.0], [5, 5, 5])])
    ds = DynamicSampling(2, None, grpo_advantages, max_staleness=1)
    ds.bind(orch)
    assert not ds.usable(group, 5), "its only fresh rollout has advantage 0"
    assert ds.usable(group, 4), "at version 4 the rewarded rollouts are fresh"
    groups = [group]
    assert asyncio.run(ds.draw(groups, 1, version=5)) == 1
    assert [g.group_id for g in groups] == [0, 1]
    cfg = load_config(None, ["train.max_staleness=1", 'hooks.rollout_reward_fn=""'])
    rows, _, _ = _rows_for_step(groups, cfg, Hooks(), grpo_advantages, version=5)
    assert {r.group_id for r in rows if r.advantage != 0.0} == {1}
    # a group with no scored rollout has no signal either
    assert not has_signal(_versioned(2, [], []), grpo_advantages)


class _CompletingQueue(_Queue):
    """A `_Queue` whose groups complete (dynamic sampling's `on_group`) as they are pulled."""

    def __init__(self, groups: list[Group]) -> None:
        super().__init__(groups)
        self.ds: DynamicSampling | None = None

    async def get_group(self) -> Group:
        group = await super().get_group()
        assert self.ds is not None
        return self.ds.on_group(group)


def test_a_replacement_left_over_at_the_bound_is_not_pending() -> None:
    """A step holding more flat groups with replacements in flight than it may draw leaves a
    replacement that stands for no flat group: it is not pending (so the loop's top-up grants
    one ticket fewer) instead of being counted as an early grant for good."""
    orch = _CompletingQueue([_group(2, [0.0, 0.0]), _group(3, [0.0, 1.0])])
    ds = _sampling(2, orch)
    orch.ds = ds
    ds.on_group(_group(0, [0.0, 0.0]))
    ds.on_group(_group(1, [1.0, 1.0]))
    assert orch.pending_replacements == 2 and orch.granted == 2
    groups = [_group(0, [0.0, 0.0]), _group(1, [1.0, 1.0])]
    # both draws are backed by groups 0 and 1's replacements; group 2, flat, completes meanwhile
    # and is replaced too (pending had dropped to 0), then pulled: its replacement is left over
    assert asyncio.run(ds.draw(groups, 2)) == 2
    assert [g.group_id for g in groups] == [0, 1, 2, 3]
    assert orch.replacing == [0, 1, 2] and orch.granted == 3 and orch.pulled == 2
    assert orch.pending_replacements == 0, "every replaced flat group was pulled"
    assert orch.granted - orch.pulled == 1, "one replacement in flight beyond the allowance"


_HOOK = """
import collections
CALLS = {calls!r}
seen = collections.Counter()

def reward(outcome):
    r = outcome.rollout
    with open(CALLS, "a") as fh:
        fh.write(r.rollout_id + "\\n")
    seen[r.group_id] += 1
    # even groups: all 0 (no signal); odd groups: 0 then 1, in call order (a stateful hook)
    return 0.0 if r.group_id % 2 == 0 else float(seen[r.group_id] % 2 == 0)
"""


@pytest.mark.e2e
def test_a_real_run_replaces_flat_groups_and_shapes_each_rollout_once(tmp_path: Path) -> None:
    from harnessrl.train.run import run as train

    calls = tmp_path / "calls.txt"
    hook = tmp_path / "flat_even_groups.py"
    hook.write_text(_HOOK.format(calls=str(calls)))
    cfg = load_config(None, [
        "engine.model=tiny-random", "harness.kind=white_box", "rollout.group_size=2", "sampling.max_tokens=4",
        "train.steps=3", "train.groups_per_step=1", "train.max_staleness=0", "train.learning_rate=1e-4",
        "train.dynamic_sampling_max_groups=2", "log.update_norm_every=2", f'hooks.rollout_reward_fn="{hook}:reward"',
        f'sandbox.root_dir="{tmp_path / "sandboxes"}"'])
    run_dir = tmp_path / "run"
    history = asyncio.run(train(cfg, run_dir))
    steps = [m for m in history if "step" in m and m["step"] > 0]
    assert len(steps) == 3
    for m in steps:
        assert not m.get("skipped"), m.get("skip_reason")
        assert m["rows"] == 2.0, "one group with signal trained each step"
        assert m["groups_drawn_extra"] == m.get("groups_zero_variance", 0.0) <= 2.0
        assert ("param_delta_l2" in m) == (m["policy_version"] % 2 == 1), "update norm at the 1st, 3rd, ... update"
    assert sum(m["groups_drawn_extra"] for m in steps) >= 1.0, "group 0 (flat) was replaced"
    logged = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(logged) == 2 * (3 + sum(m["groups_drawn_extra"] for m in steps)), "replaced groups are logged"
    ids = calls.read_text().split()
    assert sorted(ids) == sorted(r["rollout_id"] for r in logged), "the hook ran once per rollout"
    by_group: dict[int, list[float]] = {}
    for r in logged:
        by_group.setdefault(r["group_id"], []).append(r["train_reward"])
    for gid, rewards in by_group.items():
        assert sorted(rewards) == ([0.0, 0.0] if gid % 2 == 0 else [0.0, 1.0]), "logged = trained reward"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_reward_hook_returning_a_non_finite_value_unscores_that_rollout_only(bad: float) -> None:
    """One rollout's hook value of nan / inf makes it unscored with the value named; the rest of
    the group still trains (before: `reward nan is not finite` raised out of the step)."""
    cfg = load_config(None, ['hooks.rollout_reward_fn=""'])
    credit = {"r0-0": 1.0, "r0-1": bad, "r0-2": 0.0}
    hooks = Hooks(rollout_reward_fn=lambda outcome: credit[outcome.rollout.rollout_id])
    group = shape_group(Group(group_id=0, task_id="t", rollouts=[_rollout(i, 0, 1.0, 0) for i in range(3)]),
                        hooks.rollout_reward_fn)
    hurt = group.rollouts[1]
    assert hurt.train_reward is None and hurt.status == "ok"
    assert hurt.metadata["reward_hook_error"] == hurt.error == (
        f"rollout_reward_fn returned {bad!r}, which is not finite: the rollout is unscored")
    rows, m, _ = _rows_for_step([group], cfg, hooks, grpo_advantages, version=0)
    assert sorted(r.rollout_id for r in rows) == ["r0-0", "r0-2"] and m["rows_unscored_dropped"] == 1
    assert rows[0].advantage == pytest.approx(1.0, abs=1e-5)
    assert has_signal(group, grpo_advantages)


def test_a_record_holding_a_non_finite_reward_is_unscored_not_a_crash() -> None:
    """A rollout record with reward nan (written before the runner refused one) is unscored by
    the step and by dynamic sampling's signal check."""
    cfg = load_config(None, ['hooks.rollout_reward_fn=""'])
    group = Group(group_id=0, task_id="t",
                  rollouts=[_rollout(0, 0, 1.0, 0), _rollout(1, 0, float("nan"), 0), _rollout(2, 0, 0.0, 0)])
    rows, m, _ = _rows_for_step([group], cfg, Hooks(), grpo_advantages, version=0)
    assert sorted(r.rollout_id for r in rows) == ["r0-0", "r0-2"] and m["rows_unscored_dropped"] == 1
    assert has_signal(group, grpo_advantages)


def _flood_rollout(calls: int, group_id: int, reward: float) -> Rollout:
    """A rollout of `calls` one-token calls sharing a 90-id system prompt, each with its own user
    ids: every call is a main-chain turn that starts a row of its own."""
    system = list(range(1000, 1090))
    turns = [Turn(turn_index=k, request={"messages": []}, prompt_ids=system + [5000 + k, 6000 + k],
                  completion_ids=[7], completion_logprobs=[-0.1], policy_version=0, usage={"completion_tokens": 1})
             for k in range(calls)]
    return Rollout(rollout_id=f"flood-{group_id}", group_id=group_id, task_id="t", harness="h", status="ok",
                   reward=reward, trace=Trace(session_id="s-flood", turns=turns))


def test_one_rollout_of_thousands_of_calls_gives_a_bounded_number_of_rows() -> None:
    """Attack: 3,000 one-token calls sharing a system prompt. Unbounded, each was a row: 3,000
    rows, 276k tokens from one rollout, beside its sibling's single row. Now the rollout gives at
    most `train.max_rows_per_rollout` rows, the rest dropped and counted in the step's metrics."""
    cfg = load_config(None, ['hooks.rollout_reward_fn=""'])
    assert cfg.train.max_rows_per_rollout == 8 and cfg.proxy.max_model_calls == 64
    group = Group(group_id=0, task_id="t", rollouts=[_flood_rollout(3000, 0, 1.0), _rollout(1, 0, 0.0, 0)])
    rows, m, _ = _rows_for_step([group], cfg, Hooks(), grpo_advantages, version=0)
    flood = [r for r in rows if r.rollout_id == "flood-0"]
    assert len(flood) == 8 and [r.rollout_id for r in rows].count("r0-1") == 1
    assert m["rows_capped_dropped"] == 2992 and m["rollouts_capped"] == 1
    assert m["tokens_capped_dropped"] == 2992 * 93
    assert m["rows"] == 9


def test_the_rollout_bound_counts_tokens_too() -> None:
    from harnessrl.train.rows import RolloutBound, cap_rollout_rows
    from harnessrl.train.samples import build_rows

    built, _ = build_rows(_flood_rollout(5, 0, 1.0))
    assert [len(r.input_ids) for r in built] == [93] * 5
    kept, dropped = cap_rollout_rows(built, RolloutBound(max_rows=8, max_tokens=200))
    assert (len(kept), len(dropped)) == (2, 3)  # 186 tokens kept; a third row would make 279
    kept, dropped = cap_rollout_rows(built, RolloutBound(max_rows=3, max_tokens=10_000))
    assert (len(kept), len(dropped)) == (3, 2)
    assert cap_rollout_rows(built, RolloutBound(max_rows=5, max_tokens=465)) == (built, [])

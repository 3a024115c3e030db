"""Dynamic sampling: a group without learning signal is replaced by another one.

A group whose training rewards are all equal (or that has fewer than two scored rollouts) gets
advantage 0 on every row, so it adds no gradient. DAPO (Yu et al. 2025, arXiv:2503.14476,
section 3.2, "dynamic sampling") over-samples and keeps drawing groups until the batch is full
of groups with signal. `train.dynamic_sampling_max_groups` = N > 0 turns it on here.

Responsibility:
  * `on_group`, the orchestrator's completion callback: it shapes each completed group once by
    the reward hook (so a stateful hook's value is the one checked, trained and logged). For a
    group without signal, it grants one replacement ticket at once, while fewer than N of these
    early grants are unspent. The replacement then generates while the flat group waits in the
    queue, instead of after the trainer has pulled it. It joins the flat group's grant, so in
    dispatch order (`train.group_order`) it is handed out in that group's place rather than
    after the groups granted since, which would make it staler.
  * `draw`, once per step: while fewer than `need` of the step's groups are usable (signal,
    and a rollout recent enough to train at the step's policy version), it pulls one more
    group, at most N a step. A pull is backed by the early grant of a flat group the
    step holds (its replacement is already in flight), or by a new ticket.
  * The tickets are the orchestrator's (`Orchestrator.replace`, `claim_replacements`,
    `pending_replacements`: flat groups given an early replacement and not yet pulled). When a
    step holds more such flat groups than it may draw (the bound N), their replacements stay
    in flight with no flat group to stand in for: the orchestrator counts them when it tops up
    the groups in flight after a weight sync (`Orchestrator.after_sync`), so the surplus takes the place of
    a new ticket instead of pushing every later group one position back (and a version stale).
  * Signal is per rollout: a group is usable only when a rollout fresh enough to train carries
    a non-zero advantage (`usable`). A group with signal whose only fresh rollout has advantage
    0 (GRPO's mean reward) would train a zero-advantage row and nothing else.
  * A group too stale to train counts as one without signal: its rows would all be dropped by
    `train.max_staleness` (`train/rows.rows_for_step`). A replacement left over at the bound
    is generated early and taken by the next step, which can find it two versions old; counted
    as usable, such a group could leave a step with nothing to train.

Invariants:
  * Every pulled group is backed by a ticket granted before it, so no pull waits on a group
    that was never dispatched.
  * Groups running or queued never exceed the base allowance plus N.
  * A pull backed by an early grant never waits on a group that was never granted: the flat
    group's replacement was granted, and not pulled before this step (it joined the flat
    group's grant after the flat group completed, so it is handed out after it).
  * Groups replaced are still returned in the step's groups: they are logged, counted in the
    reward metrics, and their rows are dropped as zero-variance.
  * With N = 0 it only shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from harnessrl.hooks import shape_group, training_reward
from harnessrl.types import Group


class _Orchestrator(Protocol):
    """What dynamic sampling asks of the orchestrator, which owns every ticket."""

    def allow(self, n_groups: int, replacing: int | None = None) -> None: ...

    def replace(self, group_id: int) -> None: ...

    @property
    def pending_replacements(self) -> int: ...

    def claim_replacements(self, groups: Sequence[Group]) -> int: ...

    async def get_group(self) -> Group: ...


def _fresh(rollout: Any, version: int, max_staleness: int) -> bool:
    turns = rollout.trace.turns
    return bool(turns) and min(t.policy_version for t in turns) >= version - max_staleness


def is_fresh(group: Group, version: int, max_staleness: int) -> bool:
    """Whether some rollout of `group` has every turn sampled at a policy version within
    `max_staleness` of `version`, the version it would train at; its rows are then all kept by
    the staleness check (a row's oldest trained token is no older than its rollout's oldest
    turn). False for a group with no turn."""
    return any(_fresh(rollout, version, max_staleness) for rollout in group.rollouts)


def signal_mask(group: Group, advantage_fn: Any) -> list[bool]:
    """Per rollout of the (shaped) `group`: whether its advantage under `advantage_fn`
    (`loss/advantages.py`) is non-zero, so that its rows carry a gradient. All False for a
    zero-variance group (all rewards equal, or fewer than two scored) and for rollouts without
    a reward (advantage None)."""
    advantages = advantage_fn([training_reward(r) for r in group.rollouts]).advantages_G
    return [a is not None and a != 0.0 for a in advantages]


def has_signal(group: Group, advantage_fn: Any) -> bool:
    """Whether some rollout of the (shaped) `group` has a non-zero advantage (`signal_mask`)."""
    return any(signal_mask(group, advantage_fn))


class DynamicSampling:
    """Shapes groups as they complete and replaces those without signal, at most `max_extra`
    a step (0: off). Call `bind(orchestrator)` before the orchestrator starts."""

    def __init__(self, max_extra: int, reward_fn: Callable[..., Any] | None, advantage_fn: Any,
                 max_staleness: int | None = None) -> None:
        """`max_staleness`: `train.max_staleness`, for `draw` to replace groups too stale to
        train; None counts every group as fresh."""
        if max_extra < 0:
            raise ValueError(f"train.dynamic_sampling_max_groups must be >= 0, got {max_extra}")
        self.max_extra = max_extra
        self._reward_fn = reward_fn
        self._advantage_fn = advantage_fn
        self._max_staleness = max_staleness
        self._orch: _Orchestrator | None = None

    def bind(self, orch: _Orchestrator) -> None:
        self._orch = orch

    def has_signal(self, group: Group) -> bool:
        return has_signal(group, self._advantage_fn)

    def on_group(self, group: Group) -> Group:
        """The completed `group`, shaped; grants a replacement at once for one without signal
        (while fewer than `max_extra` early grants are pending)."""
        shaped = shape_group(group, self._reward_fn)
        assert self._orch is not None, "DynamicSampling.bind was not called"
        if self._orch.pending_replacements < self.max_extra and not self.has_signal(shaped):
            self._orch.replace(group.group_id)  # handed out in its place, not later
        return shaped

    def usable(self, group: Group, version: int | None = None) -> bool:
        """Whether `group` gives the update at policy `version` a gradient: one of its rollouts
        carries a non-zero advantage (`signal_mask`) and (given `version` and
        `max_staleness`) is fresh enough to train (every turn within `max_staleness`, as in
        `is_fresh`). A group whose only fresh rollout has advantage 0 trains a zero-advantage
        row and nothing else: not usable."""
        mask = signal_mask(group, self._advantage_fn)
        if version is None or self._max_staleness is None:
            return any(mask)
        return any(sig and _fresh(r, version, self._max_staleness) for sig, r in zip(mask, group.rollouts))

    async def draw(self, groups: list[Group], need: int, version: int | None = None) -> int:
        """While fewer than `need` of `groups` are usable at policy `version` (`usable`), append
        the next completed group (in place), at most `max_extra` times; returns the number
        drawn."""
        assert self._orch is not None, "DynamicSampling.bind was not called"
        credits = self._orch.claim_replacements(groups)
        extra = 0
        while extra < self.max_extra and sum(self.usable(g, version) for g in groups) < need:
            if credits:
                credits -= 1  # the replacement granted when a flat group of this step completed
            else:
                self._orch.allow(1)
            group = await self._orch.get_group()
            credits += self._orch.claim_replacements([group])
            groups.append(group)
            extra += 1
        return extra

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
  * `draw`, once per step: while fewer than `need` of the step's groups have signal, it pulls
    one more group, at most N a step. Each draw spends one early grant, or grants a ticket.

Invariants:
  * Every pulled group is backed by a ticket granted before it, so no pull waits on a group
    that was never dispatched.
  * Groups running or queued never exceed the base allowance plus N.
  * Groups replaced are still returned in the step's groups: they are logged, counted in the
    reward metrics, and their rows are dropped as zero-variance.
  * With N = 0 it only shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from harnessrl.train.hooks import shape_group, training_reward
from harnessrl.types import Group


class _Orchestrator(Protocol):
    def allow(self, n_groups: int, replacing: int | None = None) -> None: ...

    async def get_group(self) -> Group: ...


def has_signal(group: Group, advantage_fn: Any) -> bool:
    """Whether the training rewards of the (shaped) `group` give some rollout a non-zero
    advantage under `advantage_fn` (`train/advantages.py`). False for a zero-variance group:
    all rewards equal, or fewer than two scored."""
    return not advantage_fn([training_reward(r) for r in group.rollouts]).zero_variance


class DynamicSampling:
    """Shapes groups as they complete and replaces those without signal, at most `max_extra`
    a step (0: off). Call `bind(orchestrator)` before the orchestrator starts."""

    def __init__(self, max_extra: int, reward_fn: Callable[..., Any] | None, advantage_fn: Any) -> None:
        if max_extra < 0:
            raise ValueError(f"train.dynamic_sampling_max_groups must be >= 0, got {max_extra}")
        self.max_extra = max_extra
        self._reward_fn = reward_fn
        self._advantage_fn = advantage_fn
        self._orch: _Orchestrator | None = None
        self.early_grants = 0
        """Replacement tickets granted at a flat group's completion and not yet spent by `draw`."""

    def bind(self, orch: _Orchestrator) -> None:
        self._orch = orch

    def has_signal(self, group: Group) -> bool:
        return has_signal(group, self._advantage_fn)

    def on_group(self, group: Group) -> Group:
        """The completed `group`, shaped; grants a replacement at once for one without signal
        (while fewer than `max_extra` early grants are unspent)."""
        shaped = shape_group(group, self._reward_fn)
        if self.early_grants < self.max_extra and not self.has_signal(shaped):
            assert self._orch is not None, "DynamicSampling.bind was not called"
            self._orch.allow(1, replacing=group.group_id)  # handed out in its place, not later
            self.early_grants += 1
        return shaped

    async def draw(self, groups: list[Group], need: int) -> int:
        """While fewer than `need` of `groups` have signal, append the next completed group (in
        place), at most `max_extra` times; returns the number drawn."""
        assert self._orch is not None, "DynamicSampling.bind was not called"
        extra = 0
        while extra < self.max_extra and sum(map(self.has_signal, groups)) < need:
            if self.early_grants:
                self.early_grants -= 1  # its ticket was granted when a flat group completed
            else:
                self._orch.allow(1)
            groups.append(await self._orch.get_group())
            extra += 1
        return extra

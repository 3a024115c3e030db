"""Orchestrator: a run that cannot work (agent not installed) stops with the error instead of
recording failures forever; groups share a task chosen by the seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harnessrl.errors import HarnessInstallError
from harnessrl.harness.base import HarnessResult
from harnessrl.rewards.base import Reward
from harnessrl.rollout.orchestrator import Orchestrator
from harnessrl.rollout.runner import RolloutLimits
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig, leftover_sandboxes
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint, Group, Trace


class Tasks:
    def __len__(self) -> int:
        return 3

    def get(self, seed: int) -> Task:
        return Task(task_id=f"t{seed % 3}", family="x", instruction="hi")


class Sessions:
    def open_session(self, rollout_id: str, group: str | None = None) -> tuple[str, str]:
        return rollout_id, "key"

    def endpoint(self, key: str) -> Endpoint:
        return Endpoint(base_url="http://127.0.0.1:9/v1", api_key=key, model="m")

    def close_session(self, session_id: str) -> Trace:
        return Trace(session_id=session_id)


class Verifier:
    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        return Reward(value=1.0 if final_answer == task.task_id else 0.0)


class EchoHarness:
    name = "echo"

    async def run(self, task: Task, sandbox: object, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        return HarnessResult(exit_code=0, timed_out=False, final_answer=task.task_id)


class MissingAgent:
    name = "missing"

    async def run(self, task: Task, sandbox: object, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        raise HarnessInstallError("agent 'missing' is not installed; run: harnessrl harness install missing")


def _orch(harness: object, root: Path) -> Orchestrator:
    return Orchestrator(Tasks(), harness, LocalSandboxBackend(SandboxConfig(root_dir=root)), Sessions(),
                        lambda task: Verifier(), group_size=3, max_concurrent_rollouts=4,
                        limits=RolloutLimits(10, 10), first_group_id=4)


async def test_groups_share_the_seeded_task(tmp_path: Path) -> None:
    orch = _orch(EchoHarness(), tmp_path)
    orch.allow(2)
    orch.start()
    try:
        groups = sorted([await orch.get_group(), await orch.get_group()], key=lambda g: g.group_id)
    finally:
        await orch.close()
    assert [g.group_id for g in groups] == [4, 5]
    assert [g.task_id for g in groups] == ["t1", "t2"]
    assert all(r.task_id == g.task_id and r.group_id == g.group_id and r.reward == 1.0
               for g in groups for r in g.rollouts)
    assert orch.next_group_id == 6
    assert leftover_sandboxes(tmp_path) == []


async def test_missing_agent_stops_the_run(tmp_path: Path) -> None:
    orch = _orch(MissingAgent(), tmp_path)
    orch.allow(1)
    orch.start()
    try:
        with pytest.raises(HarnessInstallError, match="harnessrl harness install missing"):
            await orch.get_group()
    finally:
        await orch.close()
    assert leftover_sandboxes(tmp_path) == []


class SlowOnOddGroups:
    """Answers at once for even groups; odd groups' rollouts hang until cancelled."""

    name = "slow"

    async def run(self, task: Task, sandbox: object, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        import asyncio

        if int(task.task_id.removeprefix("t")) % 2:
            await asyncio.sleep(1000)
        return HarnessResult(exit_code=0, timed_out=False, final_answer=task.task_id)


async def test_replayed_groups_go_first_and_undelivered_ones_are_reported(tmp_path: Path) -> None:
    import asyncio

    seen: list[str] = []
    orch = Orchestrator(Tasks(), SlowOnOddGroups(), LocalSandboxBackend(SandboxConfig(root_dir=tmp_path)),
                        Sessions(), lambda task: Verifier(), group_size=2, max_concurrent_rollouts=8,
                        limits=RolloutLimits(10, 10), first_group_id=7, replay_group_ids=[3],
                        on_rollout=lambda r: seen.append(r.rollout_id))
    assert orch.undelivered_group_ids() == [3]
    orch.allow(3)  # replay 3 (task t0, answers), then new groups 7 (t1, hangs) and 8 (t2, answers)
    orch.start()
    try:
        done = sorted([(await orch.get_group()).group_id for _ in range(2)])
        await asyncio.sleep(0.2)
        assert done == [3, 8]
        assert orch.undelivered_group_ids() == [7], "the hanging group is still owed to the consumer"
        assert orch.next_group_id == 9
        assert orch.rollouts_running == 2 and orch.rollouts_finished == 4 and len(seen) == 4
    finally:
        await orch.close()
    assert orch.rollouts_running == 0, "cancelled rollouts no longer count as running"
    assert orch.rollouts_finished == 4 and len(seen) == 4, "a rollout cut by close() produces no Rollout"
    assert leftover_sandboxes(tmp_path) == []


class SleepyHarness:
    name = "sleepy"

    async def run(self, task: Task, sandbox: object, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        import asyncio

        await asyncio.sleep(0.6)
        return HarnessResult(exit_code=0, timed_out=False, final_answer=task.task_id)


async def test_idle_seconds_count_only_time_without_a_running_rollout(tmp_path: Path) -> None:
    import asyncio

    orch = _orch(SleepyHarness(), tmp_path)
    await asyncio.sleep(0.3)
    before = orch.idle_seconds
    assert 0.25 <= before < 0.6
    orch.allow(1)
    orch.start()
    try:
        await asyncio.sleep(0.3)  # the group's rollouts are running: idle time stands still
        assert orch.rollouts_running == 3
        assert orch.idle_seconds - before < 0.2
        await orch.get_group()
        after_run = orch.idle_seconds
        await asyncio.sleep(0.3)  # nothing dispatched: idle again
        assert orch.idle_seconds - after_run >= 0.25
    finally:
        await orch.close()


async def test_on_group_maps_each_completed_group_and_its_error_stops_the_run(tmp_path: Path) -> None:
    seen: list[int] = []

    def on_group(group: Group) -> Group:
        seen.append(group.group_id)
        if group.group_id == 5:
            raise RuntimeError("reward hook failed on group 5")
        return group.model_copy(update={"task_id": "mapped-" + group.task_id})

    orch = Orchestrator(Tasks(), EchoHarness(), LocalSandboxBackend(SandboxConfig(root_dir=tmp_path)), Sessions(),
                        lambda task: Verifier(), group_size=2, max_concurrent_rollouts=2,
                        limits=RolloutLimits(10, 10), first_group_id=4, on_group=on_group)
    orch.allow(1)
    orch.start()
    try:
        first = await orch.get_group()
        assert first.group_id == 4 and first.task_id == "mapped-t1", "get_group returns on_group's value"
        orch.allow(1)
        with pytest.raises(RuntimeError, match="group 5"):
            await orch.get_group()
    finally:
        await orch.close()
    assert seen == [4, 5]
    assert leftover_sandboxes(tmp_path) == []


class SlowOnTaskZero:
    """Task t0's rollouts take 0.8 s, the others 0.05 s."""

    name = "slow-t0"

    async def run(self, task: Task, sandbox: object, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        import asyncio

        await asyncio.sleep(0.8 if task.task_id == "t0" else 0.05)
        return HarnessResult(exit_code=0, timed_out=False, final_answer=task.task_id)


def _slow_t0(tmp_path: Path, **kwargs: Any) -> Orchestrator:
    """Groups from 3 on (group 3 is task t0, slow) under `SlowOnTaskZero`."""
    return Orchestrator(Tasks(), SlowOnTaskZero(), LocalSandboxBackend(SandboxConfig(root_dir=tmp_path)),
                        Sessions(), lambda task: Verifier(), group_size=2, max_concurrent_rollouts=8,
                        limits=RolloutLimits(10, 10), first_group_id=3, **kwargs)


async def _hand_out(orch: Orchestrator, grants: list[int], n: int) -> list[int]:
    """Grant tickets by one `allow` call per entry of `grants`; the ids of the first `n`
    groups `get_group` hands out."""
    for k in grants:
        orch.allow(k)
    orch.start()
    try:
        return [(await orch.get_group()).group_id for _ in range(n)]
    finally:
        await orch.close()


@pytest.mark.parametrize("order", ["dispatch", "completion"])
async def test_dispatch_order_never_hands_out_a_later_grant_first(tmp_path: Path, order: str) -> None:
    """Groups 3 (t0, slow) and 4 of one grant, then 5 of a later grant: "dispatch" hands out 4,
    waits for 3, then 5; "completion" hands out 4 and 5 before the slow 3 (which the trainer
    would then train a step later than its dispatch allows)."""
    orch = _slow_t0(tmp_path, order=order)
    got = await _hand_out(orch, [2, 1], 3)
    if order == "dispatch":
        assert got == [4, 3, 5]
    else:
        assert sorted(got[:2]) == [4, 5] and got[2] == 3
    assert orch.undelivered_group_ids() == []
    assert leftover_sandboxes(tmp_path) == []


async def test_groups_outstanding_counts_granted_groups_not_yet_handed_out(tmp_path: Path) -> None:
    """What the training loop tops its allowance up against: tickets queued, groups running
    and completed groups waiting all count until `get_group` hands them out."""
    orch = _slow_t0(tmp_path, order="dispatch")
    orch.allow(2)
    orch.allow(1)
    assert orch.groups_outstanding == 3, "queued tickets count"
    orch.start()
    try:
        assert (await orch.get_group()).group_id == 4
        assert orch.groups_outstanding == 2
        await orch.get_group()
        assert orch.groups_outstanding == 1
    finally:
        await orch.close()


async def test_dispatch_order_still_raises_a_failed_group_at_once(tmp_path: Path) -> None:
    orch = Orchestrator(Tasks(), MissingAgent(), LocalSandboxBackend(SandboxConfig(root_dir=tmp_path)),
                        Sessions(), lambda task: Verifier(), group_size=2, max_concurrent_rollouts=4,
                        limits=RolloutLimits(10, 10), order="dispatch")
    orch.allow(1)
    orch.start()
    try:
        with pytest.raises(HarnessInstallError):
            await orch.get_group()
    finally:
        await orch.close()
    with pytest.raises(ValueError, match="order must be"):
        Orchestrator(Tasks(), EchoHarness(), LocalSandboxBackend(SandboxConfig(root_dir=tmp_path)), Sessions(),
                     lambda task: Verifier(), group_size=2, max_concurrent_rollouts=4,
                     limits=RolloutLimits(10, 10), order="random")  # type: ignore[arg-type]


async def test_a_replacement_is_handed_out_in_the_place_of_the_group_it_replaces(tmp_path: Path) -> None:
    """Grant 1: group 3 (t0, slow); grant 2: group 4. Group 3's completion asks for a
    replacement (`allow(1, replacing=3)`, as dynamic sampling does): the replacement, group 5,
    joins grant 1 and comes before group 4 of the later grant."""
    holder: list[Orchestrator] = []

    def on_group(group: Group) -> Group:
        if group.group_id == 3:
            holder[0].allow(1, replacing=3)
        return group

    holder.append(_slow_t0(tmp_path, order="dispatch", on_group=on_group))
    assert await _hand_out(holder[0], [1, 1], 3) == [3, 5, 4]
    assert leftover_sandboxes(tmp_path) == []


async def test_a_dispatcher_failure_while_waiting_is_raised_not_hung_on(tmp_path: Path) -> None:
    import asyncio

    class Broken:
        def append(self, grant: int) -> None:
            pass

        def popleft(self) -> int:
            raise RuntimeError("dispatcher broke")

    orch = _slow_t0(tmp_path, order="dispatch")
    orch._ticket_grant = Broken()  # type: ignore[assignment]
    orch.start()
    waiting = asyncio.ensure_future(orch.get_group(poll_s=0.05))
    await asyncio.sleep(0.1)  # get_group is waiting when the dispatcher fails
    orch.allow(1)
    try:
        with pytest.raises(RuntimeError, match="dispatcher broke"):
            await asyncio.wait_for(waiting, timeout=5)
    finally:
        await orch.close()


class StaggeredHarness:
    """Rollout i of a group runs its agent 0.2 * (i % 3) s, recording each agent's interval."""

    name = "staggered"

    def __init__(self) -> None:
        self.started = 0
        self.intervals: list[tuple[float, float]] = []

    async def run(self, task: Task, sandbox: object, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        import asyncio
        import time

        i, self.started = self.started, self.started + 1
        t0 = time.monotonic()
        await asyncio.sleep(0.2 * (i % 3))
        self.intervals.append((t0, time.monotonic()))
        return HarnessResult(exit_code=0, timed_out=False, final_answer=task.task_id)


class ClockVerifier:
    """Takes 0.1 s, recording each verification's interval."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []

    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        import asyncio
        import time

        t0 = time.monotonic()
        await asyncio.sleep(0.1)
        self.intervals.append((t0, time.monotonic()))
        return Reward(value=1.0)


@pytest.mark.parametrize("slots", [1, 2, 4])
async def test_no_verification_of_a_group_overlaps_a_live_agent_of_it(tmp_path: Path, slots: int) -> None:
    """A hidden test moves host-wide figures (`/proc/sys/fs/file-nr`) a sibling in its agent
    phase could read: no verification of a group runs while an agent of the group is live, with
    fewer concurrency slots than rollouts too (and no wait is circular: the group completes)."""
    import asyncio

    harness, verifier = StaggeredHarness(), ClockVerifier()
    orch = Orchestrator(Tasks(), harness, LocalSandboxBackend(SandboxConfig(root_dir=tmp_path)), Sessions(),
                        lambda task: verifier, group_size=3, max_concurrent_rollouts=slots,
                        limits=RolloutLimits(10, 10))
    orch.allow(1)
    orch.start()
    try:
        group = await asyncio.wait_for(orch.get_group(), 30)
    finally:
        await orch.close()
    assert [r.reward for r in group.rollouts] == [1.0, 1.0, 1.0]
    assert len(harness.intervals) == 3 and len(verifier.intervals) == 3
    overlaps = [(a, v) for a in harness.intervals for v in verifier.intervals if v[0] < a[1] and a[0] < v[1]]
    assert overlaps == [], overlaps
    if slots >= 3:  # all three agents live at once: every verification waited for the last
        assert min(v[0] for v in verifier.intervals) >= max(a[1] for a in harness.intervals)
    assert leftover_sandboxes(tmp_path) == []

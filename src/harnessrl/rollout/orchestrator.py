"""Keeps groups of rollouts in flight and hands completed groups to the consumer.

Responsibility: dispatch groups (G rollouts of the task chosen by the seed `group_id`) under a
concurrency limit on rollouts and a budget of groups the consumer has allowed, and deliver each
group when all of its rollouts have finished.

Staleness (DESIGN.md §1, §6): the consumer (the trainer) grants `allow(n)` group tickets. It grants
`(max_staleness + 1) * groups_per_step` at start and `groups_per_step` after each optimizer step,
so a group dispatched while the policy is at version v is consumed, in dispatch order, no later
than step v + max_staleness, provided groups are consumed in dispatch order. With
`max_staleness = 0` this is the synchronous loop: rollouts for step k start only after the
weights of step k-1 are on the engine.

Delivery order (`order`): "dispatch" (the trainer's default, `train.group_order`) never hands
out a group ahead of one whose ticket was granted by an earlier `allow` call; the groups of one
`allow` come in completion order. So no group is overtaken by a later one and made staler than
the bound above (with "completion" order, 10-15% of the rollouts of `bench/async.py` were
overtaken and dropped as stale). "completion" hands out whatever finished first; a group it
lets be overtaken can exceed the bound, and the trainer, which measures staleness per turn,
drops its rows.

Verification order: no rollout of a group is verified while an agent of the group is live,
and no agent of it starts while one is verified (`GroupGate`, the runner's `VerifyGate`): a
hidden test moves host-wide figures (`/proc/sys/fs/file-nr`, `/proc/loadavg`) that a sibling
in its agent phase on the same task could read.

Invariants: groups are dispatched for the ids in `replay_group_ids` first, then consecutively
from `first_group_id` (the data position for resume); `undelivered_group_ids()` is what a resumed
run must replay (dispatched or queued but not yet handed to the consumer); all G rollouts of a
group share `group_id` and its task; `close()` cancels everything in flight and returns only
after every rollout released its resources (a rollout cut by it produces no `Rollout`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from harnessrl.harness.base import Harness
from harnessrl.rewards.base import Verifier
from harnessrl.rollout.runner import RolloutLimits, SessionHost, run_rollout
from harnessrl.sandbox.base import SandboxBackend
from harnessrl.tasks.base import Task, TaskSource
from harnessrl.types import Group, Rollout

log = logging.getLogger(__name__)


class GroupGate:
    """The `VerifyGate` of one group (rollout/runner.py): no rollout of the group verifies while
    an agent of the group is live, and no agent starts while one verifies. A verification waits
    for the live agents to end; an agent start waits for running verifications to end. Neither
    waits for a sibling that has not started (its sandbox may wait for capacity a waiting
    rollout holds, a Ray node's slot), so no wait is circular: each waits only on work that is
    running and bounded by its timeout."""

    def __init__(self) -> None:
        self.agents = 0
        """Agents of the group live now."""
        self.verifying = 0
        """Rollouts of the group verifying now."""
        self._changed = asyncio.Event()

    def ticket(self) -> _GateTicket:
        """One rollout's place in the gate."""
        return _GateTicket(self)

    def changed(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    async def wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()


class _GateTicket:
    """One rollout's `VerifyGate`: idle -> agent -> ended -> verifying, any state -> left."""

    def __init__(self, gate: GroupGate) -> None:
        self._gate = gate
        self._state = "idle"

    async def agent_starts(self) -> None:
        gate = self._gate
        await gate.wait_until(lambda: gate.verifying == 0)
        gate.agents += 1
        self._state = "agent"

    async def agents_ended(self) -> None:
        gate = self._gate
        self._end_agent()
        await gate.wait_until(lambda: gate.agents == 0)
        gate.verifying += 1
        self._state = "verifying"

    def _end_agent(self) -> None:
        if self._state == "agent":
            self._gate.agents -= 1
            self._gate.changed()
        self._state = "ended"

    def leave(self) -> None:
        if self._state == "verifying":
            self._gate.verifying -= 1
            self._gate.changed()
        self._end_agent()
        self._state = "left"


class ReplacementTickets:
    """The replacement tickets of dynamic sampling, kept by whoever grants tickets (`allow`)."""

    _replaced: set[int]
    """Groups given a replacement ticket by `replace`, not yet claimed."""

    def allow(self, n_groups: int, replacing: int | None = None) -> None:
        raise NotImplementedError

    def replace(self, group_id: int) -> None:
        """Grant one ticket for a group replacing completed group `group_id` (dynamic sampling),
        in that group's grant, and remember it until `claim_replacements` takes it."""
        self.allow(1, replacing=group_id)
        self._replaced.add(group_id)

    @property
    def pending_replacements(self) -> int:
        """Groups given a replacement by `replace` whose replacement no one has claimed yet:
        tickets in flight beyond the allowance, legitimately."""
        return len(self._replaced)

    def claim_replacements(self, groups: Sequence[Group]) -> int:
        """How many of `groups` (pulled now) had a replacement granted; those are claimed."""
        ids = {g.group_id for g in groups} & self._replaced
        self._replaced -= ids
        return len(ids)


class Orchestrator(ReplacementTickets):
    """Runs groups of rollouts concurrently; `get_group()` returns them as they complete."""

    def __init__(
        self,
        tasks: TaskSource,
        harness: Harness,
        backend: SandboxBackend,
        sessions: SessionHost,
        verifier_for: Callable[[Task], Verifier],
        *,
        group_size: int,
        max_concurrent_rollouts: int,
        limits: RolloutLimits,
        first_group_id: int = 0,
        replay_group_ids: Sequence[int] = (),
        on_rollout: Callable[[Rollout], None] | None = None,
        group_sizes: Mapping[int, int] | None = None,
        on_group: Callable[[Group], Group] | None = None,
        order: Literal["completion", "dispatch"] = "completion",
        allowance: int = 0,
    ) -> None:
        """`on_rollout` is called with each rollout as it finishes (progress displays);
        `group_sizes` gives some groups another number of rollouts than `group_size` (a resumed
        evaluation runs only the rollouts a group still lacks); `on_group` maps each completed
        group to the one `get_group` returns, as soon as it completes (the trainer shapes its
        rewards there, and may `allow` a replacement for a group without signal); `order` is the
        delivery order of `get_group` (module docstring). `allowance`: the groups kept granted
        ahead of the consumer (training: `(train.max_staleness + 1) * train.groups_per_step`),
        granted by `start` and topped up by `after_sync`; 0 leaves every grant to `allow`.

        Raises:
            ValueError: `group_size` or `max_concurrent_rollouts` < 1, or another `order`.
        """
        if order not in ("completion", "dispatch"):
            raise ValueError(f"order must be 'completion' or 'dispatch', got {order!r}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {max_concurrent_rollouts}")
        self._tasks_source = tasks
        self._harness = harness
        self._backend = backend
        self._sessions = sessions
        self._verifier_for = verifier_for
        self._group_size = group_size
        self._group_sizes = dict(group_sizes or {})
        self._limits = limits
        self._rollout_slots = asyncio.Semaphore(max_concurrent_rollouts)
        self._tickets = asyncio.Semaphore(0)
        self._order = order
        self._ready: list[Group] = []  # completed, not yet handed out (in completion order)
        self._failures: list[BaseException] = []
        self._arrived = asyncio.Event()
        self._grants = 0  # `allow` calls so far
        self._ticket_grant: deque[int] = deque()  # the grant of each ticket not yet dispatched
        self._open: Counter[int] = Counter()  # per grant: its groups not yet handed out
        self._grant_of: dict[int, int] = {}  # undelivered group id -> the grant of its ticket
        self._in_flight: set[asyncio.Task[None]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self.next_group_id = first_group_id
        """Group id (= task seed) of the next new group to dispatch: the data position."""
        self._replay = list(replay_group_ids)
        self._undelivered: set[int] = set(self._replay)
        self.rollouts_started = 0
        self.rollouts_finished = 0
        self._running = 0
        self._idle_since: float | None = time.monotonic()
        self._idle_s = 0.0
        self._on_rollout = on_rollout
        self._on_group = on_group
        self.allowance = allowance
        self._replaced: set[int] = set()

    def allow(self, n_groups: int, replacing: int | None = None) -> None:
        """Let `n_groups` more groups be dispatched (one grant: with "dispatch" order, they are
        handed out after every group of earlier grants). `replacing`: the id of a group these
        replace (dynamic sampling); they join that group's grant instead, so they are handed
        out in its place, not after the groups granted since."""
        if n_groups <= 0:
            return
        if replacing is not None and replacing in self._grant_of:
            grant = self._grant_of[replacing]
        else:
            self._grants += 1
            grant = self._grants
        self._open[grant] += n_groups
        for _ in range(n_groups):
            self._ticket_grant.append(grant)
            self._tickets.release()

    def after_sync(self, more: bool = True) -> None:
        """A weight sync made the engine serve a new policy version: top the groups granted and
        not yet handed out up to the allowance plus the unclaimed replacements (DESIGN.md §6),
        so a replacement left over takes a new ticket's place. `more = False` (the last step):
        grant nothing, the groups would only be cancelled."""
        if more:
            self.allow(self.allowance + self.pending_replacements - self.groups_outstanding)

    def start(self) -> None:
        """Start dispatching; the first `allowance` tickets are granted now."""
        if self._dispatcher is None:
            self.allow(self.allowance)
            self._dispatcher = asyncio.create_task(self._dispatch(), name="orchestrator-dispatch")

    async def get_group(self, on_wait: Callable[[], None] | None = None, poll_s: float = 0.5) -> Group:
        """Wait for the next completed group: the first completed, or with "dispatch" order the
        first completed of the oldest grant that still has groups to hand out.

        Args:
            on_wait: called every `poll_s` seconds while waiting (progress displays).

        Raises:
            The error of a group that could not run at all (e.g. `HarnessInstallError`).
        """
        while True:
            if self._dispatcher is not None and self._dispatcher.done():
                self._dispatcher.result()  # re-raise a dispatcher failure instead of hanging
            if self._failures:
                raise self._failures.pop(0)
            index = self._next_ready()
            if index is not None:
                group = self._ready.pop(index)
                grant = self._grant_of.pop(group.group_id)
                self._open[grant] -= 1
                if not self._open[grant]:
                    del self._open[grant]
                self._undelivered.discard(group.group_id)
                return group
            self._arrived.clear()
            if on_wait is not None:
                on_wait()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=poll_s)
            except TimeoutError:
                pass

    def _next_ready(self) -> int | None:
        """Index in `_ready` of the group `get_group` hands out now, or None."""
        if not self._ready:
            return None
        if self._order == "completion":
            return 0
        oldest = min(self._open)
        return next((i for i, g in enumerate(self._ready) if self._grant_of[g.group_id] == oldest), None)

    def _deliver(self, item: Group | BaseException) -> None:
        if isinstance(item, BaseException):
            self._failures.append(item)
        else:
            self._ready.append(item)
        self._arrived.set()

    def undelivered_group_ids(self) -> list[int]:
        """Ids of groups dispatched or queued for replay but not yet returned by `get_group`
        (sorted): what a run resumed from a checkpoint taken now must replay."""
        return sorted(self._undelivered)

    @property
    def rollouts_running(self) -> int:
        """Rollouts started and not finished (they hold a concurrency slot)."""
        return self._running

    @property
    def idle_seconds(self) -> float:
        """Wall seconds since construction during which no rollout was running: nothing could
        send the engine work (the generation side's wait; compare two readings for a step)."""
        open_idle = time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        return self._idle_s + open_idle

    @property
    def groups_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def groups_outstanding(self) -> int:
        """Groups granted by `allow` and not yet handed out by `get_group`: tickets waiting to
        be dispatched, groups running, completed groups waiting."""
        return sum(self._open.values())

    async def close(self) -> None:
        """Stop dispatching, cancel in-flight rollouts and wait until each released its resources."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        for task in list(self._in_flight):
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
        self._in_flight.clear()

    async def _dispatch(self) -> None:
        while True:
            await self._tickets.acquire()
            grant = self._ticket_grant.popleft()
            if self._replay:
                group_id = self._replay.pop(0)
            else:
                group_id = self.next_group_id
                self.next_group_id += 1
                self._undelivered.add(group_id)
            self._grant_of[group_id] = grant
            task = asyncio.create_task(self._run_group(group_id), name=f"group-{group_id}")
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _run_group(self, group_id: int) -> None:
        jobs: list[asyncio.Future[Rollout]] = []
        try:
            task = self._tasks_source.get(group_id)
            verifier = self._verifier_for(task)
            size = self._group_sizes.get(group_id, self._group_size)
            gate = GroupGate()
            jobs = [asyncio.ensure_future(self._run_one(task, group_id, verifier, gate.ticket()))
                    for _ in range(size)]
            rollouts = await asyncio.gather(*jobs)
        except BaseException as exc:
            # cancel the group's other rollouts and wait until each released its resources
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            if not isinstance(exc, Exception):
                raise
            self._deliver(exc)  # the consumer re-raises it and stops the run
            return
        group = Group(group_id=group_id, task_id=task.task_id, rollouts=list(rollouts))
        try:
            group = self._on_group(group) if self._on_group is not None else group
        except Exception as exc:  # noqa: BLE001 - a failing callback stops the run, like a failed group
            self._deliver(exc)
            return
        self._deliver(group)

    async def _run_one(self, task: Task, group_id: int, verifier: Verifier, gate: _GateTicket) -> Rollout:
        async with self._rollout_slots:
            self.rollouts_started += 1
            if self._running == 0 and self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
                self._idle_since = None
            self._running += 1
            try:
                rollout = await run_rollout(
                    task, group_id, self._harness, self._backend, self._sessions, verifier, self._limits,
                    gate=gate,
                )
            finally:
                self._running -= 1
                if self._running == 0:
                    self._idle_since = time.monotonic()
            self.rollouts_finished += 1
            if self._on_rollout is not None:
                self._on_rollout(rollout)
            log.debug("rollout %s of group %d: %s reward=%s", rollout.rollout_id, group_id,
                      rollout.status, rollout.reward)
            return rollout

"""Keeps groups of rollouts in flight and hands completed groups to the consumer.

Responsibility: dispatch groups (G rollouts of the task chosen by the seed `group_id`) under a
concurrency limit on rollouts and a budget of groups the consumer has allowed, and deliver each
group when all of its rollouts have finished.

Staleness (DESIGN.md §1, §6): the consumer (the trainer) grants `allow(n)` group tickets. It grants
`(max_staleness + 1) * groups_per_step` at start and `groups_per_step` after each optimizer step,
so a group dispatched while the policy is at version v is consumed, in dispatch order, no later
than step v + max_staleness. With `max_staleness = 0` this is the synchronous loop: rollouts for
step k start only after the weights of step k-1 are on the engine. Groups that finish out of
order can still be staler; the trainer measures staleness per turn and drops what is too old.

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
from collections.abc import Callable, Mapping, Sequence

from harnessrl.harness.base import Harness
from harnessrl.rewards.base import Verifier
from harnessrl.rollout.runner import RolloutLimits, SessionHost, run_rollout
from harnessrl.sandbox.base import SandboxBackend
from harnessrl.tasks.base import Task, TaskSource
from harnessrl.types import Group, Rollout

log = logging.getLogger(__name__)


class Orchestrator:
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
    ) -> None:
        """`on_rollout` is called with each rollout as it finishes (progress displays);
        `group_sizes` gives some groups another number of rollouts than `group_size` (a resumed
        evaluation runs only the rollouts a group still lacks); `on_group` maps each completed
        group to the one `get_group` returns, as soon as it completes (the trainer shapes its
        rewards there, and may `allow` a replacement for a group without signal)."""
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
        self._done: asyncio.Queue[Group | BaseException] = asyncio.Queue()
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

    def allow(self, n_groups: int) -> None:
        """Let `n_groups` more groups be dispatched."""
        for _ in range(n_groups):
            self._tickets.release()

    def start(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch(), name="orchestrator-dispatch")

    async def get_group(self, on_wait: Callable[[], None] | None = None, poll_s: float = 0.5) -> Group:
        """Wait for the next completed group (in completion order).

        Args:
            on_wait: called every `poll_s` seconds while waiting (progress displays).

        Raises:
            The error of a group that could not run at all (e.g. `HarnessInstallError`).
        """
        if self._dispatcher is not None and self._dispatcher.done():
            self._dispatcher.result()  # re-raise a dispatcher failure instead of hanging
        get = asyncio.ensure_future(self._done.get())
        try:
            while not get.done():
                if on_wait is not None:
                    on_wait()
                await asyncio.wait({get}, timeout=poll_s)
        finally:
            get.cancel()
        item = get.result()
        if isinstance(item, BaseException):
            raise item
        self._undelivered.discard(item.group_id)
        return item

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
            if self._replay:
                group_id = self._replay.pop(0)
            else:
                group_id = self.next_group_id
                self.next_group_id += 1
                self._undelivered.add(group_id)
            task = asyncio.create_task(self._run_group(group_id), name=f"group-{group_id}")
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _run_group(self, group_id: int) -> None:
        jobs: list[asyncio.Future[Rollout]] = []
        try:
            task = self._tasks_source.get(group_id)
            verifier = self._verifier_for(task)
            jobs = [asyncio.ensure_future(self._run_one(task, group_id, verifier))
                    for _ in range(self._group_sizes.get(group_id, self._group_size))]
            rollouts = await asyncio.gather(*jobs)
        except BaseException as exc:
            # cancel the group's other rollouts and wait until each released its resources
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            if not isinstance(exc, Exception):
                raise
            await self._done.put(exc)  # the consumer re-raises it and stops the run
            return
        group = Group(group_id=group_id, task_id=task.task_id, rollouts=list(rollouts))
        try:
            group = self._on_group(group) if self._on_group is not None else group
        except Exception as exc:  # noqa: BLE001 - a failing callback stops the run, like a failed group
            await self._done.put(exc)
            return
        await self._done.put(group)

    async def _run_one(self, task: Task, group_id: int, verifier: Verifier) -> Rollout:
        async with self._rollout_slots:
            self.rollouts_started += 1
            if self._running == 0 and self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
                self._idle_since = None
            self._running += 1
            try:
                rollout = await run_rollout(
                    task, group_id, self._harness, self._backend, self._sessions, verifier, self._limits
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

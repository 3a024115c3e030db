"""Where a training step's time and CPU went: the `time/*`, `engine/*` and
`rollouts_in_flight_groups` metrics of one step.

Responsibility: read the counters at a step's start (`StepClock.begin`), at its phase
boundaries, at the end of its weight sync and at the end of its work, and turn them into the
step's metrics (`StepClock.metrics`). The CPU figures: this (the event loop's) thread, this
process (`time.process_time`), and the cores' busy time from `/proc/stat` (`proc(5)`) less this
process's, which is what the agents, verifiers and other jobs took.

What it does not do: decide what a step does (`train/loop.py`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harnessrl.engine.stats import EngineStats


class Counters(Protocol):
    """What a clock reads of the run's rollout side (the orchestrator)."""

    @property
    def idle_seconds(self) -> float: ...

    @property
    def groups_in_flight(self) -> int: ...


class StatsSource(Protocol):
    """What a clock reads of the engine."""

    def stats(self) -> EngineStats | None: ...


def machine_busy_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU seconds the cores this process may run on (`os.sched_getaffinity`) have spent busy
    since boot, every process together: user, nice, system, irq, softirq and steal time of their
    `cpuN` lines in `/proc/stat` (`proc(5)`; idle and iowait left out), in clock ticks
    (`SC_CLK_TCK`). None where there is no such file (not Linux). In a container limited by a
    CPU quota rather than a cpuset, the cores are shared with the host's other tenants, whose
    time counts too."""
    try:
        lines = stat.read_text().splitlines()
        cores = os.sched_getaffinity(0)
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in rest.split()[:8])
            busy += user + nice + system + irq + softirq + steal
    return busy / tick


@dataclass
class StepClock:
    """One step's counters: read at its start (`begin`), at `pulled` / `trained`, at
    `sync_done` and at `end`; `metrics()` turns them into the step's metrics."""

    counters: Counters
    engine_source: StatsSource
    start: float = field(default_factory=time.monotonic)
    cpu: float = field(default_factory=time.thread_time)
    """CPU seconds of this (the event loop's) thread: the proxy, the orchestrator, sandboxes."""
    process_cpu: float = field(default_factory=time.process_time)
    """CPU seconds of this process (every thread: trainer, engine, event loop)."""
    machine_busy: float | None = field(default_factory=machine_busy_seconds)
    """`machine_busy_seconds()` at the step's start."""
    idle: float = 0.0
    engine: EngineStats | None = None
    pulled: float = 0.0
    trained: float = 0.0
    synced: float = 0.0
    process_cpu_s: float = 0.0
    """This process's CPU seconds from the start to `sync_done` (`time/process_cpu_s`)."""
    other_cpu_s: float | None = None
    """The cores' busy seconds over the same span not spent in this process (`time/other_cpu_s`);
    None without `/proc/stat`."""
    ended: float = 0.0
    """When the step's work ended (`end`): the end of the engine counters' span."""
    idle_end: float = 0.0
    loop_cpu_end: float = 0.0
    engine_end: EngineStats | None = None
    groups_in_flight: int = 0

    @classmethod
    def begin(cls, counters: Counters, engine: StatsSource) -> StepClock:
        """A clock started now, with the orchestrator's idle time and the engine's counters."""
        return cls(counters, engine, idle=counters.idle_seconds, engine=engine.stats())

    def mark_pulled(self) -> None:
        """The step's groups are in (the end of `time/rollout_wait_s`)."""
        self.pulled = time.monotonic()

    def mark_trained(self) -> None:
        """The optimizer step is done (the end of `time/train_s`)."""
        self.trained = time.monotonic()

    def sync_done(self) -> None:
        """The step's weight sync ended: the end of `time/step_s` and of the CPU counters (a
        held-out evaluation after it is not part of the step)."""
        self.synced = time.monotonic()
        self.process_cpu_s = time.process_time() - self.process_cpu
        busy = machine_busy_seconds()
        if busy is not None and self.machine_busy is not None:
            # the agents and their commands (their own processes, in sandboxes), verifiers run
            # as processes, and any other job
            self.other_cpu_s = max(0.0, busy - self.machine_busy - self.process_cpu_s)

    def end(self) -> None:
        """The step's work is done (its held-out evaluation included): the counters read now
        close its span, however late its record is written."""
        self.ended = time.monotonic()
        self.idle_end = self.counters.idle_seconds
        self.loop_cpu_end = time.thread_time()
        self.engine_end = self.engine_source.stats()
        self.groups_in_flight = self.counters.groups_in_flight

    def metrics(self) -> dict[str, float]:
        """The step's `time/*` metrics, its engine counters (`engine/*`, `EngineStats.step_metrics`)
        and `rollouts_in_flight_groups`; call after `end`."""
        out = {
            "time/rollout_wait_s": self.pulled - self.start,
            "time/train_s": self.trained - self.pulled,
            "time/sync_s": self.synced - self.trained,
            "time/step_s": self.synced - self.start,
            # the generation side's wait: no rollout running (nothing for the engine)
            "time/rollouts_idle_s": self.idle_end - self.idle,
            # CPU of the event loop's thread: the proxy's HTTP, render and parse, the orchestrator
            # and sandbox management (the trainer and the engine have their own)
            "time/loop_cpu_s": self.loop_cpu_end - self.cpu,
            "time/process_cpu_s": self.process_cpu_s,  # over the same span as `time/step_s`
            "rollouts_in_flight_groups": self.groups_in_flight,
        }
        if self.other_cpu_s is not None:
            out["time/other_cpu_s"] = self.other_cpu_s
        if self.engine_end is not None:  # prefix cache and batching, this step
            out.update(self.engine_end.step_metrics(self.engine))
            # over the same span as the counters (from the step's start to its end)
            out["engine/busy_frac"] = out["engine/busy_seconds"] / max(self.ended - self.start, 1e-9)
        return out

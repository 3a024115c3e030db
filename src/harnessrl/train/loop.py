"""The asynchronous GRPO loop: one function that reads top to bottom, one call per phase.

Responsibility: for each step of an open run (`train/setup.TrainingRun`), pull its groups
(rollouts for later steps keep running on the engine, through the proxy, in sandboxes), build
its rows (`train/rows.py`), take one optimizer step on the trainer thread, publish the new
weights as policy version + 1 (`WeightSync`, never directly), let the orchestrator grant the
groups of the next steps (`Orchestrator.after_sync`), then record the step: its rollouts,
metrics, console lines, held-out evaluation and checkpoint. The weight-sync canary's verdict
on a publish arrives while the next step trains (`train`'s docstring): the step's record
waits for it, and the next update too.

Staleness (DESIGN.md §1, §6): the orchestrator keeps `(max_staleness + 1) * groups_per_step`
groups granted ahead; a row whose oldest trained token was sampled more than `max_staleness`
versions ago is dropped and counted. `max_staleness = 0` is the synchronous loop.

Steps are 1-based everywhere (console, final table, `metrics.jsonl` `step`, `checkpoints/step-k`):
step k is the k-th training step and `checkpoints/step-k` the state after it; `policy_version`
counts the optimizer updates applied (a step that trains nothing, and says why, adds none).
`rollouts.jsonl` and `metrics.jsonl` get a step's rollouts and metrics when the step completes
and its canary verdict is in; a signal cancels the step in progress: nothing of it is written,
a completed step waiting for its verdict is written when the verdict arrives, and a checkpoint
being written is finished.

What it does not do: build or release the run's parts (`train/setup.py`), or own the process
(ranks, signals, exit codes: `train/run.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from harnessrl.config import RunConfig
from harnessrl.engine.stats import EngineStats
from harnessrl.engine.weight_sync import SyncReport
from harnessrl.jsonl import read_jsonl
from harnessrl.log import to_run_log
from harnessrl.loss.token_weights import append_token_weights
from harnessrl.train.console import (
    bound_line,
    final_table,
    offpolicy_warnings,
    print_conversation,
    rows_line,
    skip_reason,
    step_line,
)
from harnessrl.train.distributed import Ranks
from harnessrl.train.evaluation import evaluate_held_out
from harnessrl.train.plot import curve_table, write_curve_png
from harnessrl.train.rows import RolloutBound, StepRows, rows_for_step
from harnessrl.train.setup import TrainingRun, open_run
from harnessrl.types import Group

log = logging.getLogger(__name__)

StepMetrics = dict[str, Any]
"""One step's metrics (`metrics.jsonl` line): numbers, and `skip_reason` text on a skipped step."""

PROGRESS_EVERY_S = 30.0
"""Off a terminal, seconds between progress records while a step waits for its groups."""

PARITY_BOUND = 1e-3
"""The step-0 check's bound on mean |exp(trainer - sampler logprob) - 1| (float32 on CPU)."""


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
    """Where one step's wall time went (the `time/*` metrics) and the counters read at its start."""

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

    def end(self, run: TrainingRun) -> None:
        """The step's work is done (its held-out evaluation included): the counters read now
        close its span, however late its record is written (`record_step`)."""
        self.ended = time.monotonic()
        self.idle_end = run.orchestrator.idle_seconds
        self.loop_cpu_end = time.thread_time()
        self.engine_end = run.runtime.engine.stats()
        self.groups_in_flight = run.orchestrator.groups_in_flight


async def run(cfg: RunConfig, run_dir: Path, *, resume: bool = False, console: Console | None = None,
              ranks: Ranks | None = None) -> list[StepMetrics]:
    """Open the run of `cfg` in `run_dir` and train it (`open_run`, then `train`); returns the
    per-step metrics.

    Raises:
        ConfigError: from `open_run`.
    """
    async with open_run(cfg, run_dir, resume=resume, console=console, ranks=ranks) as training_run:
        return await train(training_run)


async def train(run: TrainingRun) -> list[StepMetrics]:
    """The training loop over an open run; returns the per-step metrics it logged (with
    `train.eval_every`, a first entry with `step` 0 holds the held-out evaluation before any
    update).

    The weight-sync canary's verdict on step k's publish (`engine/canary.py`, deferred) arrives
    while step k+1 trains: step k is recorded when it arrives, and step k+1's update waits for
    it (`TrainerGroup.step`'s `before_update`), so a failed canary stops the run before any
    update is applied to tokens sampled from the weights it rejected, and before step k is
    written. A step followed by a held-out evaluation or a checkpoint, and the last, waits for
    its verdict itself."""
    cfg, orch = run.cfg, run.orchestrator
    version = run.resume.version
    history: list[StepMetrics] = []
    orch.start()
    if run.eval_tasks is not None and run.resume.checkpoint is None:
        # before the first update (training rollouts of step 1 run meanwhile)
        before = {"step": 0, "policy_version": version, **await held_out(run, 0)}
        history.append(before)
        for sink in run.sinks:
            sink.log(0, before)
    nonfinite_skips, checkpoints = 0, CheckpointClock(cfg)  # updates skipped for a NaN/inf gradient norm
    verdict: Future[tuple[float, float]] | None = None  # the canary's on the last publish
    recording: asyncio.Future[None] | None = None  # the last step's record, waiting for that verdict
    try:
        for step in range(run.resume.step + 1, cfg.train.steps + 1):
            clock = StepClock(idle=orch.idle_seconds, engine=run.runtime.engine.stats())
            groups = await pull_groups(run, step)
            extra = await run.sampling.draw(groups, cfg.train.groups_per_step, version)
            clock.pulled = time.monotonic()
            batch = rows_for_step(groups, hooks=run.hooks, advantage_fn=run.advantage_fn, version=version,
                                  max_staleness=cfg.train.max_staleness, train_auxiliary=cfg.train.train_auxiliary,
                                  bound=RolloutBound(cfg.train.max_rows_per_rollout, cfg.train.max_tokens_per_rollout))
            metrics: StepMetrics = {"step": step, **batch.metrics}
            if cfg.train.dynamic_sampling_max_groups:
                metrics["groups_drawn_extra"] = float(extra)
            if step == run.resume.step + 1 and run.resume.checkpoint is None:
                metrics.update(await step0_check(run, batch))
            metrics.update(await trainer_step(run, batch, step, verdict, version))
            nonfinite_skips += int(metrics.get("skipped_nonfinite", 0))
            metrics["skipped_nonfinite_steps"] = float(nonfinite_skips)
            clock.trained = time.monotonic()
            updated = bool(batch.rows) and not metrics.get("skipped")
            pending: SyncReport | None = None  # this step's publish, its canary verdict still to come
            if updated:
                version += 1
                report = await publish(run, version)
                metrics.update(report.as_metrics())
                if report.pending_canary is not None:
                    verdict, pending = report.pending_canary, report
            clock.sync_done()
            orch.after_sync(more=step < cfg.train.steps)  # the groups of later steps may start now
            due = checkpoints.due(step)
            if pending is not None and (step == cfg.train.steps or eval_due(cfg, step) or due):
                metrics.update(await canary_metrics(pending))  # before the evaluation reads the engine
                pending = None
            metrics.update(await after_update(run, step, version, updated, clock))
            clock.end(run)
            if recording is not None:
                await recording
            recording = asyncio.ensure_future(record_when_verified(run, step, version, groups, metrics, clock,
                                                                   pending))
            history.append(metrics)
            if due:
                await recording
                await checkpoint(run, step, version, checkpoints)
    except BaseException:
        if recording is not None:  # a completed step is written unless its canary failed
            try:
                await asyncio.shield(recording)
            except Exception as exc:  # noqa: BLE001 - the run is ending with its own error
                log.error("the last completed step was not recorded: %s", exc)
        raise
    if recording is not None:
        await recording
    finish(run, history)
    return history


def eval_due(cfg: RunConfig, step: int) -> bool:
    """Whether a held-out evaluation follows step `step`."""
    return bool(cfg.train.eval_every) and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)


@dataclass
class CheckpointClock:
    """When `checkpoints/step-k` is written after step k: every `train.checkpoint_every` steps
    and after the last (kept), and once `train.checkpoint_every_s` seconds have passed since the
    last checkpoint or the start of this process (rolling: `checkpoint` removes the older
    rolling ones once a newer checkpoint is complete, so they cost one checkpoint's disk). The
    clock is the training loop's, on rank 0: every rank saves when it says so."""

    cfg: RunConfig
    last: float = field(default_factory=lambda: time.monotonic())
    """`time.monotonic()` of the last checkpoint written (or of the start)."""

    def kept(self, step: int) -> bool:
        """Whether step `step` ends with a kept checkpoint (`checkpoint_every`, the last step)."""
        every = self.cfg.train.checkpoint_every
        return step == self.cfg.train.steps or bool(every and step % every == 0)

    def due(self, step: int) -> bool:
        """Whether a checkpoint, kept or rolling, follows step `step`."""
        every_s = self.cfg.train.checkpoint_every_s
        return self.kept(step) or bool(every_s and time.monotonic() - self.last >= every_s)


async def canary_metrics(report: SyncReport) -> dict[str, float]:
    """The `sync/*` metrics of `report` (`SyncReport.as_metrics`) once its deferred canary
    verdict (`pending_canary`) is in: with `sync/canary_abs_dev` and `sync/canary_seconds`.

    Raises:
        CanaryError: the verdict failed.
    """
    assert report.pending_canary is not None
    dev, seconds = await asyncio.wrap_future(report.pending_canary)
    return replace(report, canary_abs_dev=dev, canary_seconds=seconds).as_metrics()


async def record_when_verified(run: TrainingRun, step: int, version: int, groups: list[Group],
                               metrics: StepMetrics, clock: StepClock, pending: SyncReport | None) -> None:
    """`record_step` once the canary verdict of the step's publish (`pending`, when it is still
    to come) is in; nothing is written when it fails.

    Raises:
        CanaryError: the verdict failed.
    """
    if pending is not None:
        metrics.update(await canary_metrics(pending))
    record_step(run, step, version, groups, metrics, clock)


async def pull_groups(run: TrainingRun, step: int) -> list[Group]:
    """Wait for the step's `groups_per_step` completed groups (shaped as they completed): a
    live status line on a terminal, a progress record every `PROGRESS_EVERY_S` seconds
    otherwise (and in `run.log`)."""
    orch, n, steps = run.orchestrator, run.cfg.train.groups_per_step, run.cfg.train.steps
    groups: list[Group] = []
    last_record = time.monotonic()

    def progress() -> str:
        return (f"step {step}/{steps}: {len(groups)}/{n} groups ready; rollouts {orch.rollouts_finished} "
                f"finished, {orch.rollouts_running} running")

    def on_wait() -> None:
        nonlocal last_record
        status.update(progress())
        if not run.console.is_terminal and time.monotonic() - last_record >= PROGRESS_EVERY_S:
            last_record = time.monotonic()
            log.info(progress())

    with run.console.status("") as status:
        while len(groups) < n:
            groups.append(await orch.get_group(on_wait=on_wait))
    return groups


async def step0_check(run: TrainingRun, batch: StepRows) -> dict[str, float]:
    """The step-0 check: trainer and sampler hold the same weights now, so the mean
    |exp(trainer - sampler logprob) - 1| over the rows built should be ~0 (`step0/ratio_abs_dev`)."""
    parity = await run.on_trainer(run.trainer.parity, batch.built)
    if parity is None:
        return {}
    mark = "ok" if parity <= PARITY_BOUND else f"ABOVE {PARITY_BOUND:g}"
    log.info("step-0 check: mean |exp(trainer - sampler logprob) - 1| = %.2e (%s)", parity, mark)
    return {"step0/ratio_abs_dev": parity}


async def trainer_step(run: TrainingRun, batch: StepRows, step: int,
                       verdict: Future[tuple[float, float]] | None = None, version: int | None = None) -> StepMetrics:
    """One optimizer step over the rows on the trainer thread (rollouts continue meanwhile),
    its update applied once `verdict` (the last publish's canary) passed; a step with no row is
    skipped, and says why. `version`: the weights' version the trainer holds (the staleness
    split of the `offpolicy/*` metrics).

    Raises:
        CanaryError: `verdict` failed (no update applied)."""
    metrics: StepMetrics = {}
    if batch.rows:
        result = await run.on_trainer(run.trainer.step, batch.rows, step,
                                      verdict.result if verdict is not None else None, version)
        metrics.update(result.metrics)
        append_token_weights(run.run_dir, step, result.token_weights)  # for the viewer
    else:
        metrics["skipped"] = 1.0
    if metrics.get("skipped") and "skip_reason" not in metrics:
        metrics["skip_reason"] = skip_reason({**batch.metrics, **metrics}) if not batch.rows else "no trainable token"
    return metrics


async def publish(run: TrainingRun, version: int) -> SyncReport:
    """Publish the weights as `version`; blocks (on the trainer thread) until the engine serves
    them (`WeightSync`; with the canary on, its verdict may still be pending:
    `SyncReport.pending_canary`)."""
    return await run.on_trainer(run.trainer.publish, run.sync, version)


async def after_update(run: TrainingRun, step: int, version: int, updated: bool, clock: StepClock) -> StepMetrics:
    """What is measured once the engine has the step's weights: how far the update moved them
    (the first update and every `log.update_norm_every`-th after it), and the held-out
    evaluation when due."""
    cfg, metrics = run.cfg, {}
    norm_every = cfg.log.update_norm_every
    if updated and norm_every and (version - 1) % norm_every == 0:
        metrics["param_delta_l2"] = await run.on_trainer(run.trainer.update_norm)
        metrics["time/update_norm_s"] = time.monotonic() - clock.synced
    if run.eval_tasks is not None and eval_due(cfg, step):
        metrics.update(await held_out(run, step))  # the policy after this step
    return metrics


async def held_out(run: TrainingRun, after_step: int) -> dict[str, float]:
    """The held-out evaluation of the policy the engine serves now (`eval/*`)."""
    assert run.eval_tasks is not None
    cfg = run.cfg
    return await evaluate_held_out(
        run.runtime, run.eval_tasks, samples=cfg.train.eval_samples or cfg.rollout.group_size,
        max_concurrent=cfg.concurrent_rollouts, limits=run.limits,
        out_dir=run.run_dir / "eval" / f"step-{after_step}")


def record_step(run: TrainingRun, step: int, version: int, groups: list[Group], metrics: StepMetrics,
                clock: StepClock) -> None:
    """The step completed: its timings and engine counters join its metrics; its rollouts
    (the verifier's reward and the training reward, both) go to `rollouts.jsonl`, its metrics
    to every sink, its line and its first conversations to the console."""
    metrics.update({
        "policy_version": version,
        "time/rollout_wait_s": clock.pulled - clock.start,
        "time/train_s": clock.trained - clock.pulled,
        "time/sync_s": clock.synced - clock.trained,
        "time/step_s": clock.synced - clock.start,
        # the generation side's wait: no rollout running (nothing for the engine)
        "time/rollouts_idle_s": clock.idle_end - clock.idle,
        # CPU of the event loop's thread: the proxy's HTTP, render and parse, the orchestrator
        # and sandbox management (the trainer and the engine have their own)
        "time/loop_cpu_s": clock.loop_cpu_end - clock.cpu,
        "time/process_cpu_s": clock.process_cpu_s,  # over the same span as `time/step_s`
        "rollouts_in_flight_groups": clock.groups_in_flight,
    })
    if clock.other_cpu_s is not None:
        metrics["time/other_cpu_s"] = clock.other_cpu_s
    if clock.engine_end is not None:  # prefix cache and batching, this step
        metrics.update(clock.engine_end.step_metrics(clock.engine))
        # over the same span as the counters (from the step's start to its end)
        metrics["engine/busy_frac"] = metrics["engine/busy_seconds"] / max(clock.ended - clock.start, 1e-9)
    for g in groups:
        for r in g.rollouts:
            run.rollouts_file.write(r.model_dump_json() + "\n")
    run.rollouts_file.flush()
    for sink in run.sinks:
        sink.log(step, metrics)
    log.info(step_line(step, run.cfg.train.steps, metrics))
    for line in offpolicy_warnings(metrics):
        log.warning("step %d: %s", step, line)
    for r in [r for g in groups for r in g.rollouts][: run.cfg.log.log_completions]:
        print_conversation(run.console, r)


async def checkpoint(run: TrainingRun, step: int, version: int, clock: CheckpointClock) -> None:
    """`checkpoints/step-k` when `clock` says it is due: the policy, the optimizer and the data
    position (the next new group, and the groups dispatched but not trained on yet, which a
    resumed run replays); `"rolling": true` in its state when only `checkpoint_every_s` made it
    due. Once it is complete, older rolling checkpoints are removed. Finished even when the run is
    stopped meanwhile."""
    if not clock.due(step):
        return
    orch = run.orchestrator
    state = {"step": step, "policy_version": version, "next_group_id": orch.next_group_id,
             "replay_group_ids": orch.undelivered_group_ids(), "rolling": not clock.kept(step)}
    directory = run.run_dir / "checkpoints" / f"step-{step}"
    work = asyncio.ensure_future(run.on_trainer(run.trainer.save, run.tokenizer, directory, state))
    try:
        await asyncio.shield(work)
    except asyncio.CancelledError:
        await work  # a checkpoint being written is finished, never left half-made
        raise
    clock.last = time.monotonic()
    log.info("checkpoint %s%s", directory, " (rolling)" if state["rolling"] else "")
    drop_rolling(run.run_dir / "checkpoints", before=step)


def drop_rolling(root: Path, before: int) -> None:
    """Remove the checkpoints `step-N` under `root` with N < `before` whose `state.json` says
    `"rolling": true` (a newer checkpoint replaces them); one that cannot be removed is logged."""
    for path in root.glob("step-*"):
        if not path.name.removeprefix("step-").isdigit() or int(path.name.removeprefix("step-")) >= before:
            continue
        try:
            rolling = json.loads((path / "state.json").read_text(encoding="utf-8")).get("rolling") is True
        except (OSError, ValueError):
            continue
        if rolling:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed rolling checkpoint %s", path)


def finish(run: TrainingRun, history: list[StepMetrics]) -> None:
    """The closing table, the line naming the side that bounds the run, the rows-and-credit
    line (rows per rollout, merge shares, trained tokens by turn), and the curve, on stdout and
    in `run.log`. The table and lines cover this process's steps; the curve (`curve.png` and its
    text table) every step of `metrics.jsonl`, so a resumed run draws the steps before it too."""
    out = Console(record=True)
    out.print(final_table(history))
    out.print(bound_line(history, max_staleness=run.cfg.train.max_staleness), markup=False, highlight=False)
    if credit := rows_line(history):
        out.print(credit, markup=False, highlight=False)
    cfg = run.cfg
    whole = read_jsonl(run.run_dir / "metrics.jsonl").rows or history
    curve = write_curve_png(whole, run.run_dir / "curve.png", tasks_per_step=cfg.train.groups_per_step,
                            title=f"harnessrl train: {cfg.harness.kind} on {cfg.tasks.kind} ({cfg.engine.model})")
    out.print(curve_table(whole), markup=False, highlight=False)
    if curve is not None:
        out.print(f"curve: {curve}", markup=False, highlight=False)
    to_run_log(out.export_text())

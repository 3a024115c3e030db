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
(ranks, signals, exit codes: `train/run.py`). It reads its settings from `run.settings`
(`setup.LoopSettings`), never the whole config.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

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
from harnessrl.train.rows import StepRows, rows_for_step
from harnessrl.train.setup import LoopSettings, TrainingRun
from harnessrl.train.step import StepResult
from harnessrl.train.timing import StepClock
from harnessrl.types import Group

log = logging.getLogger(__name__)

StepMetrics = dict[str, Any]
"""One step's metrics (`metrics.jsonl` line): numbers, and `skip_reason` text on a skipped step."""

PROGRESS_EVERY_S = 30.0
"""Off a terminal, seconds between progress records while a step waits for its groups."""

PARITY_BOUND = 1e-3
"""The step-0 check's bound on mean |exp(trainer - sampler logprob) - 1| (float32 on CPU)."""


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
    s, orch = run.settings, run.orchestrator
    version = run.resume.version
    history: list[StepMetrics] = []
    orch.start()
    if run.eval_tasks is not None and run.resume.checkpoint is None:
        # before the first update (training rollouts of step 1 run meanwhile)
        before = {"step": 0, "policy_version": version, **await held_out(run, 0)}
        history.append(before)
        for sink in run.sinks:
            sink.log(0, before)
    nonfinite_skips, checkpoints = 0, CheckpointClock(s)  # updates skipped for a NaN/inf gradient norm
    verdicts = Verdicts(run)
    try:
        for step in range(run.resume.step + 1, s.steps + 1):
            clock = StepClock.begin(orch, run.runtime.engine)
            groups = await pull_groups(run, step)
            extra = await run.sampling.draw(groups, s.groups_per_step, version)
            clock.mark_pulled()
            batch = rows_for_step(groups, hooks=run.hooks, advantage_fn=run.advantage_fn, version=version,
                                  max_staleness=s.max_staleness, train_auxiliary=s.train_auxiliary, bound=s.bound)
            metrics: StepMetrics = {"step": step, **batch.metrics}
            if s.dynamic_sampling:
                metrics["groups_drawn_extra"] = float(extra)
            if step == run.resume.step + 1 and run.resume.checkpoint is None:
                metrics.update(await step0_check(run, batch))
            result = await trainer_step(run, batch, step, verdicts.before_update(), version)
            metrics.update(result.metrics)
            nonfinite_skips += int(result.nonfinite)
            metrics["skipped_nonfinite_steps"] = float(nonfinite_skips)
            clock.mark_trained()
            if result.applied:
                version += 1
                metrics.update(verdicts.published(await publish(run, version)))
            clock.sync_done()
            orch.after_sync(more=step < s.steps)  # the groups of later steps may start now
            due = checkpoints.due(step)
            if step == s.steps or s.eval_due(step) or due:
                metrics.update(await verdicts.settle())  # before the evaluation reads the engine
            metrics.update(await after_update(run, step, version, result.applied, clock))
            clock.end()
            await verdicts.record(step, version, groups, metrics, clock)
            history.append(metrics)
            if due:
                await verdicts.written()
                await checkpoint(run, step, version, checkpoints)
    except BaseException:
        await verdicts.written_on_error()
        raise
    await verdicts.written()
    finish(run, history)
    return history


class Verdicts:
    """The weight-sync canary's verdict on the last publish, and the record of the step waiting
    for it: the one place the loop awaits a verdict (`train`'s docstring).

    A publish's verdict (`SyncReport.pending_canary`) gates the next update (`before_update`);
    the published step is recorded once it is in (`record`), or at once when the loop needs
    the engine checked first (`settle`: an evaluation, a checkpoint, the last step)."""

    def __init__(self, run: TrainingRun) -> None:
        self._run = run
        self._verdict: Future[tuple[float, float]] | None = None  # the canary's on the last publish
        self._pending: SyncReport | None = None  # this step's publish, its verdict still to come
        self._recording: asyncio.Future[None] | None = None  # the last step's record, waiting for it

    def before_update(self) -> Callable[[], object] | None:
        """What the next update waits on: the last publish's verdict (raises CanaryError when it
        failed); None before any deferred verdict."""
        return self._verdict.result if self._verdict is not None else None

    def published(self, report: SyncReport) -> StepMetrics:
        """The step's publish: its `sync/*` metrics; its verdict, when deferred, is awaited later."""
        if report.pending_canary is not None:
            self._verdict, self._pending = report.pending_canary, report
        return dict(report.as_metrics())

    async def settle(self) -> StepMetrics:
        """This step's verdict, awaited now: its `sync/*` metrics with the canary's (none when
        there is no verdict pending).

        Raises:
            CanaryError: the verdict failed.
        """
        pending, self._pending = self._pending, None
        return dict(await canary_metrics(pending)) if pending is not None else {}

    async def record(self, step: int, version: int, groups: list[Group], metrics: StepMetrics,
                     clock: StepClock) -> None:
        """Record the step (`record_step`) once its verdict is in, while the next step runs; the
        step before is written first.

        Raises:
            CanaryError: the previous step's verdict failed.
        """
        await self.written()
        pending, self._pending = self._pending, None
        self._recording = asyncio.ensure_future(
            record_when_verified(self._run, step, version, groups, metrics, clock, pending))

    async def written(self) -> None:
        """Wait until the last recorded step is written.

        Raises:
            CanaryError: its verdict failed (nothing of it written)."""
        if self._recording is not None:
            await self._recording

    async def written_on_error(self) -> None:
        """As `written`, as the run ends with its own error: a completed step is written unless
        its canary failed (logged), and a cancellation does not cut its writing short."""
        if self._recording is None:
            return
        try:
            await asyncio.shield(self._recording)
        except Exception as exc:  # noqa: BLE001 - the run is ending with its own error
            log.error("the last completed step was not recorded: %s", exc)


@dataclass
class CheckpointClock:
    """When `checkpoints/step-k` is written after step k: every `train.checkpoint_every` steps
    and after the last (kept), and once `train.checkpoint_every_s` seconds have passed since the
    last checkpoint or the start of this process (rolling: `checkpoint` removes the older
    rolling ones once a newer checkpoint is complete, so they cost one checkpoint's disk). The
    clock is the training loop's, on rank 0: every rank saves when it says so."""

    settings: LoopSettings
    last: float = field(default_factory=lambda: time.monotonic())
    """`time.monotonic()` of the last checkpoint written (or of the start)."""

    def kept(self, step: int) -> bool:
        """Whether step `step` ends with a kept checkpoint (`checkpoint_every`, the last step)."""
        every = self.settings.checkpoint_every
        return step == self.settings.steps or bool(every and step % every == 0)

    def due(self, step: int) -> bool:
        """Whether a checkpoint, kept or rolling, follows step `step`."""
        every_s = self.settings.checkpoint_every_s
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
    live status line on a terminal (with how far the longest prompt in prefill got, when the engine
    reports it), a progress record every `PROGRESS_EVERY_S` seconds
    otherwise (and in `run.log`)."""
    orch, n, steps = run.orchestrator, run.settings.groups_per_step, run.settings.steps
    groups: list[Group] = []
    last_record = time.monotonic()

    def progress() -> str:
        prefill = run.runtime.proxy.store.longest_prefill()  # a long prompt shows how far it got
        return (f"step {step}/{steps}: {len(groups)}/{n} groups ready; rollouts {orch.rollouts_finished} "
                f"finished, {orch.rollouts_running} running" + ("" if prefill is None else
                f"; prefilling {prefill.prefilled_tokens or 0:,}/{prefill.prompt_tokens:,} prompt tokens"))

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
                       before_update: Callable[[], object] | None = None, version: int | None = None) -> StepResult:
    """One optimizer step over the rows on the trainer thread (rollouts continue meanwhile),
    its update applied once `before_update` (the wait for the last publish's canary verdict)
    returns; a step with no row is not applied, and says why. `version`: the weights' version
    the trainer holds (the staleness split of the `offpolicy/*` metrics).

    Raises:
        CanaryError: from `before_update` (no update applied)."""
    if batch.rows:
        result: StepResult = await run.on_trainer(run.trainer.step, batch.rows, step, before_update, version)
        append_token_weights(run.run_dir, step, result.token_weights)  # for the viewer
    else:
        result = StepResult({"skipped": 1.0})
    if not result.applied and "skip_reason" not in result.metrics:
        result.metrics["skip_reason"] = (skip_reason({**batch.metrics, **result.metrics}) if not batch.rows
                                         else "no trainable token")
    return result


async def publish(run: TrainingRun, version: int) -> SyncReport:
    """Publish the weights as `version`; blocks (on the trainer thread) until the engine serves
    them (`WeightSync`; with the canary on, its verdict may still be pending:
    `SyncReport.pending_canary`)."""
    return await run.on_trainer(run.trainer.publish, run.sync, version)


async def after_update(run: TrainingRun, step: int, version: int, updated: bool, clock: StepClock) -> StepMetrics:
    """What is measured once the engine has the step's weights: how far the update moved them
    (the first update and every `log.update_norm_every`-th after it), and the held-out
    evaluation when due."""
    s, metrics = run.settings, {}
    norm_every = s.update_norm_every
    if updated and norm_every and (version - 1) % norm_every == 0:
        metrics["param_delta_l2"] = await run.on_trainer(run.trainer.update_norm)
        metrics["time/update_norm_s"] = time.monotonic() - clock.synced
    if run.eval_tasks is not None and s.eval_due(step):
        metrics.update(await held_out(run, step))  # the policy after this step
    return metrics


async def held_out(run: TrainingRun, after_step: int) -> dict[str, float]:
    """The held-out evaluation of the policy the engine serves now (`eval/*`)."""
    assert run.eval_tasks is not None
    return await evaluate_held_out(
        run.runtime, run.eval_tasks, samples=run.settings.eval_samples,
        max_concurrent=run.settings.eval_concurrency, limits=run.limits,
        out_dir=run.run_dir / "eval" / f"step-{after_step}")


def record_step(run: TrainingRun, step: int, version: int, groups: list[Group], metrics: StepMetrics,
                clock: StepClock) -> None:
    """The step completed: its timings and engine counters join its metrics; its rollouts
    (the verifier's reward and the training reward, both) go to `rollouts.jsonl`, its metrics
    to every sink, its line and its first conversations to the console."""
    metrics.update({"policy_version": version, **clock.metrics()})
    for g in groups:
        for r in g.rollouts:
            run.rollouts_file.write(r.model_dump_json() + "\n")
    run.rollouts_file.flush()
    for sink in run.sinks:
        sink.log(step, metrics)
    log.info(step_line(step, run.settings.steps, metrics))
    for line in offpolicy_warnings(metrics):
        log.warning("step %d: %s", step, line)
    for r in [r for g in groups for r in g.rollouts][: run.settings.log_completions]:
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
    out.print(bound_line(history, max_staleness=run.settings.max_staleness), markup=False, highlight=False)
    if credit := rows_line(history):
        out.print(credit, markup=False, highlight=False)
    whole = read_jsonl(run.run_dir / "metrics.jsonl").rows or history
    curve = write_curve_png(whole, run.run_dir / "curve.png", tasks_per_step=run.settings.groups_per_step,
                            title=run.settings.title)
    out.print(curve_table(whole), markup=False, highlight=False)
    if curve is not None:
        out.print(f"curve: {curve}", markup=False, highlight=False)
    to_run_log(out.export_text())

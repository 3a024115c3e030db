"""Opening a training run: everything the loop needs, built once, into a frozen `TrainingRun`.

Responsibility: check what only training needs (`check_training`), find the resume point
(`ResumePoint`: the checkpoint, its step, the data position and the groups to replay; lines
logged after it are dropped), start the runtime (engine, proxy, sandboxes, tasks), load the
policy on the trainer group, restore a checkpoint and publish its weights, load the hooks,
pick the advantage function, the weight sync (`engine/select.make_weight_sync` with
`sync_settings`), the dynamic sampler and the orchestrator (which owns every ticket), split
off the held-out tasks, open the metric sinks and the rollouts file; and release all of it,
in reverse, however the run ends (`open_run` is an async context manager).

What it does not do: run steps (`train/loop.py`) or handle the process (ranks, signals, exit
codes: `train/run.py`).

CPU split: the trainer runs on one dedicated thread with `train.num_threads` torch threads, the
engine on its own with `engine.num_threads`, so on a 2-core machine each gets one core (set
explicitly: two workers of 2 threads each oversubscribe and run far slower). Host memory: a CPU
trainer's freed memory stays in the process (`retain_freed_memory`), so a step reuses the last
step's pages instead of faulting fresh ones in.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import platform
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar

import torch
from rich.console import Console

from harnessrl.config import RunConfig, check_training_config, trainer_settings
from harnessrl.engine.canary import CanarySync
from harnessrl.engine.model_store import load_tokenizer
from harnessrl.engine.select import SyncSettings, make_weight_sync
from harnessrl.engine.speed import engine_hint, vllm_installed
from harnessrl.engine.weight_sync import WeightSync
from harnessrl.hooks import Hooks
from harnessrl.jsonl import repair_torn_tail
from harnessrl.log import MetricsSink, make_sinks
from harnessrl.loss.advantages import AdvantageFn, advantage_fn_for
from harnessrl.rollout.orchestrator import Orchestrator
from harnessrl.rollout.runner import RolloutLimits
from harnessrl.rollout.summary import rollout_line
from harnessrl.runtime import Prepared, Runtime, prepare, start_runtime
from harnessrl.tasks.base import TaskSource
from harnessrl.train.distributed import SINGLE, Ranks
from harnessrl.train.dynamic_sampling import DynamicSampling
from harnessrl.train.evaluation import held_out_split
from harnessrl.train.policy import latest_checkpoint
from harnessrl.train.resume import drop_lines_after_checkpoint
from harnessrl.train.rows import RolloutBound
from harnessrl.train.step import native_cpu_bfloat16
from harnessrl.train.template_doctor import quick_line
from harnessrl.train.trainer_group import TrainerGroup
from harnessrl.types import Rollout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a run starts: after `step` (0 for a new run), at policy `version`."""

    step: int = 0
    """Training steps already done (the checkpoint's `step-k`)."""
    version: int = 0
    """The policy version of the checkpoint's weights (optimizer updates applied)."""
    next_group_id: int = 0
    """The data position: the next new group's id (= task seed)."""
    replay: tuple[int, ...] = ()
    """Groups the checkpoint had dispatched but not trained on: dispatched again first."""
    checkpoint: Path | None = None
    """The checkpoint directory resumed from; None for a new run."""


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """The loop's slice of the run config (`loop_settings`): what `train/loop.py` reads, so that
    the loop never takes the whole config."""

    steps: int
    """`train.steps`: the last step (1-based)."""
    groups_per_step: int
    max_staleness: int
    train_auxiliary: bool
    bound: RolloutBound
    """`train.max_rows_per_rollout` and `train.max_tokens_per_rollout`."""
    dynamic_sampling: bool
    """`train.dynamic_sampling_max_groups > 0`: a step reports `groups_drawn_extra`."""
    eval_every: int
    eval_samples: int
    """Rollouts per held-out task: `train.eval_samples`, else `rollout.group_size`."""
    eval_concurrency: int
    """Held-out rollouts in flight at once (`RunConfig.concurrent_rollouts`)."""
    checkpoint_every: int
    checkpoint_every_s: float
    update_norm_every: int
    """`log.update_norm_every`."""
    log_completions: int
    """`log.log_completions`."""
    title: str
    """The curve's title: harness, tasks and model."""

    def eval_due(self, step: int) -> bool:
        """Whether a held-out evaluation follows step `step` (every `eval_every`, and the last)."""
        return bool(self.eval_every) and (step % self.eval_every == 0 or step == self.steps)


def loop_settings(cfg: RunConfig) -> LoopSettings:
    """The loop's slice of `cfg`."""
    t = cfg.train
    return LoopSettings(
        steps=t.steps, groups_per_step=t.groups_per_step, max_staleness=t.max_staleness,
        train_auxiliary=t.train_auxiliary, bound=RolloutBound(t.max_rows_per_rollout, t.max_tokens_per_rollout),
        dynamic_sampling=bool(t.dynamic_sampling_max_groups), eval_every=t.eval_every,
        eval_samples=t.eval_samples or cfg.rollout.group_size, eval_concurrency=cfg.concurrent_rollouts,
        checkpoint_every=t.checkpoint_every, checkpoint_every_s=t.checkpoint_every_s,
        update_norm_every=cfg.log.update_norm_every, log_completions=cfg.log.log_completions,
        title=f"harnessrl train: {cfg.harness.kind} on {cfg.tasks.kind} ({cfg.engine.model})")


@dataclass(frozen=True)
class TrainingRun:
    """An open training run: the parts of the loop, each built once (`open_run`)."""

    settings: LoopSettings
    run_dir: Path
    console: Console
    runtime: Runtime
    """Engine, proxy, sandboxes, tasks (`runtime.start_runtime`)."""
    trainer: TrainerGroup
    """Every trainer operation, on every rank that takes part."""
    executor: ThreadPoolExecutor
    """The one trainer thread (`train.num_threads` torch threads)."""
    tokenizer: PreTrainedTokenizerBase
    """The model's tokenizer (saved with each checkpoint)."""
    sync: WeightSync
    """Publishes the trainer's weights to the engine (the canary wrapped around it when on)."""
    orchestrator: Orchestrator
    """Groups in flight; owns every ticket (`allowance`, `after_sync`, replacements)."""
    sampling: DynamicSampling
    """Shapes groups as they complete; replaces those without signal."""
    hooks: Hooks
    advantage_fn: AdvantageFn
    sinks: list[MetricsSink]
    rollouts_file: IO[str]
    """`run_dir/rollouts.jsonl`, appended a step's rollouts when the step completes."""
    limits: RolloutLimits
    eval_tasks: TaskSource | None
    """The held-out tasks (`train.eval_every`), disjoint from the training tasks; None when off."""
    resume: ResumePoint = field(default_factory=ResumePoint)

    async def on_trainer(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the trainer thread (the event loop keeps serving the agents meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def check_training(cfg: RunConfig) -> None:
    """Checks of a config that only training needs: `config.check_training_config` (log sinks
    installed, no truncated sampling; `preflight.check_start` runs it for `harnessrl train`),
    then `warn_emulated_bfloat16`.

    Raises:
        ConfigError: as `config.check_training_config`.
    """
    check_training_config(cfg)
    warn_emulated_bfloat16(cfg)


def warn_emulated_bfloat16(cfg: RunConfig) -> None:
    """Warn (log) when a bfloat16 setting runs on a CPU without native bfloat16
    (`step.native_cpu_bfloat16`): it is emulated, a train step about ten times slower than in float32."""
    cpu = cfg.train.device == "cpu"
    slow = [name for name, on in (("train.autocast", cfg.train.autocast == "bfloat16" and cpu),
                                  ("train.dtype", cfg.train.dtype == "bfloat16" and cpu),
                                  ("engine.dtype", cfg.engine.kind == "embedded" and cfg.engine.device == "cpu"
                                   and cfg.engine.dtype == "bfloat16")) if on]
    if slow and not native_cpu_bfloat16():
        log.warning("%s = \"bfloat16\" on a CPU without native bfloat16 (neither AVX512-BF16 nor AMX): "
                    "torch emulates it, a train step about ten times slower than in float32; use \"float32\" here",
                    " and ".join(slow))


_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h


def retain_freed_memory(device: str) -> bool:
    """For a trainer on `device` "cpu", keep the memory this process frees for its own later
    allocations (glibc's malloc, through `mallopt`): one arena for every thread, no `mmap` per
    large block, no trimming. Returns whether it applied (False for another device, whose
    tensors are not malloc's, and off glibc). Process-wide; it acts on the threads that allocate for
    the first time afterwards, so call it before the trainer thread starts.

    Without it a CPU train step gives most of what it allocates back to the kernel and touches it
    again the next step: a trainer thread's blocks come from its own arena, whose heaps are
    unmapped once free, and blocks over 32 MiB (an embedding's gradient) are `mmap`ed each time.
    On SmolLM2-135M that was ~190k page faults a step (~0.75 GB), 1.3-2.4 s of system time inside
    a run against 3 s of compute (`bench/async.py`); with it a step faults ~0 pages and the rows,
    losses and updates are unchanged. The cost: the process keeps its peak heap (RSS does not
    shrink after a peak)."""
    if device != "cpu" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))


def sync_settings(cfg: RunConfig, *, defer_canary: bool = False) -> SyncSettings:
    """The slice of `cfg.train` a weight sync needs (`defer_canary`: `SyncSettings`'s; the
    training loop's sync defers it)."""
    t = cfg.train
    return SyncSettings(canary=t.sync_canary, trainer_dtype=t.dtype, lora_rank=t.lora_rank,
                        keep_versions=t.window.versions, defer_canary=defer_canary)


def find_resume_point(run_dir: Path, resume: bool) -> ResumePoint:
    """The latest checkpoint's position when `resume` (a new run's otherwise, or when there is
    none); drops the lines of `rollouts.jsonl` and `metrics.jsonl` logged after it (that work is
    redone)."""
    checkpoint = latest_checkpoint(run_dir) if resume else None
    point = ResumePoint()
    if checkpoint is not None:
        saved = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))
        point = ResumePoint(step=saved["step"], next_group_id=saved["next_group_id"],
                            replay=tuple(saved.get("replay_group_ids", [])), checkpoint=checkpoint)
    if resume:
        drop_lines_after_checkpoint(run_dir, point.step, point.next_group_id, list(point.replay))
        if checkpoint is None:
            log.warning("no checkpoint in %s: starting from step 1", run_dir / "checkpoints")
    return point


@asynccontextmanager
async def open_run(cfg: RunConfig, run_dir: Path, *, resume: bool = False, console: Console | None = None,
                   ranks: Ranks | None = None, prepared: Prepared | None = None) -> AsyncIterator[TrainingRun]:
    """The run of `cfg` in `run_dir`, open for the loop; closed (rollouts cancelled, runtime
    stopped, files and sinks closed, the trainer thread released) on leaving. `prepared`: the
    hooks, task source and verifier `preflight.check_start` built (built here when None, and
    then the config checked first: `check_training`).

    Raises:
        ConfigError: truncated sampling (`check_training`), a task source too small for
            `train.eval_size` held-out tasks, a weight sync the engine cannot take.
    """
    if prepared is None:
        check_training(cfg)
        prepared = prepare(cfg)
    else:
        warn_emulated_bfloat16(cfg)
    retain_freed_memory(cfg.train.device)  # before the trainer thread's first allocation picks its arena
    point = find_resume_point(run_dir, resume)
    executor = ThreadPoolExecutor(1, thread_name_prefix="trainer", initializer=torch.set_num_threads,
                                  initargs=(cfg.train.num_threads,))
    trainer = TrainerGroup(trainer_settings(cfg), ranks or SINGLE)
    completed = False
    async with AsyncExitStack() as stack:
        stack.callback(lambda: _release_trainer(trainer, executor, completed))
        sinks = make_sinks(cfg.log.sinks, run_dir, cfg.model_dump(mode="json"), project=cfg.log.project,
                           table_rollouts=cfg.log.table_rollouts)
        for sink in sinks:
            stack.callback(sink.close)
        repair_torn_tail(run_dir / "rollouts.jsonl")  # a torn line never fuses with the next record
        rollouts_file = stack.enter_context((run_dir / "rollouts.jsonl").open("a", encoding="utf-8"))
        rt = await stack.enter_async_context(start_runtime(cfg, isolation="required", run_dir=run_dir,
                                                           prepared=prepared))
        run = await _build(cfg, run_dir, rt, trainer, executor, sinks, rollouts_file, point,
                           console or Console(stderr=True), prepared.hooks)
        if isinstance(run.sync, CanarySync):
            stack.callback(run.sync.close)  # after a verdict in flight, before the engine stops
        stack.push_async_callback(run.orchestrator.close)
        yield run
        completed = True


async def _build(cfg: RunConfig, run_dir: Path, rt: Runtime, trainer: TrainerGroup, executor: ThreadPoolExecutor,
                 sinks: list[MetricsSink], rollouts_file: IO[str], point: ResumePoint,
                 console: Console, hooks: Hooks) -> TrainingRun:
    """The policy loaded (the same weights the engine serves) and restored, and every other part."""
    loop = asyncio.get_running_loop()
    # KL penalty: the reference is the initial weights, frozen, kept by the trainer group
    await loop.run_in_executor(executor, trainer.load, rt.model_dir)
    tokenizer = load_tokenizer(rt.model_dir)
    log.info(quick_line(tokenizer, cfg.engine.model, rt.engine.eos_token_ids))
    hint = engine_hint(cfg.engine.kind, rt.model_dir, vllm_installed())
    if hint:
        log.info(hint)
    advantage_fn = advantage_fn_for(cfg.train.advantage)
    sync = make_weight_sync(cfg.engine, rt.engine, sync_settings(cfg, defer_canary=True), run_dir=run_dir,
                            model_dir=rt.model_dir)
    if point.checkpoint is not None:
        point = await _restore(point, trainer, sync, executor)
    sampling = DynamicSampling(cfg.train.dynamic_sampling_max_groups, hooks.rollout_reward_fn, advantage_fn,
                               cfg.train.max_staleness)
    limits = RolloutLimits(cfg.rollout.agent_timeout_s, cfg.rollout.verify_timeout_s,
                           cfg.rollout.max_final_answer_chars)
    train_tasks, eval_tasks = rt.tasks, None
    if cfg.train.eval_every:
        train_tasks, eval_tasks = held_out_split(cfg.tasks, rt.tasks, cfg.train.eval_size)
    orch = _orchestrator(cfg, rt, train_tasks, limits, point, sampling)
    sampling.bind(orch)
    return TrainingRun(settings=loop_settings(cfg), run_dir=run_dir, console=console, runtime=rt, trainer=trainer, executor=executor,
                       tokenizer=tokenizer, sync=sync, orchestrator=orch, sampling=sampling, hooks=hooks,
                       advantage_fn=advantage_fn, sinks=sinks, rollouts_file=rollouts_file, limits=limits,
                       eval_tasks=eval_tasks, resume=point)


async def _restore(point: ResumePoint, trainer: TrainerGroup, sync: WeightSync,
                   executor: ThreadPoolExecutor) -> ResumePoint:
    """Load the checkpoint's policy and optimizer on every rank and publish its weights; the
    resume point with the checkpoint's policy version."""
    assert point.checkpoint is not None
    loop = asyncio.get_running_loop()
    state = await loop.run_in_executor(executor, trainer.restore, point.checkpoint)
    version = int(state["policy_version"])
    report = await loop.run_in_executor(executor, trainer.publish, sync, version)
    if report.pending_canary is not None:  # the resumed weights are checked before anything trains
        await asyncio.wrap_future(report.pending_canary)
    log.info("resumed from %s after step %d, policy version %d", point.checkpoint, point.step, version)
    if point.replay:
        log.info("replaying groups %s: they were in flight, not yet trained on, when the checkpoint was "
                 "taken", list(point.replay))
    elif "replay_group_ids" not in state:
        log.warning("this checkpoint does not list the groups in flight when it was taken: they are not "
                    "replayed (the run continues from group %d)", point.next_group_id)
    return ResumePoint(step=point.step, version=version, next_group_id=point.next_group_id,
                       replay=point.replay, checkpoint=point.checkpoint)


def _orchestrator(cfg: RunConfig, rt: Runtime, tasks: TaskSource, limits: RolloutLimits, point: ResumePoint,
                  sampling: DynamicSampling) -> Orchestrator:
    """The training orchestrator: `(max_staleness + 1) * groups_per_step` groups granted ahead
    (DESIGN.md §1), dispatched in `train.group_order`, shaped (and replaced) as they complete."""
    orch: Orchestrator

    def on_rollout(r: Rollout) -> None:
        log.info("rollout %d (group %d) %s", orch.rollouts_finished, r.group_id, rollout_line(r))

    orch = Orchestrator(
        tasks, rt.harness, rt.backend, rt.proxy, rt.verifier_for,
        group_size=cfg.rollout.group_size, max_concurrent_rollouts=cfg.concurrent_rollouts,
        limits=limits, first_group_id=point.next_group_id, replay_group_ids=point.replay,
        on_rollout=on_rollout, on_group=sampling.on_group, order=cfg.train.group_order,
        allowance=cfg.train.window.groups_ahead)
    return orch


def _release_trainer(trainer: TrainerGroup, executor: ThreadPoolExecutor, completed: bool) -> None:
    """Release the other ranks, then the trainer thread. After a signal or an error the thread
    may be stuck in a collective with ranks already gone, or in a step whose result is
    discarded: then do not wait long for it (`harnessrl train` exits without joining it)."""
    if trainer.ranks.distributed:
        stopped = executor.submit(trainer.stop)
        wait_futures([stopped], timeout=None if completed else 10.0)
    executor.shutdown(wait=completed, cancel_futures=True)

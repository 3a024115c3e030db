"""`harnessrl train`: the asynchronous GRPO loop.

Responsibility: the one top-to-bottom loop of a training run. Rollouts for the next steps run
(on the engine, through the proxy, in sandboxes) while the current step trains; after each
optimizer step the new weights go to the engine and `policy_version` increments.

Staleness (DESIGN.md §1, §6): the orchestrator may run `(max_staleness + 1) * groups_per_step`
groups ahead; a row whose oldest trained token was sampled more than `max_staleness` versions
ago is dropped and counted. `max_staleness = 0` is the synchronous loop.

CPU split: the engine decodes on its own thread with `engine.num_threads` torch threads; the
trainer runs on one dedicated thread with `train.num_threads`, so on a 2-core machine each gets
one core (set explicitly: two workers of 2 threads each oversubscribe and run far slower).

Steps are 1-based everywhere (console, final table, `metrics.jsonl` `step`, `checkpoints/step-k`):
step k is the k-th training step and `checkpoints/step-k` the state after it; `policy_version`
counts the optimizer updates applied (a step that trains nothing, and says why, adds none).
Weights reach the engine through its `WeightSync` (`engine/weight_sync.py`), never directly.

Several processes (`torchrun` / `accelerate launch`, `train/distributed.py`): rank 0 runs this
loop and owns the runtime (proxy, engine, orchestrator, files, console); every trainer
operation (load, step, parity check, weight export, checkpoint, restore) goes through a
`TrainerGroup`, which runs it on every rank that must take part; the other ranks only train
(`_follow`) and leave when rank 0 stops them. They keep the default action of SIGINT / SIGTERM (they hold nothing to
release), so a launcher forwarding Ctrl-C ends them at once while rank 0 stops cleanly.
`rollouts.jsonl` and `metrics.jsonl` get a step's rollouts and metrics when the step completes.

Shutdown (completion, Ctrl-C, SIGTERM, error): stop dispatch, cancel in-flight rollouts (each
kills its agent, closes its sandbox and revokes its key), stop the proxy and the engine, flush
files; see `runtime.start_runtime`, `Orchestrator.close` and `harnessrl.signals`. A signal
cancels the step in progress: nothing of it is written, a checkpoint being written is finished,
and the trainer thread is not joined. Resume replays the groups the checkpoint had dispatched
but not trained on, and drops the lines logged after the checkpoint (that work is redone).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console

from harnessrl.config import RunConfig, dump_config
from harnessrl.train.resume import drop_lines_after_checkpoint
from harnessrl.types import Group, Row

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0
"""Off a terminal, seconds between progress records while a step waits for its groups."""


def run_training(cfg: RunConfig, run_dir: Path, resume: bool = False) -> int:
    """Train per `cfg` in `run_dir`; returns the process exit code: 0 when every step ran, 130 /
    143 when SIGINT / SIGTERM stopped the run (`harnessrl.signals`; the step in progress then
    leaves no rollouts, metrics or checkpoint behind, earlier checkpoints stay).

    Raises:
        ConfigError: a hook, task source or verifier path that does not import (`check_run`),
            before the run directory is made.
    """
    from harnessrl.config import check_run
    from harnessrl.log import setup_logging
    from harnessrl.proxy.server import run_loop
    from harnessrl.signals import RunStopped, run_until_signal
    from harnessrl.train.distributed import close_ranks, init_ranks
    from harnessrl.train.policy import latest_checkpoint

    check_run(cfg)
    check_training(cfg)
    ranks = init_ranks(cfg.train.device, cfg.train.strategy)
    if not ranks.is_main:
        try:
            return _follow(cfg, ranks)
        finally:
            close_ranks(ranks)
    run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    setup_logging(cfg.log.level, run_dir / "run.log", console=console)
    if not resume:
        (run_dir / "config.toml").write_text(dump_config(cfg), encoding="utf-8")
    log.info("harnessrl train -> %s (model %s, harness %s, tasks %s, G=%d, %d steps)", run_dir,
             cfg.engine.model, cfg.harness.kind, cfg.tasks.kind, cfg.rollout.group_size, cfg.train.steps)
    if ranks.distributed:
        log.info("trainer on %d ranks (%s, %s, %s); this is rank 0", ranks.world_size, ranks.strategy,
                 ranks.device, cfg.train.dtype)
    try:
        # uvloop when installed: the agents' listener runs inside this process
        run_loop(run_until_signal(train(cfg, run_dir, resume=resume, console=console, ranks=ranks)))
        close_ranks(ranks)
    except RunStopped as stop:
        last = latest_checkpoint(run_dir)
        log.warning("stopped by %s: rollouts cancelled, sandboxes closed, files flushed; the step in "
                    "progress was not recorded; last checkpoint: %s", signal.Signals(stop.signum).name,
                    last if last is not None else "none")
        return stop.exit_code
    except KeyboardInterrupt:  # before the run's handler was installed
        return 130
    return 0


def _follow(cfg: RunConfig, ranks: Any) -> int:
    """A rank other than 0: load the policy and run rank 0's trainer operations until it says
    stop (`TrainerGroup.follow`). Returns 0, or 1 when rank 0 went away without stopping it."""
    import torch

    from harnessrl.train.trainer_group import TrainerGroup

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # nothing to release here: end at once
    logging.basicConfig(level=logging.WARNING, format=f"rank {ranks.rank}: %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.train.num_threads)
    try:
        TrainerGroup(cfg, ranks).follow()
    except RuntimeError as exc:  # gloo / NCCL: rank 0's connection closed (or this rank failed)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.error("trainer rank %d stopped before rank 0 released it (rank 0 gone?): %s", ranks.rank, first)
        return 1
    return 0


def check_training(cfg: RunConfig) -> None:
    """Checks of a config that only training needs.

    Raises:
        ConfigError: a `log.sinks` package not installed (`log.check_sinks`, naming its extra).
        ConfigError: `sampling.top_p < 1` or `sampling.top_k > 0`: the engine renormalises over
            the kept tokens but the trainer's logprobs are the full softmax at the temperature
            (`train/packing.py`), so the importance ratio would be wrong from the first step
            (0.50 at top_p = 0.5); a lower `sampling.temperature` is exact.

    Warns (log) when a bfloat16 setting runs on a CPU without native bfloat16
    (`step.native_cpu_bfloat16`): it is emulated, a train step about ten times slower than in float32.
    """
    from harnessrl.errors import ConfigError
    from harnessrl.log import check_sinks
    from harnessrl.train.step import native_cpu_bfloat16

    check_sinks(cfg.log.sinks)
    slow = [name for name, on in (("train.autocast", cfg.train.autocast == "bfloat16" and cfg.train.device == "cpu"),
                                  ("train.dtype", cfg.train.dtype == "bfloat16" and cfg.train.device == "cpu"),
                                  ("engine.dtype", cfg.engine.kind == "embedded" and cfg.engine.device == "cpu"
                                   and cfg.engine.dtype == "bfloat16")) if on]
    if slow and not native_cpu_bfloat16():
        log.warning("%s = \"bfloat16\" on a CPU without native bfloat16 (neither AVX512-BF16 nor AMX): "
                    "torch emulates it, a train step about ten times slower than in float32; use \"float32\" here",
                    " and ".join(slow))
    s = cfg.sampling
    if s.top_p < 1.0 or s.top_k > 0:
        raise ConfigError(
            f"sampling.top_p = {s.top_p} / sampling.top_k = {s.top_k}: training needs top_p = 1 and "
            f"top_k = 0 (the trainer computes logprobs under the full distribution at "
            f"sampling.temperature, not the truncated one the engine samples from); lower "
            f"sampling.temperature instead")


async def train(cfg: RunConfig, run_dir: Path, *, resume: bool = False, console: Console | None = None,
                ranks: Any = None) -> list[dict[str, Any]]:
    """The training loop; returns the per-step metrics it logged (with `train.eval_every`, a
    first entry with `step` 0 holds the held-out evaluation before any update).

    `ranks` (`distributed.Ranks`, rank 0 of several): the trainer operations run on every rank
    (`TrainerGroup`); None is one process.

    Raises:
        ConfigError: truncated sampling (`check_training`), or a task source too small for
            `train.eval_size` held-out tasks.
    """
    import torch

    from harnessrl.engine.model_store import load_tokenizer
    from harnessrl.log import make_sinks
    from harnessrl.rollout.orchestrator import Orchestrator
    from harnessrl.rollout.runner import RolloutLimits
    from harnessrl.rollout.summary import rollout_line
    from harnessrl.runtime import start_runtime
    from harnessrl.train.advantages import advantage_fn_for
    from harnessrl.train.console import bound_line, final_table, print_conversation, skip_reason, step_line
    from harnessrl.engine.weight_sync import make_weight_sync
    from harnessrl.train.distributed import SINGLE
    from harnessrl.train.policy import latest_checkpoint
    from harnessrl.train.dynamic_sampling import DynamicSampling
    from harnessrl.train.hooks import load_hooks
    from harnessrl.train.evaluation import evaluate_held_out, held_out_split
    from harnessrl.train.trainer_group import TrainerGroup

    check_training(cfg)
    console = console or Console(stderr=True)
    loop = asyncio.get_running_loop()
    trainer = ThreadPoolExecutor(1, thread_name_prefix="trainer",
                                 initializer=torch.set_num_threads, initargs=(cfg.train.num_threads,))
    group = TrainerGroup(cfg, ranks or SINGLE)
    history: list[dict[str, Any]] = []
    completed = False
    start_step, version, next_group_id, replay = 0, 0, 0, []
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if checkpoint is not None:
        saved = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))
        start_step, next_group_id = saved["step"], saved["next_group_id"]
        replay = list(saved.get("replay_group_ids", []))
    if resume:
        drop_lines_after_checkpoint(run_dir, start_step, next_group_id, replay)
    sinks = make_sinks(cfg.log.sinks, run_dir, cfg.model_dump(mode="json"), project=cfg.log.project,
                       table_rollouts=cfg.log.table_rollouts)
    from harnessrl.jsonl import repair_torn_tail

    repair_torn_tail(run_dir / "rollouts.jsonl")  # a torn line never fuses with the next record
    rollouts_fh = (run_dir / "rollouts.jsonl").open("a", encoding="utf-8")
    try:
        async with start_runtime(cfg, isolation="required", run_dir=run_dir) as rt:
            # 0) the policy (same weights the engine serves), optimizer, hooks, resume point
            # (KL penalty: the reference is the initial weights, frozen, kept by the group)
            await loop.run_in_executor(trainer, group.load, rt.model_dir)
            tokenizer = load_tokenizer(rt.model_dir)
            from harnessrl.doctor import quick_line

            log.info(quick_line(tokenizer, cfg.engine.model, getattr(rt.engine, "eos_token_ids", None)))
            advantage_fn = advantage_fn_for(cfg.train.advantage)
            hooks = load_hooks(cfg.hooks)
            sampling = DynamicSampling(cfg.train.dynamic_sampling_max_groups, hooks.get("rollout_reward_fn"),
                                       advantage_fn, cfg.train.max_staleness)
            sync = make_weight_sync(cfg.engine.kind, rt.engine, config=cfg, run_dir=run_dir, model_dir=rt.model_dir)
            if checkpoint is not None:
                state = await loop.run_in_executor(trainer, group.restore, checkpoint)
                version = state["policy_version"]
                await loop.run_in_executor(trainer, group.publish, sync, version)
                log.info("resumed from %s after step %d, policy version %d", checkpoint, start_step, version)
                if replay:
                    log.info("replaying groups %s: they were in flight, not yet trained on, when the "
                             "checkpoint was taken", replay)
                elif "replay_group_ids" not in state:
                    log.warning("this checkpoint does not list the groups in flight when it was taken: "
                                "they are not replayed (the run continues from group %d)", next_group_id)
            elif resume:
                log.warning("no checkpoint in %s: starting from step 1", run_dir / "checkpoints")

            limits = RolloutLimits(cfg.rollout.agent_timeout_s, cfg.rollout.verify_timeout_s)
            train_tasks, eval_tasks = rt.tasks, None
            if cfg.train.eval_every:
                train_tasks, eval_tasks = held_out_split(cfg.tasks, rt.tasks, cfg.train.eval_size)

            async def held_out(after_step: int) -> dict[str, float]:
                return await evaluate_held_out(
                    rt, eval_tasks, samples=cfg.train.eval_samples or cfg.rollout.group_size,
                    max_concurrent=cfg.rollout.max_concurrent_rollouts, limits=limits,
                    out_dir=run_dir / "eval" / f"step-{after_step}")

            orch = Orchestrator(
                train_tasks, rt.harness, rt.backend, rt.proxy, rt.verifier_for,
                group_size=cfg.rollout.group_size,
                max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts,
                limits=limits,
                first_group_id=next_group_id,
                replay_group_ids=replay,
                on_rollout=lambda r: log.info("rollout %d (group %d) %s", orch.rollouts_finished, r.group_id,
                                              rollout_line(r)),
                on_group=sampling.on_group,
                order=cfg.train.group_order,
            )
            sampling.bind(orch)
            groups_per_step = cfg.train.groups_per_step
            allowance = (cfg.train.max_staleness + 1) * groups_per_step  # groups granted ahead
            orch.allow(allowance)
            orch.start()
            nonfinite_skips = 0  # updates skipped for a NaN/inf gradient norm, this process
            if eval_tasks is not None and checkpoint is None:
                # before the first update (training rollouts of step 1 run meanwhile)
                before = {"step": 0, "policy_version": version, **await held_out(0)}
                history.append(before)
                for sink in sinks:
                    sink.log(0, before)
            try:
                # `step` is 1-based: the k-th training step; checkpoints/step-k holds the state after it
                for step in range(start_step + 1, cfg.train.steps + 1):
                    t_step = time.monotonic()
                    cpu_before = time.thread_time()  # this (the event loop's) thread: proxy, orchestrator
                    idle_before = orch.idle_seconds
                    engine_before = _engine_stats(rt.engine)
                    # 1) pull the groups of this step (rollouts for later steps keep running)
                    # (shaped by the reward hook as they completed; groups without signal replaced
                    # by dynamic sampling, when on)
                    groups = await _pull_groups(orch, groups_per_step, console, step, cfg.train.steps)
                    extra = await sampling.draw(groups, groups_per_step, version)
                    t_pulled = time.monotonic()

                    # 2) group-relative advantages from the (shaped) rewards
                    # 3) rows from traces, stamped with their rollout's advantage; stale rows dropped
                    rows, row_metrics, candidates = _rows_for_step(groups, cfg, hooks, advantage_fn, version)
                    if step == start_step + 1 and checkpoint is None:
                        # step-0 check: trainer and sampler hold the same weights now
                        parity = await loop.run_in_executor(trainer, group.parity, candidates)
                        if parity is not None:
                            row_metrics["step0/ratio_abs_dev"] = parity
                            mark = "ok" if parity <= 1e-3 else "ABOVE 1e-3"
                            log.info("step-0 check: mean |exp(trainer - sampler logprob) - 1| = %.2e (%s)",
                                     parity, mark)

                    # 4) one optimizer step on the trainer thread, while rollouts continue
                    metrics: dict[str, Any] = {"step": step, **row_metrics}
                    if cfg.train.dynamic_sampling_max_groups:
                        metrics["groups_drawn_extra"] = float(extra)
                    if rows:
                        result = await loop.run_in_executor(trainer, group.step, rows, step)
                        metrics.update(result.metrics)
                    else:
                        metrics["skipped"] = 1.0
                    if metrics.get("skipped") and "skip_reason" not in metrics:
                        metrics["skip_reason"] = skip_reason(metrics) if not rows else "no trainable token"
                    nonfinite_skips += int(metrics.get("skipped_nonfinite", 0))
                    metrics["skipped_nonfinite_steps"] = float(nonfinite_skips)
                    t_trained = time.monotonic()

                    # 5) weight sync: the engine serves the new policy from its next decode step
                    updated = bool(rows) and not metrics.get("skipped")
                    if updated:
                        version += 1
                        # blocks (on the trainer thread) until the engine serves them (WeightSync)
                        report = await loop.run_in_executor(trainer, group.publish, sync, version)
                        metrics.update(report.as_metrics())
                    t_synced = time.monotonic()
                    # the engine serves the new version: the groups of a later step may start now
                    # (none after the last step: they would only be cancelled); topped up to the
                    # allowance, so a replacement left over by dynamic sampling takes a new one's place
                    if step < cfg.train.steps:
                        orch.allow(allowance + sampling.pending_replacements - orch.groups_outstanding)
                    norm_every = cfg.log.update_norm_every
                    if updated and norm_every and version % norm_every == 0:
                        # how far the update moved the weights, once the engine has them (the
                        # rollouts already running overlap it)
                        metrics["param_delta_l2"] = await loop.run_in_executor(trainer, group.update_norm)
                        metrics["time/update_norm_s"] = time.monotonic() - t_synced
                    if eval_tasks is not None and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                        metrics.update(await held_out(step))  # the policy after this step

                    # 6) the step completed: its rollouts, metrics, console lines, checkpoint
                    metrics.update({
                        "policy_version": version,
                        "time/rollout_wait_s": t_pulled - t_step,
                        "time/train_s": t_trained - t_pulled,
                        "time/sync_s": t_synced - t_trained,
                        "time/step_s": t_synced - t_step,
                        # the generation side's wait: no rollout running (nothing for the engine)
                        "time/rollouts_idle_s": orch.idle_seconds - idle_before,
                        # CPU of the event loop's thread: the proxy's HTTP, render and parse, the
                        # orchestrator and sandbox management (the trainer and the engine have their own)
                        "time/loop_cpu_s": time.thread_time() - cpu_before,
                        "rollouts_in_flight_groups": orch.groups_in_flight,
                    })
                    engine_now = _engine_stats(rt.engine)  # prefix cache and batching, this step
                    if engine_now is not None:
                        metrics.update(engine_now.step_metrics(engine_before))
                        # over the same span as the counters (from the step's start to now)
                        metrics["engine/busy_frac"] = metrics["engine/busy_seconds"] / max(time.monotonic() - t_step, 1e-9)
                    for g in groups:
                        for r in g.rollouts:
                            # the verifier's reward and the training reward (when shaped), both
                            rollouts_fh.write(r.model_dump_json() + "\n")
                    rollouts_fh.flush()
                    history.append(metrics)
                    for sink in sinks:
                        sink.log(step, metrics)
                    log.info(step_line(step, cfg.train.steps, metrics))
                    for r in [r for g in groups for r in g.rollouts][: cfg.log.log_completions]:
                        print_conversation(console, r)
                    every = cfg.train.checkpoint_every
                    if step == cfg.train.steps or (every and step % every == 0):
                        # data position: the next new group, and the groups dispatched but not
                        # trained on yet (a resumed run replays them)
                        state = {"step": step, "policy_version": version,
                                 "next_group_id": orch.next_group_id,
                                 "replay_group_ids": orch.undelivered_group_ids()}
                        await _finish_even_if_stopped(loop.run_in_executor(
                            trainer, group.save, tokenizer, run_dir / "checkpoints" / f"step-{step}", state))
                        log.info("checkpoint %s", run_dir / "checkpoints" / f"step-{step}")
            finally:
                await orch.close()
        Console().print(final_table(history))
        Console().print(bound_line(history), markup=False, highlight=False)
        from harnessrl.train.plot import curve_table, write_curve_png

        curve = write_curve_png(history, run_dir / "curve.png", tasks_per_step=cfg.train.groups_per_step,
                                title=f"harnessrl train: {cfg.harness.kind} on {cfg.tasks.kind} ({cfg.engine.model})")
        Console().print(curve_table(history), markup=False, highlight=False)
        if curve is not None:
            Console().print(f"curve: {curve}", markup=False, highlight=False)
        completed = True
        return history
    finally:
        rollouts_fh.close()
        for sink in sinks:
            sink.close()
        if group.ranks.distributed:
            # release the other ranks; after a signal or an error the trainer thread may be
            # stuck in a collective with ranks already gone: do not wait long for it
            stopped = trainer.submit(group.stop)
            from concurrent.futures import wait as wait_futures

            wait_futures([stopped], timeout=None if completed else 10.0)
        # stopped by a signal: do not wait for a step still running on the trainer thread (its
        # result is discarded; `harnessrl train` exits without joining it)
        trainer.shutdown(wait=completed, cancel_futures=True)


def _engine_stats(engine: object) -> Any:
    """The engine's counters snapshot when it keeps them (`EmbeddedEngine.stats()`, which has
    `step_metrics`), else None."""
    stats = getattr(engine, "stats", None)
    snapshot = stats() if callable(stats) else None
    return snapshot if callable(getattr(snapshot, "step_metrics", None)) else None


async def _finish_even_if_stopped(work: asyncio.Future[Any]) -> Any:
    """Await `work` to its end even when the caller is cancelled meanwhile (then re-raise the
    cancellation): a checkpoint being written is finished, never left half-made."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await work
        raise


async def _pull_groups(orch: Any, n: int, console: Console, step: int, steps: int) -> list[Group]:
    """Wait for `n` completed groups: a live status line on a terminal, a progress record every
    `PROGRESS_EVERY_S` seconds otherwise (and in `run.log`)."""
    groups: list[Group] = []
    last_record = time.monotonic()

    def progress() -> str:
        return (f"step {step}/{steps}: {len(groups)}/{n} groups ready; rollouts {orch.rollouts_finished} "
                f"finished, {orch.rollouts_running} running")

    def on_wait() -> None:
        nonlocal last_record
        status.update(progress())
        if not console.is_terminal and time.monotonic() - last_record >= PROGRESS_EVERY_S:
            last_record = time.monotonic()
            log.info(progress())

    with console.status("") as status:
        while len(groups) < n:
            groups.append(await orch.get_group(on_wait=on_wait))
    return groups


def _rows_for_step(
    groups: list[Group], cfg: RunConfig, hooks: dict[str, Any], advantage_fn: Any, version: int
) -> tuple[list[Row], dict[str, float], list[Row]]:
    """Rewards → advantages → rows for the groups of one step (already shaped by the reward
    hook, `hooks.shape_group`), plus their metrics and every row built (before unscored,
    zero-variance and stale rows were dropped)."""
    from harnessrl.rollout.summary import summarize_groups
    from harnessrl.train.advantages import stamp_advantage
    from harnessrl.train.checks import untraceable_trained_tokens
    from harnessrl.train.hooks import training_reward
    from harnessrl.train.samples import MergeStats, build_rows

    rows: list[Row] = []
    built_all: list[Row] = []
    stats = MergeStats()
    counts: Counter[str] = Counter()
    staleness: list[int] = []
    for group in groups:
        rollouts = group.rollouts
        adv = advantage_fn([training_reward(r) for r in rollouts])
        if adv.zero_variance:
            counts["groups_zero_variance"] += 1
        for rollout, advantage in zip(rollouts, adv.advantages_G):
            built, s = build_rows(
                rollout, train_turn_fn=hooks.get("train_turn_fn"), agent_turn_fn=hooks.get("agent_turn_fn"),
                train_auxiliary=cfg.train.train_auxiliary)
            stats = stats.merge(s)
            built_all.extend(built)
            if advantage is None:
                counts["rows_unscored_dropped"] += len(built)
                continue
            if adv.zero_variance:
                counts["rows_zero_variance_dropped"] += len(built)
                continue
            for row in stamp_advantage(built, advantage):
                oldest = min(v for v, m in zip(row.policy_versions, row.completion_mask) if m)
                if version - oldest > cfg.train.max_staleness:
                    counts["rows_stale_dropped"] += 1
                    continue
                staleness.append(version - oldest)
                rows.append(row)
    metrics: dict[str, float] = {k: float(v) for k, v in counts.items()}
    metrics.setdefault("rows_stale_dropped", 0.0)
    summary = summarize_groups(groups)
    for key in ("reward/verifier_mean", "reward/verifier_std", "reward/train_mean", "reward/train_std",
                "pass_rate", "scored", "errors", "error_rate", "turns_mean", "turns_passing_mean",
                "prompt_tokens", "completion_tokens", "agent_s_mean", "sandbox_s_mean", "verify_s_mean"):
        if key in summary:
            metrics[key] = summary[key]
    metrics.update({k: v for k, v in summary.items() if k.startswith(("status/", "pass@"))})
    metrics.update(stats.as_metrics())
    metrics["untrained_sampled_tokens"] = float(stats.untrained_sampled_tokens)
    metrics["rows"] = float(len(rows))
    metrics["rows_built"] = float(len(built_all))
    metrics["staleness_mean"] = sum(staleness) / len(staleness) if staleness else math.nan
    metrics["staleness_max"] = float(max(staleness)) if staleness else math.nan
    metrics["invariant/untraceable_trained_tokens"] = float(
        untraceable_trained_tokens(rows, [r for g in groups for r in g.rollouts]))
    return rows, metrics, built_all

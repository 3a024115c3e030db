"""`harnessrl train`: the process around a training run.

Responsibility: check the config (`preflight.check_start`) before the run
directory is made or an earlier run in it moved aside, start the trainer's processes
(`train/distributed.py`), set up logging and `config.toml`, open the run and train it (`run`: `setup.open_run`, then `loop.train`) on
uvloop when installed (the agents' listener runs inside this process) until it completes or a
signal stops it, and turn that into the exit code.

Several processes (`torchrun` / `accelerate launch`): rank 0 runs the loop and owns the runtime
(proxy, engine, orchestrator, files, console); every trainer operation (load, step, parity
check, weight export, checkpoint, restore) goes through a `TrainerGroup`, which runs it on
every rank that must take part; the other ranks only train (`_follow`) and leave when rank 0
stops them. They keep the default action of SIGINT / SIGTERM (they hold nothing to release),
so a launcher forwarding Ctrl-C ends them at once while rank 0 stops cleanly.

Shutdown (completion, Ctrl-C, SIGTERM, error): stop dispatch, cancel in-flight rollouts (each
kills its agent, closes its sandbox and revokes its key), stop the proxy and the engine, flush
files (`train/setup.open_run`, `Orchestrator.close`, `harnessrl.signals`). A signal cancels the
step in progress: nothing of it is written, a checkpoint being written is finished, and the
trainer thread is not joined. Resume replays the groups the checkpoint had dispatched but not
trained on, and drops the lines logged after the checkpoint (that work is redone).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from harnessrl.config import RunConfig, dump_config, trainer_settings
from harnessrl.log import setup_logging
from harnessrl.preflight import check_start
from harnessrl.proxy.server import run_loop
from harnessrl.runtime import Prepared
from harnessrl.signals import RunStopped, run_until_signal
from harnessrl.train.distributed import Ranks, close_ranks, init_ranks
from harnessrl.train.loop import StepMetrics, train
from harnessrl.train.policy import latest_checkpoint
from harnessrl.train.setup import open_run, retain_freed_memory
from harnessrl.train.trainer_group import TrainerGroup

log = logging.getLogger(__name__)


RUN_FILES = ("config.toml", "run.log", "metrics.jsonl", "rollouts.jsonl", "curve.png", "checkpoints", "eval",
             "tensorboard", "wandb")
"""What a training run writes into its directory (`set_aside_earlier_run` moves these)."""


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """Before a new (not resumed) run in `run_dir`: move what an earlier run wrote there
    (`RUN_FILES`) into a sibling directory named after it and the time of its last write
    (`runs/default` -> `runs/default.20261206-163105`, `-2` and on if taken), so the new run's
    `metrics.jsonl` and `rollouts.jsonl` do not continue the old ones and a later `--resume`
    cannot pick an old checkpoint, and nothing is lost. Other files in `run_dir` stay. Returns
    the sibling, or None when there was nothing to move."""
    found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in found)))
    target = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}")
    target.mkdir(parents=True)
    for path in found:
        path.rename(target / path.name)
    return target


async def run(cfg: RunConfig, run_dir: Path, *, resume: bool = False, console: Console | None = None,
              ranks: Ranks | None = None, prepared: Prepared | None = None) -> list[StepMetrics]:
    """Open the run of `cfg` in `run_dir` and train it (`open_run`, then `train`); returns the
    per-step metrics. `prepared`: `open_run`'s.

    Raises:
        ConfigError: from `open_run`.
    """
    async with open_run(cfg, run_dir, resume=resume, console=console, ranks=ranks,
                        prepared=prepared) as training_run:
        return await train(training_run)


def run_training(cfg: RunConfig, run_dir: Path, resume: bool = False, *, prepared: Prepared | None = None) -> int:
    """Train per `cfg` in `run_dir`; returns the process exit code: 0 when every step ran, 130 /
    143 when SIGINT / SIGTERM stopped the run (`harnessrl.signals`; the step in progress then
    leaves no rollouts, metrics or checkpoint behind, earlier checkpoints stay). A rank other
    than 0 does not return: it exits the process with its code (`_end_follower`).

    Every check that needs no model (`preflight.check_start`: dotted paths, sinks, sampling,
    the task source and its verifier, the model's name, isolation) runs before the run
    directory is made or an earlier run in it moved aside; `prepared` is what they built when the
    caller (`harnessrl train`) ran them already.

    Raises:
        ConfigError, TaskError, ModelLoadError, SandboxError: from `preflight.check_start`,
            before anything in `run_dir` is touched.
    """
    if prepared is None:
        prepared = check_start(cfg, isolation="required", training=True)
    ranks = init_ranks(cfg.train.device, cfg.train.strategy)
    if not ranks.is_main:
        try:
            code = _follow(cfg, ranks)
        finally:
            close_ranks(ranks)
        _end_follower(code)
    earlier = None if resume else set_aside_earlier_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    setup_logging(cfg.log.level, run_dir / "run.log", console=console)
    if earlier is not None:
        log.info("%s held an earlier run: moved to %s (train --resume continues a run instead)", run_dir, earlier)
    if not resume:
        (run_dir / "config.toml").write_text(dump_config(cfg), encoding="utf-8")
    log.info("harnessrl train -> %s (model %s, harness %s, tasks %s, G=%d, %d steps)", run_dir,
             cfg.engine.model, cfg.harness.kind, cfg.tasks.kind, cfg.rollout.group_size, cfg.train.steps)
    if ranks.distributed:
        log.info("trainer on %d ranks (%s, %s, %s); this is rank 0", ranks.world_size, ranks.strategy,
                 ranks.device, cfg.train.dtype)
    try:
        # uvloop when installed: the agents' listener runs inside this process
        run_loop(run_until_signal(run(cfg, run_dir, resume=resume, console=console, ranks=ranks,
                                      prepared=prepared)))
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


def _end_follower(code: int) -> NoReturn:
    """End a rank other than 0 once it has left the process group: flush, then `os._exit`
    without the interpreter's teardown. A follower holds no file or process of the run by now
    (rank 0 writes them); in the teardown, one of a torchrun rank's native threads was once
    destroyed while still joinable ("terminate called without an active exception", SIGABRT,
    exit -6 after a run that had finished and checkpointed; `tests/test_distributed_train.py`
    under load), which failed a run that had done everything."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _follow(cfg: RunConfig, ranks: Ranks) -> int:
    """A rank other than 0: load the policy and run rank 0's trainer operations until it says
    stop (`TrainerGroup.follow`). Returns 0, or 1 when rank 0 went away without stopping it."""
    import torch  # lazy: torch, heavy; not needed at import

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # nothing to release here: end at once
    logging.basicConfig(level=logging.WARNING, format=f"rank {ranks.rank}: %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.train.num_threads)
    retain_freed_memory(cfg.train.device)  # as rank 0's `open_run`: a step reuses the last step's pages
    try:
        TrainerGroup(trainer_settings(cfg), ranks).follow()
    except RuntimeError as exc:  # gloo / NCCL: rank 0's connection closed (or this rank failed)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.error("trainer rank %d stopped before rank 0 released it (rank 0 gone?): %s", ranks.rank, first)
        return 1
    return 0

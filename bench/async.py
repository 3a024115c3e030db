"""Async vs synchronous training: wall time of the same N-step run, in one process.

Runs `harnessrl train` twice on the same config: once with `train.max_staleness = 0` (rollouts
and training in turn) and once at the default `max_staleness` (2: rollouts for steps k+1 and
k+2 run while step k trains), each with the default `rollout.max_concurrent_rollouts` (0: every
rollout training grants ahead, `(max_staleness + 1) x groups_per_step x group_size`, so one
step's in the synchronous run and three steps' in the asynchronous one). Both use the same thread split (engine 1 torch thread, trainer 1 torch thread), so on a
2-core machine the async run overlaps generation on one core and training on the other.

What it reports, per run, from the metrics every run logs in `metrics.jsonl`:
  * the wall time of the steps (first step's start to last step's end: the same steps, same
    work; runtime start-up, the same in both runs, is printed apart) and of the whole call;
  * where each side waited, as means per step: `time/rollout_wait_s` (the trainer waiting for
    rollouts), `time/train_s`, `time/sync_s` (the weight sync), and `time/rollouts_idle_s`
    (no rollout running: nothing for the engine to do, the generation side's wait); the
    engine's mean decode batch and prefix-cache hit fraction (`engine/*`).
From the synchronous run, where the two sides never overlap, it takes generation g (its
rollout wait per step), training t and sync s, and prints the best the async loop can do on
the same steps, `g + (N-1) max(g, t+s) + t + s` (a pipeline of N steps at the synchronous
run's generation time), and the ceiling ratio it gives: `2N / (N+1)` when g = t + s, lower when
the sides are unbalanced; the asynchronous run can pass it only because its larger decode
batches make generation itself cheaper per rollout. Then the asynchronous run's waits for late
groups (`train/console.late_groups`: steps after the first whose groups outlasted generation's
lead of `max_staleness` steps), which the ceiling does not count. Target: >= 1.8x at the
defaults. The async run takes groups in dispatch order
(`train.group_order`), so none is overtaken and dropped as stale and both runs train the same
work; `--max-staleness 1` and `--concurrency 8` measure the defaults before (1.3x). An untimed 1-step run
goes first: without it whichever timed run came first trained ~1.5x slower per step (measured both orders: 2.03x
sync-first, 0.95x async-first on the same workload), so `--order` is there to check it.

Workload (chosen so that both sides take comparable time per step on the CPU default, and
every group trains: a deterministic alternating reward; by default 20 steps with the trainer at
the config's `train.autocast` (off: float32); on the 2-core CPU default training + sync took
about as long as generation (2.6 + 0.45 s against 3.2 s a step, 2026-12-06), a ceiling of ~1.9x,
until the engine computed a group's identical prompts once: generation then took 2.7 s against
3.1 s, and the ceiling fell to ~1.8x (the synchronous run gains the most from cheaper
generation, the trainer-bound asynchronous run less); `--autocast bfloat16` makes the training side ~1.4x cheaper, so generation bounds the
asynchronous run and the ceiling falls to ~1.65x): white-box single-reply rollouts of
the procedural `compare` / `add` tasks, `--group-size` x `--groups-per-step` rollouts a step,
replies up to `--max-tokens`, at most `--concurrency` rollouts at once (default: the config's).

    .venv/bin/python bench/async.py                                     # ~6 min
    .venv/bin/python bench/async.py --max-staleness 1 --concurrency 8   # the defaults before
    .venv/bin/python bench/async.py --autocast bfloat16                 # generation-bound: ceiling ~1.65x
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harnessrl.config import TrainConfig, load_config  # noqa: E402 - after the offline switch
from harnessrl.train.console import late_groups  # noqa: E402


def run_once(overrides: list[str], max_staleness: int, steps: int) -> tuple[float, list[dict]]:
    from harnessrl.train.run import run as train

    cfg = load_config(None, [*overrides, f"train.max_staleness={max_staleness}", f"train.steps={steps}"])
    run_dir = Path(tempfile.mkdtemp(prefix=f"harnessrl-async-s{max_staleness}-"))
    t0 = time.monotonic()
    try:
        history = asyncio.run(train(cfg, run_dir))
    finally:  # the final checkpoint (~1.6 GB on the 135M model) is not needed: keep the metrics
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    print(f"  run dir {run_dir} (metrics.jsonl; checkpoints removed)", flush=True)
    return time.monotonic() - t0, history


def mean(hist: list[dict], key: str) -> float:
    values = [m[key] for m in hist if key in m]
    return sum(values) / len(values) if values else 0.0


def describe(name: str, wall: float, hist: list[dict]) -> tuple[float, str]:
    """The steps' wall time, and one line of where the run's steps waited."""
    steps_wall = sum(m.get("time/step_s", 0.0) for m in hist)
    with_engine = [m for m in hist if m.get("engine/decode_steps")]
    batch = sum(m["engine/mean_batch_size"] for m in with_engine) / len(with_engine) if with_engine else 0.0
    prompt = sum(m.get("engine/prefill_tokens", 0.0) + m.get("engine/prefix_hit_tokens", 0.0) for m in hist)
    hit = sum(m.get("engine/prefix_hit_tokens", 0.0) for m in hist) / prompt if prompt else 0.0
    idle = sum(m.get("time/rollouts_idle_s", 0.0) for m in hist)
    line = (f"{name}: steps {steps_wall:.1f} s (whole call {wall:.1f} s, start-up {wall - steps_wall:.1f} s); "
            f"per step: trainer waits for rollouts {mean(hist, 'time/rollout_wait_s'):.1f} s, trains "
            f"{mean(hist, 'time/train_s'):.1f} s, syncs {mean(hist, 'time/sync_s'):.2f} s; no rollout running "
            f"{mean(hist, 'time/rollouts_idle_s'):.1f} s ({idle / steps_wall:.0%} of the steps); engine mean batch "
            f"{batch:.1f}, prefix hits {hit:.0%}; trained {mean(hist, 'tokens_trained'):.0f} of "
            f"{mean(hist, 'tokens_packed'):.0f} packed tokens a step, "
            f"{sum(m.get('rows_stale_dropped', 0.0) for m in hist):.0f} stale rows dropped")
    return steps_wall, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--harness", default="white_box")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=0,
                        help="rollout.max_concurrent_rollouts of both runs (0: the config's default, every "
                             "rollout training grants ahead)")
    parser.add_argument("--max-staleness", type=int, default=TrainConfig().max_staleness,
                        help="train.max_staleness of the async run (default: the config's)")
    parser.add_argument("--autocast", default=TrainConfig().autocast, choices=("off", "bfloat16"),
                        help="train.autocast of both runs (default: the config's, off: a float32 training side "
                             "about as long as generation; bfloat16: training ~1.4x cheaper, generation-bound, "
                             "ceiling ~1.65x)")
    parser.add_argument("--order", choices=("sync-first", "async-first"), default="sync-first")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the untimed 1-step run before the two timed ones")
    args = parser.parse_args()
    opts = "{tools = [], max_turns = 1}" if args.harness == "white_box" else "{step_limit = 2}"
    overrides = [
        f"engine.model={json.dumps(args.model)}", f"harness.kind={json.dumps(args.harness)}",
        f"harness.options={opts}", "tasks.kinds=[\"compare\", \"add\"]", "tasks.answer_via=\"reply\"",
        f"sampling.max_tokens={args.max_tokens}", f"rollout.group_size={args.group_size}",
        f"train.groups_per_step={args.groups_per_step}", "train.learning_rate=1e-6",
        *([f"rollout.max_concurrent_rollouts={args.concurrency}"] if args.concurrency else []),
        "engine.num_threads=1", "train.num_threads=1", f"train.autocast={json.dumps(args.autocast)}",
        # every group trains (no zero-variance skips), so both runs do the same work per step
        "hooks.rollout_reward_fn=\"harnessrl.recipes.shaping:alternating_smoke_reward\"",
    ]
    if args.warmup:  # the first run in a process is slower (start-up, allocator, kernels): not timed
        print("warm-up run (1 step, not timed) ...", flush=True)
        run_once(overrides, 0, 1)
    load_start = os.getloadavg()[0]
    runs: dict[int, tuple[float, list[dict]]] = {}
    a = args.max_staleness
    if a < 1:
        parser.error(f"--max-staleness {a}: the async run needs at least 1")
    for staleness in ((0, a) if args.order == "sync-first" else (a, 0)):
        print(f"running max_staleness={staleness} ...", flush=True)
        runs[staleness] = run_once(overrides, staleness, args.steps)
    sync_steps, sync_line = describe("synchronous (max_staleness=0)", *runs[0])
    async_steps, async_line = describe(f"asynchronous (max_staleness={a})", *runs[a])
    g, t, s = (mean(runs[0][1], k) for k in ("time/rollout_wait_s", "time/train_s", "time/sync_s"))
    n = args.steps
    best_async = g + (n - 1) * max(g, t + s) + t + s

    def in_flight(staleness: int) -> int:  # rollout.max_concurrent_rollouts as the run resolved it
        return load_config(None, [*overrides, f"train.max_staleness={staleness}"]).concurrent_rollouts

    print(f"workload: {args.harness}, {args.group_size} x {args.groups_per_step} rollouts a step, replies <= "
          f"{args.max_tokens} tokens, at most {in_flight(0)} (synchronous) / {in_flight(a)} (asynchronous) at once, "
          f"{n} steps, train.autocast {args.autocast}")
    print(f"load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (2 shared cores)")
    print(sync_line)
    print(async_line)
    print(f"balance (synchronous run): generation {g:.1f} s vs training + sync {t + s:.1f} s a step; best async "
          f"pipeline {best_async:.1f} s, ceiling {sync_steps / best_async:.2f}x")
    print(f"speed-up async vs sync: {sync_steps / async_steps:.2f}x on the steps' wall time "
          f"({runs[0][0] / runs[a][0]:.2f}x whole calls) over {n} steps (target >= 1.8x)")
    hist = runs[a][1]
    idle = sum(m.get("time/rollouts_idle_s", 0.0) for m in hist) / max(async_steps, 1e-9)
    stale = sum(m.get("rows_stale_dropped", 0.0) for m in hist)
    print(f"asynchronous run: {stale:.0f} stale rows dropped (target 0), no rollout running {idle:.0%} of the "
          f"steps (target <= 15%)")
    timed = [m for m in hist if "time/step_s" in m]
    if late := late_groups(timed[1:], async_steps, a):  # the waits the ceiling above does not count
        print(f"asynchronous run: {late}")


if __name__ == "__main__":
    main()

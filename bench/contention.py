"""The training step beside the engine's decode: what sharing the cores costs the trainer.

In the asynchronous loop the trainer's step runs on one core while the embedded engine decodes
on the other (`bench/async.py`: `engine.num_threads = 1`, `train.num_threads = 1`). This script
measures, in one process, the same training step (`train/step.optimizer_step` on SmolLM2-135M in
float32: `bench/packing.make_rows`, 2 groups x 4 rows of 50-80 ids sharing up to a 45-id
prompt, ~250 packed tokens, close to `bench/async.py`'s steps; malloc set as `harnessrl train` sets it,
`train/setup.retain_freed_memory`) in two arms, interleaved over `--rounds` rounds:
  * alone: nothing else runs;
  * beside decode: `--streams` request streams keep the engine decoding (40-id prompts, 64
    sampled ids each, one torch thread on its decode thread), as rollouts do in the loop.

Per arm it prints the median wall seconds of a step, the median CPU seconds of the trainer's
thread over it (`time.thread_time`), and the engine's decode steps per second. Every arm of a
round trains the same rows, so each beside-decode step is also compared with its alone twin
(the median of those ratios: the rows' lengths move a step's time by more than the arms
differ). Wall minus CPU is what the trainer's thread spent not running: waiting for the GIL
(the engine's decode loop and the trainer share one interpreter) or for a core. CPU beside
decode over CPU alone is what the shared hardware (caches, memory bandwidth) costs the same
work. With `--switch-intervals`, the beside-decode arm is repeated at each of those
`sys.setswitchinterval` values (seconds; Python's default is 0.005): a shorter interval hands
the GIL over sooner.

    .venv/bin/python bench/contention.py                                   # ~4 min
    .venv/bin/python bench/contention.py --switch-intervals 0.005,0.0005   # the GIL's part
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # bench/: the rows of bench/packing.py

import torch  # noqa: E402 - after the offline switch

from harnessrl.engine.embedded.engine import EmbeddedEngine  # noqa: E402
from harnessrl.engine.model_store import resolve_model  # noqa: E402
from harnessrl.loss.losses import loss_fn_for  # noqa: E402
from harnessrl.train.packing import pack_rows  # noqa: E402
from harnessrl.train.policy import load_policy  # noqa: E402
from harnessrl.train.setup import retain_freed_memory  # noqa: E402
from harnessrl.train.step import optimizer_step  # noqa: E402
from harnessrl.types import Row, Sampling  # noqa: E402
from packing import make_rows  # noqa: E402 - bench/packing.py


def step_rows(seed: int) -> list[Row]:
    """A step's rows (`bench/packing.make_rows`): 2 groups x 4 rows of 50-80 ids, each group's
    sharing its first 45 (the task prompt, as far as each row's context reaches), the last 30%
    of each row trained, advantages +-1."""
    return make_rows(8, 50, 80, 0.3, seed, group_size=4, prefix_len=45)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="training steps per arm and round")
    parser.add_argument("--streams", type=int, default=6, help="concurrent request streams beside the trainer")
    parser.add_argument("--switch-intervals", default="",
                        help="comma-separated sys.setswitchinterval values (s) for the beside-decode arm")
    args = parser.parse_args()
    intervals = [float(v) for v in args.switch_intervals.split(",") if v] or [sys.getswitchinterval()]
    default_interval = sys.getswitchinterval()
    retain_freed_memory("cpu")  # as `harnessrl train` sets the process (without it a step faults ~0.75 GB in)
    torch.set_num_threads(1)  # this (the trainer's) thread; the engine sets its own
    model_dir = resolve_model(args.model)
    policy = load_policy(model_dir, learning_rate=1e-6, weight_decay=0.0, lora_rank=0)
    loss_fn = loss_fn_for(None)
    engine = EmbeddedEngine(model_dir, num_threads=1)
    stop = threading.Event()

    def stream(k: int) -> None:
        rng = random.Random(k)
        while not stop.is_set():
            prompt = [rng.randrange(256, 4096) for _ in range(40)]
            engine.generate_blocking(prompt, Sampling(max_tokens=64, temperature=1.0, seed=rng.randrange(2**31)))

    def train_steps(seed: int) -> list[tuple[float, float]]:
        out = []
        for i in range(args.steps):
            rows = step_rows(seed * 100 + i)
            w0, c0 = time.perf_counter(), time.thread_time()
            optimizer_step(policy.trained, policy.optimizer, rows, loss_fn, temperature=1.0, token_budget=4096,
                           max_grad_norm=1.0, measure_update=False)
            out.append((time.perf_counter() - w0, time.thread_time() - c0))
        return out

    arms = ["alone", *(f"beside decode, switch interval {v:g} s" for v in intervals)]
    wall: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    rate: dict[str, list[float]] = {a: [] for a in arms}
    train_steps(0)  # warm-up: allocator, kernels, the optimizer's state
    load_start = os.getloadavg()[0]
    try:
        for rnd in range(args.rounds):
            for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:
                threads: list[threading.Thread] = []
                if arm != "alone":
                    sys.setswitchinterval(intervals[arms.index(arm) - 1])
                    stop.clear()
                    threads = [threading.Thread(target=stream, args=(rnd * 100 + j,), daemon=True)
                               for j in range(args.streams)]
                    for t in threads:
                        t.start()
                    time.sleep(1.0)  # the batch fills
                steps0, t0 = engine.stats().decode_steps, time.perf_counter()
                got = train_steps(rnd + 1)
                rate[arm].append((engine.stats().decode_steps - steps0) / (time.perf_counter() - t0))
                stop.set()
                for t in threads:
                    t.join()
                sys.setswitchinterval(default_interval)
                wall[arm] += [w for w, _ in got]
                cpu[arm] += [c for _, c in got]
                print(f"round {rnd + 1} {arm}: steps {', '.join(f'{w:.2f} s (CPU {c:.2f})' for w, c in got)}",
                      flush=True)
    finally:
        stop.set()
        engine.close()
    packed = sum(b.num_tokens for b in pack_rows(step_rows(1), token_budget=4096))
    print(f"\nSmolLM2-135M float32 training step (~{packed} packed tokens), 1 trainer thread; {args.streams} "
          f"streams of 64 sampled ids on the engine's 1 thread; "
          f"{args.rounds} rounds x {args.steps} steps, medians; load average {load_start:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end")
    for arm in arms:
        w, c = statistics.median(wall[arm]), statistics.median(cpu[arm])
        # the same rows trained in every arm of a round: compare step by step
        wall_x = statistics.median(a / b for a, b in zip(wall[arm], wall["alone"]))
        paired = "" if arm == "alone" else (
            f"; step by step against alone: wall {wall_x:.2f}x, "
            f"CPU {statistics.median(a / b for a, b in zip(cpu[arm], cpu['alone'])):.2f}x, slower in "
            f"{sum(a > b for a, b in zip(wall[arm], wall['alone']))} of {len(wall[arm])}")
        print(f"{arm}: wall {w:.2f} s, trainer thread CPU {c:.2f} s, not running {w - c:.2f} s; engine "
              f"{statistics.median(rate[arm]):.1f} decode steps/s{paired}")


if __name__ == "__main__":
    main()

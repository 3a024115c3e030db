"""Async vs synchronous training: wall time of the same N-step run, in one process.

Runs `harnessrl train` twice on the same config: once with `train.max_staleness = 1` (rollouts
for step k+1 run while step k trains) and once with `max_staleness = 0` (rollouts and training in
turn). Both use the same thread split (engine 1 torch thread, trainer 1 torch thread), so on a
2-core machine the async run overlaps generation and training on the two cores. Prints both wall
times, the speed-up ratio, the load average, and where each run's steps waited (sums over steps
of the metrics every run logs: `time/rollout_wait_s` the trainer waiting for rollouts,
`time/train_s`, `time/sync_s` the weight sync; and the engine's mean decode batch and prefix-cache
hit fraction, `engine/*`). Target: >= 1.8x.

    .venv/bin/python bench/async.py --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_once(overrides: list[str], max_staleness: int, steps: int) -> tuple[float, list[dict]]:
    from harnessrl.config import load_config
    from harnessrl.train.run import train

    cfg = load_config(None, [*overrides, f"train.max_staleness={max_staleness}", f"train.steps={steps}"])
    run_dir = Path(tempfile.mkdtemp(prefix=f"harnessrl-async-s{max_staleness}-"))
    t0 = time.monotonic()
    history = asyncio.run(train(cfg, run_dir))
    return time.monotonic() - t0, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--harness", default="white_box")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    opts = "{tools = [], max_turns = 1}" if args.harness == "white_box" else "{step_limit = 2}"
    overrides = [
        f"engine.model={json.dumps(args.model)}", f"harness.kind={json.dumps(args.harness)}",
        f"harness.options={opts}", "tasks.kinds=[\"compare\", \"add\"]", "tasks.answer_via=\"reply\"",
        f"sampling.max_tokens={args.max_tokens}", f"rollout.group_size={args.group_size}",
        f"rollout.max_concurrent_rollouts={2 * args.group_size * args.groups_per_step}",
        f"train.groups_per_step={args.groups_per_step}", "train.learning_rate=1e-6",
        # every group trains (no zero-variance skips), so both runs do the same work per step
        "hooks.rollout_reward_fn=\"harnessrl.recipes.shaping:alternating_smoke_reward\"",
    ]
    sync_s, sync_hist = run_once(overrides, 0, args.steps)
    async_s, async_hist = run_once(overrides, 1, args.steps)

    def split(hist: list[dict]) -> str:
        def total(key: str) -> float:
            return sum(m.get(key, 0.0) for m in hist)

        steps = [m for m in hist if m.get("engine/decode_steps")]
        batch = sum(m["engine/mean_batch_size"] for m in steps) / len(steps) if steps else 0.0
        prompt = total("engine/prefill_tokens") + total("engine/prefix_hit_tokens")
        hit = total("engine/prefix_hit_tokens") / prompt if prompt else 0.0
        return (f"waiting for rollouts {total('time/rollout_wait_s'):.1f} s, training {total('time/train_s'):.1f} s, "
                f"weight sync {total('time/sync_s'):.1f} s; engine mean batch {batch:.1f}, prefix hits {hit:.0%}")

    print(f"load average {os.getloadavg()[0]:.1f} (2 shared cores)")
    print(f"synchronous (max_staleness=0): {sync_s:.1f} s  [{split(sync_hist)}]")
    print(f"asynchronous (max_staleness=1): {async_s:.1f} s  [{split(async_hist)}]")
    print(f"speed-up async vs sync: {sync_s / async_s:.2f}x over {args.steps} steps (target >= 1.8x)")


if __name__ == "__main__":
    main()

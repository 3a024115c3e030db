"""Trainer tokens/s at N gloo ranks on the same synthetic rows.

Each rank loads the tiny random Llama with the SmolLM2 tokenizer (`tiny-random`, the tests'
model: 2 layers, hidden 64, tied 49152-id embeddings) or `--model`, float32 on CPU, one torch
thread per rank (`--threads`), and runs `--steps` optimizer steps of `train/step.optimizer_step`
on the same `--rows` rows (lengths uniform in [`--min-len`, `--max-len`], seeded, the last
third of each trained), split across ranks by tokens, PPO-clip, AdamW. One warm-up step is not
timed. `tokens_per_s` counts the rows' tokens (all ranks together) per second of the timed
steps on rank 0, the same count at every N, so runs at different N compare directly.

Printed: one JSON line `{"ranks": N, "tokens_per_s": ..., "seconds": ..., "steps": S, "tokens": T,
"strategy": ..., "rank_cpu_s": [...]}` (rank 0); `rank_cpu_s` is each rank's CPU seconds over the
timed steps (all its threads), which shows the work spreading even when other jobs load the cores. With `--ranks N > 1` the script starts N processes itself
(`torch.multiprocessing`, gloo on loopback); under `torchrun` it uses the launcher's ranks.

Run: `.venv/bin/python bench/scale_trainer.py --ranks 2 --steps 3` (about a minute at 2 ranks on
2 shared cores). On 2 cores the gain is bounded by the second core; the point is that the step
spreads over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

import torch

from harnessrl.types import Row


def make_rows(n: int, min_len: int, max_len: int, seed: int = 0) -> list[Row]:
    """`n` rows with seeded lengths in [min_len, max_len], the last third trained (logprob -3)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        ctx = length - length // 3
        ids = tuple(rng.randrange(100, 40000) for _ in range(length))
        rows.append(Row(ids, tuple([0] * ctx + [1] * (length - ctx)), tuple([0.0] * ctx + [-3.0] * (length - ctx)),
                        tuple([-1] * ctx + [0] * (length - ctx)), f"r{i}", i // 4, 1.0 if i % 2 else -1.0))
    return rows


def run(args: argparse.Namespace) -> dict | None:
    """Train on this rank; rank 0 returns the result line, other ranks None."""
    from harnessrl.engine.model_store import TINY_MODEL, resolve_model
    from harnessrl.train.distributed import all_reduce, close_ranks, gather_objects, init_ranks
    from harnessrl.loss.losses import loss_fn_for
    from harnessrl.train.policy import load_policy
    from harnessrl.train.step import optimizer_step

    torch.set_num_threads(args.threads)
    ranks = init_ranks("cpu", args.strategy)
    try:
        model_dir = Path(args.model) if args.model else resolve_model(TINY_MODEL)
        policy = load_policy(model_dir, learning_rate=1e-5, weight_decay=0.0, lora_rank=0, ranks=ranks)
        rows = make_rows(args.rows, args.min_len, args.max_len)
        fn = loss_fn_for("ppo_clip")

        def step() -> None:
            optimizer_step(policy.trained, policy.optimizer, rows, fn, temperature=1.0,
                           token_budget=args.token_budget, max_grad_norm=1.0, ranks=ranks)

        step()  # warm-up
        all_reduce([0.0], ranks)  # every rank starts the timed steps together
        t0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        cpu_s = time.process_time() - cpu0
        all_reduce([0.0], ranks)
        seconds = time.perf_counter() - t0
        rank_cpu_s = gather_objects(round(cpu_s, 2), ranks)
        tokens = args.steps * sum(len(r.input_ids) for r in rows)
        if not ranks.is_main:
            return None
        return {"ranks": ranks.world_size, "tokens_per_s": tokens / seconds, "seconds": seconds,
                "steps": args.steps, "tokens": tokens, "strategy": args.strategy, "rank_cpu_s": rank_cpu_s}
    finally:
        close_ranks(ranks)


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1")
    result = run(args)
    if result is not None:
        print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1, help="processes (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny random model)")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 1:
        p.error(f"--ranks {args.ranks} and --steps {args.steps} must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "WORLD_SIZE" in os.environ or args.ranks == 1:
        result = run(args)
        if result is not None:
            print(json.dumps(result), flush=True)
        return 0
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.ranks, port, args), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One session flooding the embedded engine: how long a sibling session's small call waits, and
how many ids the engine decodes for the flooding session after it is closed.

Workload (issue 47): the attacker session sends `--calls` (64) concurrent calls, each a distinct
prompt of `--prompt-tokens` (1,750) ids and up to `--max-tokens` (64) new ids, greedy; once the
engine is busy with them (`--head-start-s`, 2 s), a sibling session sends a 4-id prompt for 4
new ids. Reported: the sibling's latency, how many of the attacker's calls had finished by then,
and, after `engine.forget(attacker)` (what closing the attacker's session does), the ids the
engine decoded for the attacker afterwards (the `generated_tokens` counter over `--settle-s`).
Repeated `--repeats` (3) times on a fresh engine each; every run's figures are printed.

The engine is built as a run builds it (`engine.max_batch_size` 16; `max_rows_per_session`
4 unless `--rows-per-session` says otherwise). Run from another checkout's `src` to measure
older code: the script passes `affinity` to `generate` (which older engines ignore) and calls
`forget`, and reads `max_rows_per_session` only when the engine takes it.

    python bench/fairness.py                       # SmolLM2-135M, 1 thread
    python bench/fairness.py --model tiny-random --calls 16 --prompt-tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
from typing import Any

import torch

from harnessrl.engine.embedded.engine import EmbeddedEngine
from harnessrl.engine.model_store import resolve_model
from harnessrl.errors import EngineError
from harnessrl.types import Sampling


async def one_run(args: argparse.Namespace) -> dict[str, float]:
    kwargs: dict[str, Any] = {"num_threads": args.threads, "max_batch_size": args.batch, "seed": 0}
    if "max_rows_per_session" in inspect.signature(EmbeddedEngine.__init__).parameters:
        kwargs["max_rows_per_session"] = args.rows_per_session
    engine = EmbeddedEngine(resolve_model(args.model), **kwargs)
    greedy = Sampling(temperature=0.0, max_tokens=args.max_tokens)
    finished: list[float] = []

    async def attacker_call(i: int) -> None:
        prompt = [1000 + (i * 7919 + j * 31) % 40000 for j in range(args.prompt_tokens)]
        try:
            await engine.generate(prompt, greedy, affinity="attacker")
            finished.append(time.perf_counter())
        except EngineError:
            pass  # cancelled by forget

    try:
        calls = [asyncio.create_task(attacker_call(i)) for i in range(args.calls)]
        await asyncio.sleep(args.head_start_s)
        t0 = time.perf_counter()
        await engine.generate([5, 6, 7, 8], Sampling(temperature=0.0, max_tokens=4), affinity="sibling")
        sibling_s = time.perf_counter() - t0
        done_before = sum(1 for t in finished if t <= t0 + sibling_s)
        engine.forget("attacker")
        at_close = engine.stats().generated_tokens
        await asyncio.sleep(args.settle_s)
        after_close = engine.stats().generated_tokens - at_close
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        return {"sibling_s": sibling_s, "attacker_done_before": float(done_before),
                "decoded_after_close": float(after_close)}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1750)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rows-per-session", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head-start-s", type=float, default=2.0)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = [asyncio.run(one_run(args)) for _ in range(args.repeats)]
    for k, r in enumerate(runs, start=1):
        print(f"run {k}: sibling {r['sibling_s']:.2f} s, attacker calls finished before it "
              f"{int(r['attacker_done_before'])}/{args.calls}, ids decoded after close {int(r['decoded_after_close'])}")
    print(f"median sibling latency {statistics.median(r['sibling_s'] for r in runs):.2f} s over {args.repeats} runs")


if __name__ == "__main__":
    main()

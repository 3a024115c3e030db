"""Throughput of the samples builder (`build_rows`) on synthetic multi-turn agent traces.

Each synthetic rollout has `--turns` turns (default 20): a 600-token system prompt and task,
then per turn a 100-400-token completion and a 250-650-token tool result, so prompts grow to
~12k tokens. Every 7th turn re-renders the end of the previous answer (a FORK: a REALIGN would untrain sampled tokens), one turn per
rollout rewrites history after the system prompt (FORK), and one title call runs in parallel
with turn 1 (auxiliary). Token ids are random.

Tokens counted: input trace tokens, i.e. sum over turns of `len(prompt_ids) +
len(completion_ids)` (what the builder has to read); output row tokens are printed too.
The time covers `build_rows` only (trace construction is outside the timer). For reference it
also times the same build with a per-token Python loop for the prefix comparison, in the same
run, and prints the ratio.

Run: `.venv/bin/python bench/samples.py [--rollouts 32] [--turns 20]`. Target: >= 5 M tokens/s.
"""

from __future__ import annotations

import argparse
import random
import time

from harnessrl.train import samples
from harnessrl.train.samples import MergeStats, build_rows
from harnessrl.types import Rollout, Trace, Turn


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49_000) for _ in range(n)]


def _turn(index: int, prompt: list[int], completion: list[int]) -> Turn:
    return Turn(
        turn_index=index,
        request={},
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[-0.25] * len(completion),
        policy_version=0,
    )


def synth_rollout(seed: int, num_turns: int) -> Rollout:
    """One rollout with growing prompts, re-rendered answers and a history rewrite (FORK), and one title call."""
    rng = random.Random(seed)
    system = _ids(rng, 600)
    context = list(system)
    turns: list[Turn] = []
    for i in range(num_turns):
        completion = _ids(rng, rng.randint(100, 400))
        turns.append(_turn(len(turns), list(context), completion))
        if i == 0:  # a title call in parallel with turn 1
            turns.append(_turn(len(turns), _ids(rng, 80) + system[-50:], _ids(rng, 12)))
        if i % 7 == 6:  # re-rendered answer: the last 20 tokens differ
            context = context + completion[:-20] + _ids(rng, 25)
        elif i == (3 * num_turns) // 4:  # history rewritten after the system prompt
            context = list(system) + _ids(rng, 300)
        else:
            context = context + completion
        context = context + _ids(rng, rng.randint(250, 650))
    return Rollout(
        rollout_id=f"r{seed}", group_id=0, task_id="t", harness="bench", status="ok",
        reward=1.0, trace=Trace(session_id=f"s{seed}", turns=turns),
    )


def _naive_common_prefix_len(a, b) -> int:  # type: ignore[no-untyped-def]
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _naive_starts_with(seq, prefix) -> bool:  # type: ignore[no-untyped-def]
    return len(prefix) <= len(seq) and _naive_common_prefix_len(seq, prefix) == len(prefix)


def _time_build(rollouts: list[Rollout], repeats: int) -> tuple[float, MergeStats, int]:
    best = float("inf")
    stats = MergeStats()
    out_tokens = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = [build_rows(r) for r in rollouts]
        best = min(best, time.perf_counter() - t0)
        stats = MergeStats()
        out_tokens = 0
        for rows, s in results:
            stats = stats.merge(s)
            out_tokens += sum(len(row.input_ids) for row in rows)
    return best, stats, out_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rollouts = [synth_rollout(seed, args.turns) for seed in range(args.rollouts)]
    in_tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for r in rollouts for t in r.trace.turns)
    max_prompt = max(len(t.prompt_ids) for r in rollouts for t in r.trace.turns)

    fast_s, stats, out_tokens = _time_build(rollouts, args.repeats)
    fast_c, fast_sw = samples.common_prefix_len, samples._starts_with
    samples.common_prefix_len, samples._starts_with = _naive_common_prefix_len, _naive_starts_with
    try:
        naive_s, naive_stats, _ = _time_build(rollouts[: max(1, args.rollouts // 8)], 1)
        naive_s *= args.rollouts / max(1, args.rollouts // 8)
    finally:
        samples.common_prefix_len, samples._starts_with = fast_c, fast_sw

    fr = stats.fractions()
    print(f"rollouts={args.rollouts} turns/rollout={args.turns}+1 title  max prompt={max_prompt} tokens")
    print(f"input trace tokens={in_tokens:,}  output row tokens={out_tokens:,}  rows={stats.num_rows}")
    print(f"merge: clean={fr['clean']:.2f} realign={fr['realign']:.2f} fork={fr['fork']:.2f} "
          f"auxiliary={stats.num_auxiliary} trained={stats.tokens_trained:,}")
    print(f"build_rows: {fast_s * 1e3:.1f} ms  -> {in_tokens / fast_s / 1e6:.1f} M input tokens/s "
          f"({out_tokens / fast_s / 1e6:.1f} M output tokens/s)  target >= 5 M input tokens/s")
    print(f"per-token-loop prefix baseline (extrapolated from 1/8 of the rollouts): "
          f"{in_tokens / naive_s / 1e6:.2f} M tokens/s  speed-up x{naive_s / fast_s:.1f}")


if __name__ == "__main__":
    main()

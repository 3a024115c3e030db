"""Throughput of the embedded engine against `model.generate`, on SmolLM2-135M, in one run.

For N in (1, 4, 8) concurrent requests with chat prompts of varied lengths, greedy, up to
`--max-tokens` new ids each, it measures completion tokens per second of:
  * engine@N:      N concurrent `EmbeddedEngine.generate` calls (continuous batching, with logprobs);
  * generate-seq:  `model.generate` on the N prompts one after another;
  * generate-static@N: one left-padded `model.generate` batch of the N prompts.
Each figure is the best wall time of `--repeats` runs, the methods interleaved within a
repeat, so that load from other processes disturbs the comparison less. Tokens counted are
the real ones (up to and including the first EOS); the padding a static batch keeps
generating after a row ended is not counted. Also reports how many of the engine's
greedy completions equal `model.generate`'s ids (they may differ after near-ties, because
batched and unbatched matmuls round differently).

Run: `.venv/bin/python bench/engine.py [--threads 2] [--max-tokens 64] [--repeats 2]`.
What it does not do: sampling benchmarks, long-context or GPU runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from harnessrl.engine.embedded import EmbeddedEngine  # noqa: E402
from harnessrl.engine.model_store import load_causal_lm, load_tokenizer, resolve_model  # noqa: E402
from harnessrl.types import Sampling  # noqa: E402

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of integers.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than ten and explain how you know they are prime.",
    "I have a bash script that fails with 'permission denied' when I run ./build.sh in my "
    "project directory. What are the most likely causes and how do I fix each of them?",
    "Summarise the following paragraph: The quick brown fox jumps over the lazy dog. "
    "This sentence contains every letter of the English alphabet and is often used to test "
    "typewriters, keyboards and fonts. It has been used since the late nineteenth century.",
    "You are reviewing a pull request that adds a retry loop around an HTTP call. The loop "
    "retries forever with no delay on any exception, including KeyboardInterrupt. Write a "
    "short review comment explaining the problems and suggest a better design with bounded "
    "retries, exponential backoff and which exceptions should be retried.",
]


def render_prompts(tokenizer: object, n: int) -> list[list[int]]:
    prompts = []
    for q in QUESTIONS[:n]:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(list(ids))
    return prompts


def real_tokens(ids: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """Ids up to and including the first EOS."""
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[: i + 1]
    return ids


def bench_engine(
    engine: EmbeddedEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens)

    async def run() -> list[list[int]]:
        done = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
        return [list(c.completion_ids) for c in done]

    t0 = time.perf_counter()
    outs = asyncio.run(run())
    return time.perf_counter() - t0, outs


def bench_generate_seq(model, prompts, max_tokens, eos_ids) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    outs = []
    t0 = time.perf_counter()
    for p in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)
        outs.append(real_tokens(out[0, len(p) :].tolist(), eos_ids))
    return time.perf_counter() - t0, outs


def bench_generate_static(  # noqa: ANN001
    model, prompts, max_tokens, eos_ids, pad_id
) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id
        )
    dt = time.perf_counter() - t0
    return dt, [real_tokens(row[width:].tolist(), eos_ids) for row in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best wall time of this many interleaved runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    engine = EmbeddedEngine(model_dir, num_threads=args.threads, max_batch_size=8)
    eos_ids = engine.eos_token_ids
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    all_prompts = render_prompts(tokenizer, 8)
    print(f"threads={args.threads} max_tokens={args.max_tokens} repeats={args.repeats} prompt lengths={[len(p) for p in all_prompts]}")
    bench_engine(engine, all_prompts[:2], 8)  # warm-up
    bench_generate_static(model, all_prompts[:2], 8, eos_ids, pad_id)

    best: dict[tuple[int, str], tuple[float, list[list[int]]]] = {}
    for _ in range(args.repeats):  # methods interleaved per repeat; best wall time kept
        for n in (1, 4, 8):
            prompts = all_prompts[:n]
            for name, fn in (
                ("engine", lambda: bench_engine(engine, prompts, args.max_tokens)),
                ("generate-seq", lambda: bench_generate_seq(model, prompts, args.max_tokens, eos_ids)),
                ("generate-static", lambda: bench_generate_static(model, prompts, args.max_tokens, eos_ids, pad_id)),
            ):
                dt, outs = fn()
                if (n, name) not in best or dt < best[(n, name)][0]:
                    best[(n, name)] = (dt, outs)
    rows = []
    for (n, name), (dt, outs) in best.items():
        ntok = sum(len(o) for o in outs)
        rows.append((n, name, ntok, dt, ntok / dt, outs))
    engine.close()

    print(f"{'N':>2} {'method':<16} {'tokens':>6} {'wall_s':>7} {'tok/s':>7}")
    for n, name, ntok, dt, tps, _ in rows:
        print(f"{n:>2} {name:<16} {ntok:>6} {dt:>7.2f} {tps:>7.1f}")
    by = {(n, name): (tps, outs) for n, name, _, _, tps, outs in rows}
    for n in (1, 4, 8):
        eng_tps, eng_outs = by[(n, "engine")]
        seq_tps, seq_outs = by[(n, "generate-seq")]
        st_tps, _ = by[(n, "generate-static")]
        same = sum(a == b for a, b in zip(eng_outs, seq_outs))
        print(
            f"N={n}: engine/static = {eng_tps / st_tps:.2f}x, engine/seq = {eng_tps / seq_tps:.2f}x, "
            f"greedy ids equal to generate: {same}/{n}"
        )


if __name__ == "__main__":
    main()

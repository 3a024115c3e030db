"""The embedded engine's precision gap: bfloat16 sampling against the float32 trainer, same weights.

The gap, not the lag: the engine (`EmbeddedEngine`, `--dtype`, default bfloat16) samples
`--prompts` chat prompts x `--max-tokens` ids at temperature 1 from the model's own weights, and
the float32 trainer (`compute_trainer_logprobs`, as in a training step) scores the same ids. Per
sampled token, `d = log pi_trainer - log mu_engine` (w = exp(d), the behaviour weight of the
decoupled loss at staleness 0). Printed, over all tokens and by the trainer's probability of the
token (buckets): the token count, mean |d|, the k3 mismatch KL `w - 1 - ln w` (Schulman 2020),
and the fraction of tokens whose ratio lies outside the PPO clip [0.8, 1.28] (the tokens a
behaviour-centred clip would stop: "phantom clipping").

Second, the same ids teacher-forced through the engine's model in its dtype, once as it is and
once with the LM head (final norm output -> logits) in float32: the body in bfloat16, the
vocabulary projection and the log-softmax in float32 (ScaleRL, arXiv 2510.13786; MiniMax-M1;
PipelineRL's fp32 lm_head). The first arm checks that teacher forcing reproduces the engine's
own gap; the second says what an fp32 head would remove. Last, the head's cost: the time of
one decode step's LM-head matmul at `--batch` rows in the engine dtype and in float32, against
a whole bfloat16 forward of one decode position for the batch.

Run: `python bench/precision.py [--model smollm2-135m] [--dtype bfloat16] [--device cpu]`.
On a CPU without native bfloat16 (AVX512-BF16 / AMX) torch emulates it and the engine is slow.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402 - after the offline switch
import torch.nn.functional as F  # noqa: E402

from harnessrl.engine.embedded.engine import EmbeddedEngine  # noqa: E402
from harnessrl.engine.model_store import load_causal_lm, resolve_model  # noqa: E402
from harnessrl.train.packing import compute_trainer_logprobs, pack_rows, segment_attention  # noqa: E402
from harnessrl.types import Row, Sampling  # noqa: E402

QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Write a Python function that reverses a string.",
    "List three prime numbers greater than 20.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23? Show the steps.",
    "Name a shell command that counts the lines of a file.",
    "Translate 'good morning' into Spanish and German.",
    "Give a haiku about autumn rain.",
]
BUCKETS = [(0.0, 0.01), (0.01, 0.1), (0.1, 0.5), (0.5, 0.9), (0.9, 1.0001)]
CLIP = (0.8, 1.28)


def gap_table(name: str, p_trainer: torch.Tensor, d: torch.Tensor) -> None:
    """One line per probability bucket (of the trainer's p) and one for all tokens."""
    print(f"\n{name}: d = log pi_trainer(fp32) - log mu")
    print(f"{'p_trainer':>14} {'tokens':>7} {'mean|d|':>9} {'k3 KL':>9} {'out[0.8,1.28]':>14} {'mean d':>9}")
    w = torch.exp(d)
    k3 = w - 1 - d
    out = (w < CLIP[0]) | (w > CLIP[1])
    rows = [(f"[{lo:.2f},{min(hi, 1.0):.2f})", (p_trainer >= lo) & (p_trainer < hi)) for lo, hi in BUCKETS]
    for label, sel in [*rows, ("all", torch.ones_like(d, dtype=torch.bool))]:
        n = int(sel.sum())
        if not n:
            print(f"{label:>14} {0:>7}")
            continue
        print(f"{label:>14} {n:>7} {float(d[sel].abs().mean()):>9.4f} {float(k3[sel].mean()):>9.5f} "
              f"{float(out[sel].float().mean()):>14.3%} {float(d[sel].mean()):>+9.4f}")


def trainer_logprobs(model: torch.nn.Module, rows: Sequence[Row]) -> torch.Tensor:
    """float32 logprobs of every trained token of `rows`, in row order (one row per pack)."""
    out = []
    with torch.no_grad(), segment_attention(model):
        for row in rows:
            (batch,) = pack_rows([row], 1 << 20)
            lp = compute_trainer_logprobs(model, batch, 1.0)
            out.append(lp[batch.mask_T])
    return torch.cat(out)


def teacher_forced(model: torch.nn.Module, rows: Sequence[Row], fp32_head: bool) -> torch.Tensor:
    """Logprobs of the trained tokens through `model` in its own dtype; `fp32_head`: the hidden
    states (after the final norm) projected and normalised in float32."""
    out = []
    head = model.lm_head.weight  # type: ignore[union-attr]
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.input_ids], device=head.device)
            hidden = model.model(input_ids=ids).last_hidden_state[0]  # type: ignore[operator, union-attr]
            logits = F.linear(hidden.float(), head.float()) if fp32_head else model.lm_head(hidden).float()  # type: ignore[operator]
            lp = torch.log_softmax(logits, dim=-1)
            targets = ids[0, 1:]
            tok = lp[:-1].gather(-1, targets[:, None])[:, 0]
            mask = torch.tensor(row.completion_mask[1:], dtype=torch.bool, device=tok.device)
            out.append(tok[mask].cpu())
    return torch.cat(out)


def head_cost(model: torch.nn.Module, batch: int, repeats: int = 50) -> None:
    """Median time of one decode step's LM-head matmul, engine dtype vs float32, and of one
    whole forward of one position for `batch` rows in the engine dtype."""
    head = model.lm_head.weight  # type: ignore[union-attr]
    hidden = torch.randn(batch, head.shape[1], dtype=head.dtype, device=head.device)
    w32 = head.float()

    def timed(fn) -> float:  # noqa: ANN001
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            if head.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    with torch.no_grad():
        t_half = timed(lambda: torch.log_softmax(F.linear(hidden, head).float(), -1))
        t_fp32 = timed(lambda: torch.log_softmax(F.linear(hidden.float(), w32), -1))
        ids = torch.randint(0, head.shape[0], (batch, 1), device=head.device)
        t_fwd = timed(lambda: model(input_ids=ids))
    print(f"\nLM head + log-softmax, {batch} rows: {head.dtype} {t_half * 1e3:.2f} ms, float32 {t_fp32 * 1e3:.2f} ms "
          f"(+{(t_fp32 - t_half) * 1e3:.2f} ms); one {head.dtype} forward of {batch} x 1 ids {t_fwd * 1e3:.2f} ms "
          f"(no cache: an upper bound of a decode step)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=2, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="rows of the LM-head cost measurement")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    from transformers import AutoTokenizer  # lazy: only this script needs the tokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
               for q in (QUESTIONS * (args.prompts // len(QUESTIONS) + 1))[: args.prompts]]
    engine = EmbeddedEngine(model_dir, dtype=args.dtype, device=args.device, num_threads=args.threads)
    t0 = time.perf_counter()
    rows: list[Row] = []
    jobs = [(i, s) for i in range(len(prompts)) for s in range(args.samples)]
    try:  # concurrent requests: the engine decodes them in one batch
        with ThreadPoolExecutor(len(jobs)) as pool:
            done = list(pool.map(lambda job: engine.generate_blocking(
                list(prompts[job[0]]), Sampling(max_tokens=args.max_tokens, temperature=1.0,
                                                seed=1000 * job[0] + job[1])), jobs))
    finally:
        engine.close()
    for (i, s), c in zip(jobs, done):
        n_ctx, n = len(c.prompt_ids), len(c.completion_ids)
        rows.append(Row(tuple(c.prompt_ids) + tuple(c.completion_ids), (0,) * n_ctx + (1,) * n,
                        (0.0,) * n_ctx + tuple(c.completion_logprobs), (-1,) * n_ctx + (0,) * n,
                        f"r{i}-{s}", i, 0.0))
    sampled = torch.tensor([lp for r in rows for lp, m in zip(r.sampler_logprobs, r.completion_mask) if m])
    print(f"{len(rows)} completions, {sampled.numel()} sampled tokens from the {args.dtype} engine "
          f"({time.perf_counter() - t0:.1f} s), model {args.model}, device {args.device}")
    trainer = load_causal_lm(model_dir, dtype="float32").to(args.device)
    lp32 = trainer_logprobs(trainer, rows).cpu()
    p32 = torch.exp(lp32)
    gap_table(f"engine ({args.dtype}, sampled) vs trainer (float32)", p32, lp32 - sampled)
    half = load_causal_lm(model_dir, dtype=args.dtype).to(args.device)
    forced = teacher_forced(half, rows, fp32_head=False)
    print(f"\nteacher-forced {args.dtype} vs the engine's own logprobs: mean |diff| "
          f"{float((forced - sampled).abs().mean()):.4f}")
    gap_table(f"teacher-forced {args.dtype}, {args.dtype} head", p32, lp32 - forced)
    gap_table(f"teacher-forced {args.dtype} body, float32 head", p32, lp32 - teacher_forced(half, rows, fp32_head=True))
    head_cost(half, args.batch)


if __name__ == "__main__":
    main()

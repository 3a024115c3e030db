"""Packed (padding-free) versus padded training steps, forward + backward, in one run.

Model: a random-weight Llama with the SmolLM2 vocabulary (49152 ids, tied embeddings) and
`--hidden`/`--layers` (defaults 128 / 4), float32, one torch thread. Rows: `--rows` rows with
lengths uniform in [`--min-len`, `--max-len`] (default 32..1024), the last `--trained-frac`
of each row trained (an agent row is mostly context). Both ways use the same rows in the same
seeded order, the same PPO-clip loss and the global-token-mean normaliser:
  * padded: `--batch-rows` rows per micro-batch, right-padded to the longest, attention mask,
    logits at every position (the common HF recipe);
  * packed-full-logits: `pack_rows` with a budget of `batch-rows * max-len` tokens, position
    ids reset per row, no mask, logits at every position (isolates the padding saving);
  * packed: the same packs through `compute_trainer_logprobs` (logits only where a trained
    token is predicted): what the trainer runs.
Tokens/s counts real (non-pad) row tokens per second of forward + backward. Timings are the
best of `--repeats`. The machine may be shared: ratios are measured in the same run.

Run: `.venv/bin/python bench/packing.py`. Target: packed >= 1.5x padded.

Budget sweep (`--budgets 2048,4096,8192`): for each token budget, the same rows (lengths in
[`--min-len`, `--max-len`]) packed under it and trained through `compute_trainer_logprobs`
with `attention="dense"` (transformers' block-diagonal [T, T] mask) and `"segments"` (SDPA
per row, no mask), each in a fresh subprocess, reporting tokens/s of forward + backward and
the step's peak memory (peak RSS during the step minus RSS before it, `ru_maxrss`). The
methods alternate per repeat and the best time is kept; the machine may be loaded.

Shared prefixes (`--group-size G --prefix-len P`): rows come in groups of G whose first P ids
are the same (a group's task prompt; each row keeps at least its trained tail and one context
id of its own), and the sweep adds the arm `shared`: `pack_rows` with `share_prefixes=True`
(each group's prompt forwarded once per pack) against `segments` (whole rows, the layout
before). Tokens/s counts the rows' tokens (what the step trains on), so the shared arm's
saving shows as tokens/s; the packed tokens forwarded are printed too.

`--before` adds the arm `before`: the trainer as it was before shared prefixes, segment
attention and the fused token logprobs: whole rows, the dense block-diagonal mask, and the
sampled ids' logprobs through autograd (`z.gather - logsumexp(z)`, patched in for that arm
only). The summary then compares each arm with it (`shared` is the trainer now).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

import torch

from harnessrl.loss.losses import LossInputs, PpoClipLoss, ppo_clip_loss
from harnessrl.train.packing import PackedBatch, compute_trainer_logprobs, loss_inputs, pack_rows
from harnessrl.types import Row

VOCAB = 49152


def make_model(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32), num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    model.train()
    return model


def make_rows(
    n: int, min_len: int, max_len: int, trained_frac: float, seed: int, group_size: int = 1, prefix_len: int = 0
) -> list[Row]:
    """`n` rows; rows `k*group_size .. (k+1)*group_size-1` share their first `prefix_len` ids
    (capped so that each row keeps its trained tail and one context id of its own)."""
    rng = random.Random(seed)
    rows = []
    prefix: list[int] = []
    for k in range(n):
        length = rng.randint(min_len, max_len)
        n_trained = max(1, int(length * trained_frac))
        mask = (0,) * (length - n_trained) + (1,) * n_trained
        if k % max(1, group_size) == 0:
            prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
        shared = prefix[: max(0, length - n_trained - 1)]
        rows.append(Row(
            input_ids=tuple(shared) + tuple(rng.randrange(VOCAB) for _ in range(length - len(shared))),
            completion_mask=mask,
            sampler_logprobs=tuple(-10.8 if m else 0.0 for m in mask),
            policy_versions=tuple(0 if m else -1 for m in mask),
            rollout_id="r", group_id=0, advantage=rng.choice((-1.0, 1.0)),
        ))
    return rows


def padded_step(model: torch.nn.Module, rows: list[Row], batch_rows: int, n_global: int) -> None:
    for start in range(0, len(rows), batch_rows):
        batch = rows[start:start + batch_rows]
        width = max(len(r.input_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attn = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        sampler = torch.zeros(len(batch), width)
        adv = torch.zeros(len(batch), width)
        for b, r in enumerate(batch):
            n = len(r.input_ids)
            ids[b, :n] = torch.tensor(r.input_ids)
            attn[b, :n] = 1
            mask[b, :n] = torch.tensor(r.completion_mask, dtype=torch.bool)
            sampler[b, :n] = torch.tensor(r.sampler_logprobs)
            adv[b, :n] = r.advantage
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp = torch.cat([torch.zeros(len(batch), 1), lp], dim=1)
        seq = torch.arange(len(batch))[:, None].expand(-1, width)
        inputs = LossInputs(lp.flatten(), sampler.flatten(), adv.flatten(), mask.flatten(), seq.flatten(), n_global)
        ppo_clip_loss(inputs, PpoClipLoss()).loss.backward()


def _full_logit_logprobs(model: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    ids = packed.input_ids_T
    logits = model(input_ids=ids[None], position_ids=packed.position_ids_T[None], use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp]) * packed.mask_T


def packed_step(
    model: torch.nn.Module, packs: list[PackedBatch], n_global: int, full_logits: bool, attention: str = "segments"
) -> None:
    for packed in packs:
        if full_logits:
            lp = _full_logit_logprobs(model, packed)
        else:
            lp = compute_trainer_logprobs(model, packed, temperature=1.0, attention=attention)  # type: ignore[arg-type]
        ppo_clip_loss(loss_inputs(packed, lp, n_global), PpoClipLoss()).loss.backward()


def _best_s(fn, repeats: int, model: torch.nn.Module) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one_budget(args: argparse.Namespace) -> None:
    """Child process: one (budget, attention) pair; prints a JSON line."""
    torch.set_num_threads(args.threads)
    model = make_model(args.hidden, args.layers)
    rows = make_rows(args.rows, args.min_len, args.max_len, args.trained_frac, seed=0,
                     group_size=args.group_size, prefix_len=args.prefix_len)
    n_global = sum(r.num_trained_tokens for r in rows)
    shared = args.attention == "shared"
    attention = "segments" if shared else "dense" if args.attention == "before" else args.attention
    if args.attention == "before":  # the autograd formula the trainer used before token_logprobs
        import harnessrl.train.packing as packing_module

        def autograd_logprobs(logits_K_V: torch.Tensor, targets_K: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            z = logits_K_V.float() / scale
            return z.gather(-1, targets_K[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)

        packing_module.token_logprobs = autograd_logprobs  # type: ignore[assignment]
    packs = pack_rows(rows, token_budget=args.one_budget, share_prefixes=shared)
    # Warm-up on the smallest pack (allocator, kernels), then measure the whole step.
    packed_step(model, packs[-1:], n_global, False, attention)
    model.zero_grad(set_to_none=False)
    before = _rss_mib()
    t0 = time.perf_counter()
    packed_step(model, packs, n_global, False, attention)
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "peak_mib": _rss_mib() - before, "packs": len(packs),
                      "longest_pack": max(p.num_tokens for p in packs),
                      "packed": sum(p.num_tokens for p in packs),
                      "tokens": sum(len(r.input_ids) for r in rows)}))


def sweep(args: argparse.Namespace) -> None:
    budgets = [int(b) for b in args.budgets.split(",")]
    arms = ("dense", "segments", "shared") if args.group_size > 1 and args.prefix_len > 0 else ("dense", "segments")
    if args.before:
        arms = ("before", *arms)
    best: dict[tuple[int, str], dict] = {}
    for _ in range(args.repeats):
        for budget in budgets:
            for attention in arms:
                cmd = [sys.executable, __file__, "--one-budget", str(budget), "--attention", attention]
                for key in ("rows", "min_len", "max_len", "trained_frac", "hidden", "layers", "threads",
                            "group_size", "prefix_len"):
                    cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                key = (budget, attention)
                if key not in best or res["seconds"] < best[key]["seconds"]:
                    peak = max(res["peak_mib"], best.get(key, {}).get("peak_mib", 0.0))
                    best[key] = {**res, "peak_mib": peak}
    print(f"rows={args.rows} lengths {args.min_len}..{args.max_len} hidden={args.hidden} layers={args.layers} "
          f"threads={args.threads} repeats={args.repeats} group_size={args.group_size} prefix_len={args.prefix_len} "
          f"(best time, max peak) load {os.getloadavg()[0]:.1f}")
    print(f"{'budget':>6} {'attention':>9} {'packs':>5} {'longest':>7} {'forwarded':>9} {'tokens/s':>9} {'peak MiB':>9}")
    for (budget, attention), r in best.items():
        print(f"{budget:>6} {attention:>9} {r['packs']:>5} {r['longest_pack']:>7} {r['packed']:>9} "
              f"{r['tokens'] / r['seconds']:>9.0f} {r['peak_mib']:>9.0f}")
    for budget in budgets:
        d, g = best[(budget, "dense")], best[(budget, "segments")]
        print(f"budget {budget}: segments {d['seconds'] / g['seconds']:.2f}x the tokens/s of dense, "
              f"peak memory {g['peak_mib']:.0f} vs {d['peak_mib']:.0f} MiB")
        if "shared" in arms:
            h = best[(budget, "shared")]
            print(f"budget {budget}: shared {g['seconds'] / h['seconds']:.2f}x the tokens/s of segments "
                  f"({h['packed']} vs {g['packed']} tokens forwarded), peak memory {h['peak_mib']:.0f} MiB")
        if "before" in arms:
            b, now = best[(budget, "before")], best[(budget, arms[-1])]
            print(f"budget {budget}: {arms[-1]} (now) {b['seconds'] / now['seconds']:.2f}x the tokens/s of before "
                  f"({now['packed']} vs {b['packed']} tokens forwarded), peak memory {now['peak_mib']:.0f} vs "
                  f"{b['peak_mib']:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--trained-frac", type=float, default=0.25)
    parser.add_argument("--batch-rows", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=1, help="rows per group sharing --prefix-len ids")
    parser.add_argument("--prefix-len", type=int, default=0, help="ids shared by the rows of a group")
    parser.add_argument("--budgets", default="", help="comma-separated token budgets: run the budget sweep")
    parser.add_argument("--before", action="store_true",
                        help="sweep: add the arm 'before' (whole rows, dense mask, autograd logprobs)")
    parser.add_argument("--one-budget", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--attention", default="segments", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_budget:
        one_budget(args)
        return
    if args.budgets:
        sweep(args)
        return
    torch.set_num_threads(args.threads)
    model = make_model(args.hidden, args.layers)
    rows = make_rows(args.rows, args.min_len, args.max_len, args.trained_frac, seed=0)
    n_tokens = sum(len(r.input_ids) for r in rows)
    n_global = sum(r.num_trained_tokens for r in rows)
    packs = pack_rows(rows, token_budget=args.batch_rows * args.max_len)
    n_padded = sum(
        len(rows[s:s + args.batch_rows]) * max(len(r.input_ids) for r in rows[s:s + args.batch_rows])
        for s in range(0, len(rows), args.batch_rows)
    )
    t_pad = _best_s(lambda: padded_step(model, rows, args.batch_rows, n_global), args.repeats, model)
    t_full = _best_s(lambda: packed_step(model, packs, n_global, True), args.repeats, model)
    t_pack = _best_s(lambda: packed_step(model, packs, n_global, False), args.repeats, model)
    print(f"rows={len(rows)} tokens={n_tokens:,} trained={n_global:,} padded slots={n_padded:,} "
          f"({n_padded / n_tokens:.2f}x) padded micro-batches={-(-len(rows) // args.batch_rows)} packs={len(packs)}")
    for name, t in (("padded", t_pad), ("packed-full-logits", t_full), ("packed", t_pack)):
        print(f"{name:>20}: {t:6.2f} s  {n_tokens / t:8.0f} tokens/s  x{t_pad / t:.2f} vs padded")


if __name__ == "__main__":
    main()

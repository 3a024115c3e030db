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
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from harnessrl.train.losses import LossInputs, PpoClipLoss, ppo_clip_loss
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


def make_rows(n: int, min_len: int, max_len: int, trained_frac: float, seed: int) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        n_trained = max(1, int(length * trained_frac))
        mask = (0,) * (length - n_trained) + (1,) * n_trained
        rows.append(Row(
            input_ids=tuple(rng.randrange(VOCAB) for _ in range(length)),
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


def packed_step(model: torch.nn.Module, packs: list[PackedBatch], n_global: int, full_logits: bool) -> None:
    for packed in packs:
        if full_logits:
            lp = _full_logit_logprobs(model, packed)
        else:
            lp = compute_trainer_logprobs(model, packed, temperature=1.0)
        ppo_clip_loss(loss_inputs(packed, lp, n_global), PpoClipLoss()).loss.backward()


def _best_s(fn, repeats: int, model: torch.nn.Module) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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
    args = parser.parse_args()
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

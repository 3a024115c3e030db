"""engine/embedded/prefill.py's batched layouts against one forward per prompt: same KV, same last logits."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from harnessrl.engine.model_store import load_causal_lm
from harnessrl.engine.embedded.prefill import group_forward, packed_forward


def _alone(model: torch.nn.Module, prompt: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    return [(ly.keys, ly.values) for ly in cache.layers], out.logits[0, -1]


def test_packed_and_padded_prefill_equal_one_forward_per_prompt(tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    prompts = [tuple(range(100, 103)), tuple(range(200, 231)), (7,), tuple(range(300, 317))]
    with torch.inference_mode():
        want = [_alone(model, list(p)) for p in prompts]
        packed_kv, packed_logits = packed_forward(model, prompts)
        # the padded layout: every row but the third has its first 2 ids cached already
        rows = []
        for p in prompts:
            done = 2 if len(p) > 2 else 0
            cache = DynamicCache(config=model.config)
            if done:
                model(input_ids=torch.tensor([p[:done]]), cache=cache, use_cache=True)
            rows.append((p, done, cache))
        padded_kv, padded_logits = group_forward(model, rows)
    assert packed_logits.shape == padded_logits.shape == (4, model.config.vocab_size)
    for i, (kv, logits) in enumerate(want):
        for got_kv, got_logits in ((packed_kv[i], packed_logits[i]), (padded_kv[i], padded_logits[i])):
            assert (got_logits - logits).abs().max().item() <= 1e-5, f"prompt {i}: last logits differ"
            for (k, v), (k_ref, v_ref) in zip(got_kv, kv, strict=True):
                assert k.shape == k_ref.shape == (1, k_ref.shape[1], len(prompts[i]), k_ref.shape[3])
                assert torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)

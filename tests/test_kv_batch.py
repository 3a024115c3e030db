"""engine/embedded/batch.py's slot layout: rows join into free slots and leave without copying the others'
KV wholesale; a slot reused after a row ended gives what a fresh engine gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from harnessrl.engine.embedded.batch import KVBatch
from harnessrl.engine.embedded.engine import EmbeddedEngine
from harnessrl.types import Sampling

H, D, LAYERS = 2, 4, 3


def _kv(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)) for _ in range(LAYERS)]


def test_rows_join_leave_and_keep_their_kv() -> None:
    batch = KVBatch()
    rows = {name: (_kv(n, seed), n) for name, n, seed in (("a", 5, 1), ("b", 9, 2), ("c", 3, 3))}
    batch.add_rows([(kv, n, 7) for kv, n in rows.values()])
    assert batch.size == 3 and batch.lengths == [5, 9, 3] and batch.length == 9
    assert batch.positions_B.tolist() == [5, 9, 3] and batch.last_ids_B.tolist() == [7, 7, 7]
    mask = batch.step_mask()
    assert mask.shape == (3, 1, 1, 10)
    assert mask[:, 0, 0].sum(-1).tolist() == [6, 10, 4]  # own tokens + the column this step writes
    assert mask[0, 0, 0, :6].all() and not mask[0, 0, 0, 6:].any()

    inputs = batch.step_inputs()  # one step: every layer writes its new column at each row's position
    new = [torch.full((3, H, 1, D), float(i + 1)) for i in range(LAYERS)]
    for i, layer in enumerate(inputs["cache"].layers):  # type: ignore[union-attr]
        keys, values = layer.update(new[i], -new[i])
        assert keys.shape == (3, H, 10, D)
    batch.commit_step([11, 12, 13])
    assert batch.lengths == [6, 10, 4] and batch.last_ids_B.tolist() == [11, 12, 13]
    for row, (name, (kv, n)) in enumerate(rows.items()):
        got = batch.row_kv(row)
        for i, (k, v) in enumerate(got):
            assert torch.equal(k[:, :, :n], kv[i][0]) and torch.equal(v[:, :, :n], kv[i][1]), name
            assert torch.equal(k[0, :, n], torch.full((H, D), float(i + 1)))
            assert torch.equal(v[0, :, n], torch.full((H, D), -float(i + 1)))

    slots = batch.capacity
    batch.remove([0])  # b and c move down one slot each, their columns intact
    assert batch.size == 2 and batch.lengths == [10, 4] and batch.last_ids_B.tolist() == [12, 13]
    assert torch.equal(batch.row_kv(0)[1][0][:, :, :9], rows["b"][0][1][0])
    assert torch.equal(batch.row_kv(1)[2][1][:, :, :3], rows["c"][0][2][1])
    batch.add_rows([(_kv(4, 9), 4, 5)])  # the freed slot is reused, no new buffers
    assert batch.capacity == slots and batch.lengths == [10, 4, 4]
    assert torch.equal(batch.row_kv(2)[0][0], _kv(4, 9)[0][0])
    batch.remove([0, 1, 2])
    assert batch.size == 0 and batch.cache is None


def test_buffers_grow_and_shrink() -> None:
    batch = KVBatch()
    batch.add_rows([(_kv(10, s), 10, 0) for s in range(6)])
    slots, cols = batch.capacity
    assert slots >= 6 and cols > 10
    batch.add_rows([(_kv(cols + 5, 7), cols + 5, 0)])  # longer than the buffers: they grow
    assert batch.capacity[1] > cols + 5 and torch.equal(batch.row_kv(0)[0][0], _kv(10, 0)[0][0])
    batch.remove([6])  # the long row leaves: columns shrink back, rows intact
    assert batch.capacity[1] <= 2 * 11 + 64
    assert all(torch.equal(batch.row_kv(r)[2][1], _kv(10, r)[2][1]) for r in range(6))


async def test_a_reused_slot_gives_what_a_fresh_engine_gives(tiny_model_dir: Path) -> None:
    greedy = Sampling(temperature=0.0, max_tokens=150)
    long_prompt, short_prompt, late_prompt = list(range(300, 341)), list(range(100, 160)), list(range(700, 712))
    with EmbeddedEngine(tiny_model_dir, num_threads=1, prefix_cache_tokens=0) as eng:
        long_task = asyncio.create_task(eng.generate(long_prompt, greedy))
        short = await eng.generate(short_prompt, Sampling(temperature=0.0, max_tokens=4))
        # the short row (64 columns when it left) is gone; the late one (12 ids) takes its slot,
        # whose columns past 12 hold the short row's stale KV
        batched = eng.stats().batched_steps
        late = await eng.generate(late_prompt, Sampling(temperature=0.9, max_tokens=12, seed=3))
        assert not long_task.done() and eng.stats().batched_steps - batched >= 11, "the late row decoded alone"
        long = await long_task
        assert eng.stats().max_batch_size_seen == 2
    for prompt, sampling, got in ((long_prompt, greedy, long), (late_prompt, Sampling(temperature=0.9, max_tokens=12,
                                                                                         seed=3), late)):
        with EmbeddedEngine(tiny_model_dir, num_threads=1, prefix_cache_tokens=0) as fresh:
            want = await fresh.generate(prompt, sampling)
        assert got.completion_ids == want.completion_ids
        assert got.completion_logprobs == pytest.approx(want.completion_logprobs, abs=1e-5)
    assert len(short.completion_ids) == 4


def test_eager_attention_steps_with_the_additive_mask_equal_sdpa() -> None:
    """The model's own forward over a KVBatch: sdpa takes the bool mask, eager the additive one."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    sdpa = LlamaForCausalLM(config).eval()
    eager = LlamaForCausalLM.from_pretrained(None, config=config, state_dict=sdpa.state_dict(),
                                             attn_implementation="eager").eval()
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    prompts = [[5, 6, 7], list(range(20, 31)), [9]]  # unequal lengths: the short rows have masked columns
    logits = []
    for model, additive in ((sdpa, None), (eager, torch.float32)):
        batch = KVBatch()
        rows = []
        with torch.inference_mode():
            for p in prompts:
                cache = DynamicCache(config=model.config)
                model(input_ids=torch.tensor([p]), cache=cache, use_cache=True)
                rows.append(([(ly.keys, ly.values) for ly in cache.layers], len(p), 3))
            batch.add_rows(rows)
            steps = []
            for _ in range(4):
                out = model(**batch.step_inputs(additive_mask=additive), use_cache=True).logits[:, -1, :]
                steps.append(out)
                batch.commit_step(out.argmax(-1).tolist())
        logits.append(torch.stack(steps))
    assert torch.allclose(logits[0], logits[1], atol=1e-5)

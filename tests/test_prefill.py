"""engine/embedded/prefill.py's batched layouts against one forward per prompt (same KV, same last logits), and
the scheduler computing identical waiting prompts once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from harnessrl.engine.embedded.prefill import PrefillScheduler, group_forward, packed_forward
from harnessrl.engine.embedded.prefix_cache import PrefixCache
from harnessrl.engine.embedded.request import Request
from harnessrl.engine.embedded.sampler import RowSampling
from harnessrl.engine.model_store import load_causal_lm
from harnessrl.engine.stats import zero_counters
from harnessrl.errors import EngineError
from harnessrl.types import Sampling


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


def _request(prompt: tuple[int, ...], delivered: list) -> Request:
    return Request(prompt_ids=prompt, sampling=Sampling(temperature=0.0, max_tokens=4), max_new_tokens=4,
                   deliver=delivered.append, row=RowSampling(temperature=0.0), stop=None)


@pytest.mark.parametrize("cache_tokens", [0, 4096])
def test_identical_waiting_prompts_are_computed_once(tiny_model_dir: Path, cache_tokens: int) -> None:
    """A group's G rollouts send one task prompt at once: the scheduler computes it once, in one
    forward with the other waiting prompt, and every copy gets the KV and last logits that a
    forward of its own gives; the counters say so (`prefill_shared`)."""
    model = load_causal_lm(tiny_model_dir)
    task, other = tuple(range(300, 337)), tuple(range(500, 521))
    delivered: list = []
    counters = zero_counters()
    admitted: list[Request] = []
    scheduler = PrefillScheduler(model, PrefixCache(cache_tokens), 512, counters,
                                 admit=lambda r: admitted.append(r) is None)
    requests = [_request(p, delivered) for p in (task, task, task, other, task)]
    scheduler.waiting.extend(requests)
    with torch.inference_mode():
        done = scheduler.run(free_rows=16, version=0)
        want = {p: _alone(model, list(p)) for p in (task, other)}
    assert [d.req for d in done] == [requests[0], requests[1], requests[2], requests[4], requests[3]]
    assert admitted == requests and not delivered and not scheduler.busy
    for d in done:
        kv, logits = want[d.req.prompt_ids]
        assert (d.logits_V - logits).abs().max().item() <= 1e-5
        for (k, v), (k_ref, v_ref) in zip(d.kv, kv, strict=True):
            assert k.shape == k_ref.shape and torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)
    assert counters["prefill_chunks"] == counters["prefill_batches"] == 1, "one forward for all five"
    assert counters["prefill_tokens"] == len(task) + len(other)
    assert counters["prefills"] == 5 and counters["prefill_shared"] == 3
    assert counters["prefix_hit_tokens"] == 3 * len(task)


def test_free_rows_bound_the_followers(tiny_model_dir: Path) -> None:
    """Followers take rows of the running batch too: with 2 free rows, 2 of 4 identical prompts
    are admitted now and the rest wait."""
    model = load_causal_lm(tiny_model_dir)
    task = tuple(range(300, 337))
    counters = zero_counters()
    scheduler = PrefillScheduler(model, PrefixCache(0), 512, counters, admit=lambda r: True)
    requests = [_request(task, []) for _ in range(4)]
    scheduler.waiting.extend(requests)
    with torch.inference_mode():
        done = scheduler.run(free_rows=2, version=0)
    assert [d.req for d in done] == requests[:2]
    assert list(scheduler.waiting) == requests[2:]
    assert counters["prefill_tokens"] == len(task) and counters["prefill_shared"] == 1


def test_unshared_prompts_are_each_computed(tiny_model_dir: Path) -> None:
    """`share_prompts=False` (the comparison arm of `bench/engine.py --workload group`) computes
    every copy, with the same KV and logits."""
    model = load_causal_lm(tiny_model_dir)
    task = tuple(range(300, 337))
    counters = zero_counters()
    scheduler = PrefillScheduler(model, PrefixCache(0), 512, counters, admit=lambda r: True, share_prompts=False)
    requests = [_request(task, []) for _ in range(3)]
    scheduler.waiting.extend(requests)
    with torch.inference_mode():
        done = scheduler.run(free_rows=16, version=0)
        _, logits = _alone(model, list(task))
    assert [d.req for d in done] == requests
    assert counters["prefill_tokens"] == 3 * len(task) and counters["prefill_shared"] == 0
    assert all((d.logits_V - logits).abs().max().item() <= 1e-5 for d in done)


def test_a_failed_forward_fails_the_followers_too(tiny_model_dir: Path) -> None:
    """A prefill forward that raises delivers its error to every request it was to serve,
    followers included, and the scheduler goes on with the next waiting prompt."""
    model = load_causal_lm(tiny_model_dir)
    task, other = tuple(range(300, 337)), tuple(range(500, 521))
    delivered: list = []
    calls = {"n": 0}
    real_forward = model.forward

    def failing_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_forward(*args, **kwargs)

    model.forward = failing_once  # type: ignore[method-assign]
    counters = zero_counters()
    scheduler = PrefillScheduler(model, PrefixCache(0), 512, counters, admit=lambda r: True)
    requests = [_request(task, delivered) for _ in range(3)] + [_request(other, delivered)]
    scheduler.waiting.extend(requests)
    with torch.inference_mode():
        assert scheduler.run(free_rows=16, version=0) == []
        assert len(delivered) == 4 and all(isinstance(e, EngineError) and "boom" in str(e) for e in delivered)
        later = _request(other, delivered)
        scheduler.waiting.append(later)
        done = scheduler.run(free_rows=16, version=0)
    assert [d.req for d in done] == [later] and len(delivered) == 4

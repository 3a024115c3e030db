"""Prefix cache: the index itself, and the engine with it on against it off (same ids, same
logprobs), the group sharing a task prompt, weight swaps, and chunked prefill interleaving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from harnessrl.engine.embedded.engine import EmbeddedEngine
from harnessrl.engine.model_store import load_causal_lm
from harnessrl.engine.embedded.prefix_cache import PrefixCache
from harnessrl.errors import EngineError
from harnessrl.types import Completion, Sampling

GREEDY = Sampling(temperature=0.0, max_tokens=10)


def kv_of(n: int, fill: float = 1.0, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake per-layer KV `[1, 2, n, 4]` whose column j holds fill * j (to check slicing)."""
    col = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1) * fill
    return [(col.expand(1, 2, n, 4).clone(), -col.expand(1, 2, n, 4).clone()) for _ in range(layers)]


# -- the index ---------------------------------------------------------------------------


def test_lookup_returns_the_exact_common_prefix_past_the_last_block() -> None:
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    ids = tuple(range(10, 30))  # 20 ids, 5 blocks
    assert cache.insert(ids, version=0, kv=kv_of(20))
    query = ids[:13] + (999, 998, 997, 996, 995)
    hit = cache.lookup(query, version=0)
    assert hit is not None and hit.length == 13
    k, v = hit.kv[0]
    assert k.shape == (1, 2, 13, 4) and k[0, 0, :, 0].tolist() == [float(j) for j in range(13)]
    assert torch.equal(v, -k)
    assert cache.lookup(query, version=0, max_length=6).length == 6
    assert cache.lookup((999,) + ids, version=0) is None, "a prompt that differs in its first id reuses nothing"
    assert cache.lookup(ids[:3], version=0) is None, "less than one block never matches"


def test_entries_of_another_weight_version_never_match() -> None:
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    ids = tuple(range(40))
    cache.insert(ids, version=3, kv=kv_of(40))
    assert cache.lookup(ids, version=3) is not None
    assert cache.lookup(ids, version=4) is None
    assert cache.lookup(ids, version=2) is None
    cache.clear()
    assert cache.lookup(ids, version=3) is None and cache.num_tokens == 0 and len(cache) == 0


def test_entries_of_another_scope_never_match() -> None:
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    ids = tuple(range(40))
    cache.insert(ids, version=0, kv=kv_of(40), scope="g:1")
    assert cache.lookup(ids, version=0, scope="g:1") is not None
    assert cache.lookup(ids, version=0, scope="g:2") is None
    assert cache.lookup(ids, version=0) is None  # unscoped is a scope of its own
    # the same ids stored for another scope are another entry; neither replaces the other
    assert cache.insert(ids, version=0, kv=kv_of(40, fill=2.0), scope="g:2")
    assert len(cache) == 2
    hit = cache.lookup(ids, version=0, scope="g:1")
    assert hit is not None and float(hit.kv[0][0][0, 0, 5, 0]) == 5.0  # g:1's own KV (fill 1), not g:2's


def test_lru_bound_evicts_least_recently_used_and_prefixes_are_replaced() -> None:
    cache = PrefixCache(max_tokens=100, block_tokens=4)
    a, b, c = tuple(range(0, 40)), tuple(range(100, 140)), tuple(range(200, 240))
    cache.insert(a, 0, kv_of(40))
    cache.insert(b, 0, kv_of(40))
    assert cache.lookup(a, 0) is not None  # a is now the most recently used
    cache.insert(c, 0, kv_of(40))  # 120 > 100: evict the LRU entry, b
    assert cache.num_tokens == 80 and cache.evictions == 1
    assert cache.lookup(b, 0) is None and cache.lookup(a, 0) is not None and cache.lookup(c, 0) is not None
    # The next turn of `a` (a + more ids) replaces `a`, which is a prefix of it.
    a2 = a + tuple(range(500, 518))
    cache.insert(a2, 0, kv_of(58))
    assert len(cache) == 2 and cache.num_tokens == 98 and cache.lookup(a2, 0).length == 58
    assert not cache.insert(a2[:30], 0, kv_of(30)), "a prefix of a stored entry is not stored again"
    assert not cache.insert(tuple(range(101)), 0, kv_of(101)), "an entry above the bound is not stored"
    assert not PrefixCache(max_tokens=0).insert(a, 0, kv_of(40)), "max_tokens=0 disables the cache"


def test_bad_bounds_raise() -> None:
    with pytest.raises(ValueError, match="max_tokens=-1"):
        PrefixCache(max_tokens=-1)
    with pytest.raises(ValueError, match="block_tokens=0"):
        PrefixCache(max_tokens=10, block_tokens=0)


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path):
    cached = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8, prefix_cache_tokens=4096)
    plain = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8, prefix_cache_tokens=0)
    yield cached, plain
    cached.close()
    plain.close()


def reference_logprobs(model: torch.nn.Module, c: Completion) -> torch.Tensor:
    ids = torch.tensor([[*c.prompt_ids, *c.completion_ids]])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    P = len(c.prompt_ids)
    return lp[P - 1 : -1].gather(-1, torch.tensor(c.completion_ids).unsqueeze(-1)).squeeze(-1)


def test_agent_turns_with_and_without_cache_agree(engines) -> None:  # noqa: ANN001
    cached, plain = engines
    prompt = list(range(1000, 1060))
    hits0, computed0 = cached.stats().prefix_hit_tokens, cached.stats().prefill_tokens
    plain0 = plain.stats().prefill_tokens
    reused = 0
    for turn in range(4):
        a = cached.generate_blocking(prompt, GREEDY)
        b = plain.generate_blocking(prompt, GREEDY)
        assert a.completion_ids == b.completion_ids, f"turn {turn}: greedy ids differ with the cache"
        diff = (torch.tensor(a.completion_logprobs) - torch.tensor(b.completion_logprobs)).abs().max().item()
        assert diff <= 1e-5, f"turn {turn}: logprobs differ by {diff} with the cache"
        if turn > 0:
            reused += len(prompt) - len(tool_output) - 1  # previous prompt + reply, except its last id
        tool_output = [3000 + 7 * turn + j for j in range(15)]
        prompt = [*prompt, *a.completion_ids, *tool_output]
    s = cached.stats()
    assert s.prefix_hit_tokens - hits0 == reused
    assert s.prefill_tokens - computed0 == plain.stats().prefill_tokens - plain0 - reused
    assert s.prefix_cache_tokens > 0


async def test_group_shares_the_task_prompt(engines) -> None:  # noqa: ANN001
    """The prompt of a group's 4 rollouts is computed once: the copies that reached the engine
    with the first are served by its forward (`prefill_shared`), those that came after it find it
    in the prefix cache and compute only its last id (which of the two depends on when the
    decode thread took them: both are counted)."""
    cached, _ = engines
    prompt = list(range(2000, 2090))
    before = cached.stats()
    outs = await asyncio.gather(
        *(cached.generate(prompt, Sampling(temperature=1.0, max_tokens=6, seed=s)) for s in range(4))
    )
    after = cached.stats()
    hits = after.prefix_hits - before.prefix_hits
    shared = after.prefill_shared - before.prefill_shared
    assert hits + shared == 3
    assert after.prefill_tokens - before.prefill_tokens == len(prompt) + hits  # a cache hit computes the last id
    assert len({c.completion_ids for c in outs}) > 1, "seeded rollouts should differ"
    # the step metrics a training run logs: this group's work only
    m = after.step_metrics(before)
    assert m["engine/prefix_hits"] == hits and m["engine/prefill_shared"] == shared and m["engine/prefills"] == 4
    assert m["engine/prefill_tokens"] == len(prompt) + hits
    assert m["engine/prefix_hit_tokens"] == hits * (len(prompt) - 1) + shared * len(prompt)
    reused = hits * 89 + shared * 90
    assert m["engine/prefix_hit_frac"] == pytest.approx(reused / (reused + 90 + hits))
    assert m["engine/generated_tokens"] == sum(len(c.completion_ids) for c in outs)
    assert 1.0 <= m["engine/mean_batch_size"] <= 4.0
    assert m["engine/prefix_cache_tokens"] == after.prefix_cache_tokens > 0


def test_no_cache_hit_after_a_weight_swap(tiny_model_dir: Path) -> None:
    new_weights = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in new_weights.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    prompt = list(range(500, 580))
    with EmbeddedEngine(tiny_model_dir, num_threads=1, prefix_cache_tokens=4096) as eng:
        first = eng.generate_blocking(prompt, GREEDY)
        again = eng.generate_blocking(prompt, GREEDY)
        assert eng.stats().prefix_hits == 1 and again.completion_ids == first.completion_ids
        eng.load_weights(dict(new_weights.state_dict()), version=1)
        assert eng.stats().prefix_cache_tokens == 0, "the swap clears the cache"
        before = eng.stats()
        after = eng.generate_blocking(prompt, GREEDY)
        s = eng.stats()
        assert s.prefix_hits == before.prefix_hits, "a prefix computed with old weights served new ones"
        assert s.prefill_tokens - before.prefill_tokens == len(prompt)
        assert after.policy_version == 1
        ref = reference_logprobs(new_weights, after)
        assert torch.allclose(torch.tensor(after.completion_logprobs), ref, atol=1e-4)


async def test_a_row_admitted_before_a_swap_is_not_cached(tiny_model_dir: Path) -> None:
    state = dict(load_causal_lm(tiny_model_dir).state_dict())
    with EmbeddedEngine(tiny_model_dir, num_threads=1, prefix_cache_tokens=4096) as eng:
        long_run = asyncio.create_task(eng.generate(list(range(700, 740)), Sampling(temperature=0.0, max_tokens=60)))
        while eng.stats().decode_steps < 3:
            await asyncio.sleep(0.002)
        await asyncio.to_thread(eng.load_weights, state, 1)
        done = await long_run
        assert done.policy_version == 0
        assert eng.stats().prefix_cache_tokens == 0, "KV mixing two weight versions was stored"


async def test_chunked_prefill_lets_decoding_rows_move(tiny_model_dir: Path, engines) -> None:  # noqa: ANN001
    long_prompt = list(range(4000, 4200))
    reference = load_causal_lm(tiny_model_dir)

    async def order(chunk: int) -> list[str]:
        finished: list[str] = []
        with EmbeddedEngine(tiny_model_dir, num_threads=1, prefix_cache_tokens=0, prefill_chunk_tokens=chunk) as eng:

            async def run(name: str, prompt: list[int], max_tokens: int) -> Completion:
                c = await eng.generate(prompt, Sampling(temperature=0.0, max_tokens=max_tokens))
                finished.append(name)
                return c

            decoding = asyncio.create_task(run("decoding", [5, 6, 7], 12))
            while eng.stats().decode_steps < 1:
                await asyncio.sleep(0.001)
            long = await run("long", long_prompt, 1)
            await decoding
            chunks = eng.stats().prefill_chunks
        ref = reference_logprobs(reference, long)
        assert torch.allclose(torch.tensor(long.completion_logprobs), ref, atol=1e-4)
        return [*finished, f"chunks={chunks}"]

    # 200 ids in chunks of 8 take 25 iterations, each with a decode step: the 12-id reply ends first.
    assert await order(8) == ["decoding", "long", "chunks=26"]
    # In one chunk the long prompt's prefill and its single id come before the next decode step.
    assert await order(512) == ["long", "decoding", "chunks=2"]


def test_bad_engine_knobs_raise(tiny_model_dir: Path) -> None:
    with pytest.raises(EngineError, match="prefix_cache_tokens=-1"):
        EmbeddedEngine(tiny_model_dir, prefix_cache_tokens=-1)
    with pytest.raises(EngineError, match="prefill_chunk_tokens=0"):
        EmbeddedEngine(tiny_model_dir, prefill_chunk_tokens=0)


async def test_waiting_prompts_prefill_together_with_and_without_cached_prefixes(engines) -> None:  # noqa: ANN001
    """Requests waiting together are prefilled in one forward (rows with a cached prefix and
    rows without it mixed); ids and logprobs equal the engine without the cache, whose
    batch of fresh prompts is prefilled together too, within 1e-5."""
    cached, plain = engines
    base = list(range(4000, 4070))
    cached.generate_blocking(base, GREEDY)  # cached now: base (+ its completion)
    prompts = [
        [*base, 11, 12, 13],  # extends a cached prompt: only its tail is new
        list(range(5000, 5033)),  # fresh
        [*base[:40], 21, 22, 23, 24, 25],  # shares 40 ids (2+ blocks) with the cached entry
        list(range(6000, 6005)),  # fresh and short
    ]
    before_c, before_p = cached.stats(), plain.stats()
    got = await asyncio.gather(*(cached.generate(p, GREEDY) for p in prompts))
    want = await asyncio.gather(*(plain.generate(p, GREEDY) for p in prompts))
    after_c, after_p = cached.stats(), plain.stats()
    assert after_c.prefill_batches - before_c.prefill_batches >= 1
    assert after_p.prefill_batches - before_p.prefill_batches >= 1
    assert after_c.prefix_hits - before_c.prefix_hits >= 2
    assert after_c.prefill_tokens - before_c.prefill_tokens < after_p.prefill_tokens - before_p.prefill_tokens
    for g, w in zip(got, want, strict=True):
        assert g.completion_ids == w.completion_ids
        assert g.completion_logprobs == pytest.approx(w.completion_logprobs, abs=1e-5)


async def test_the_cache_is_no_channel_between_groups(tiny_model_dir: Path) -> None:
    """Attack: a session of one group sends a prompt; a session of another group sends the same
    prompt to time it (a cached prefix comes back several times faster, so the victim could read
    the attacker's bits). Keyed by group, the second group computes the prompt afresh (no prefix
    hit, no shared prefill); a member of the first group still reuses it."""
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8, prefix_cache_tokens=4096)
    try:
        secret = list(range(3000, 3080))
        await eng.generate(secret, GREEDY, affinity="attacker", cache_scope="g:1")
        before = eng.stats()
        await eng.generate(secret, GREEDY, affinity="victim", cache_scope="g:2")
        after = eng.stats()
        assert after.prefix_hits == before.prefix_hits and after.prefix_hit_tokens == before.prefix_hit_tokens
        assert after.prefill_tokens - before.prefill_tokens == len(secret)
        await eng.generate(secret, GREEDY, affinity="sibling", cache_scope="g:1")
        assert eng.stats().prefix_hits == after.prefix_hits + 1
        # sent at once, identical prompts of two groups are not computed as one either
        before = eng.stats()
        fresh = list(range(4000, 4060))
        await asyncio.gather(eng.generate(fresh, GREEDY, affinity="a", cache_scope="g:3"),
                             eng.generate(fresh, GREEDY, affinity="b", cache_scope="g:4"))
        after = eng.stats()
        assert after.prefill_shared == before.prefill_shared and after.prefix_hits == before.prefix_hits
        assert after.prefill_tokens - before.prefill_tokens == 2 * len(fresh)
    finally:
        eng.close()

"""EmbeddedEngine against a naive forward pass, plus its sampling, finishing, batching and errors.

The tiny random Llama gives near-uniform distributions, so sampled ids are varied and
seeds matter; EOS and stop strings are made to fire by choosing them from a first run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from harnessrl.engine.base import Engine
from harnessrl.engine.embedded.engine import EmbeddedEngine
from harnessrl.engine.model_store import load_causal_lm, load_tokenizer, resolve_model
from harnessrl.engine.embedded.sampler import RowSampling, filter_logprobs, sample_next
from harnessrl.engine.embedded.stop import StopWatcher
from harnessrl.errors import ContextLengthError, EngineError
from harnessrl.types import Completion, Sampling

PROMPTS = [list(range(100, 103)), list(range(200, 219)), list(range(300, 341)), [7]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path):
    return load_causal_lm(tiny_model_dir)


def reference_logprobs(model: torch.nn.Module, c: Completion, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each completion id from one plain forward pass."""
    ids = torch.tensor([[*c.prompt_ids, *c.completion_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    P = len(c.prompt_ids)
    return lp[P - 1 : -1].gather(-1, torch.tensor(c.completion_ids).unsqueeze(-1)).squeeze(-1)


def check_faithful(c: Completion, prompt: list[int]) -> None:
    assert c.prompt_ids == tuple(prompt)
    assert len(c.completion_ids) == len(c.completion_logprobs) > 0
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.completion_logprobs)


def test_satisfies_engine_protocol(engine: EmbeddedEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.max_context_tokens == 8192  # tiny config: max_position_embeddings=8192
    assert engine.eos_token_ids == (2,)  # <|im_end|> of the SmolLM2 tokenizer


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_logprob_parity_single_and_concurrent(
    engine: EmbeddedEngine, reference_model: torch.nn.Module, temperature: float
) -> None:
    sampling = Sampling(temperature=temperature, max_tokens=12, seed=3)
    single = await engine.generate(PROMPTS[1], sampling)
    steps_before = engine.stats().batched_steps
    many = await asyncio.gather(*(engine.generate(p, sampling) for p in PROMPTS))
    assert engine.stats().batched_steps > steps_before, "concurrent requests never shared a decode step"
    for c, prompt in zip([single, *many], [PROMPTS[1], *PROMPTS]):
        check_faithful(c, prompt)
        assert c.finish_reason == "length" and len(c.completion_ids) == 12
        ref = reference_logprobs(reference_model, c, temperature)
        assert torch.allclose(torch.tensor(c.completion_logprobs), ref, atol=1e-4), (c.completion_logprobs, ref)
    # Same seed, same prompt: batching with other rows does not change the sampled ids.
    assert many[1].completion_ids == single.completion_ids
    if temperature == 0.0:
        with torch.no_grad():
            greedy = [
                int(torch.argmax(reference_model(torch.tensor([[*PROMPTS[1], *single.completion_ids[:k]]])).logits[0, -1]))
                for k in range(3)
            ]
        assert list(single.completion_ids[:3]) == greedy


async def test_seeded_sampling_is_reproducible(engine: EmbeddedEngine) -> None:
    a = await engine.generate(PROMPTS[0], Sampling(temperature=1.0, max_tokens=16, seed=11))
    b = await engine.generate(PROMPTS[0], Sampling(temperature=1.0, max_tokens=16, seed=11))
    c = await engine.generate(PROMPTS[0], Sampling(temperature=1.0, max_tokens=16, seed=12))
    assert a.completion_ids == b.completion_ids and a.completion_logprobs == b.completion_logprobs
    assert a.completion_ids != c.completion_ids


async def test_top_k_top_p_logprobs_are_renormalised(
    engine: EmbeddedEngine, reference_model: torch.nn.Module
) -> None:
    c = await engine.generate(PROMPTS[2], Sampling(temperature=0.8, top_k=5, top_p=0.9, max_tokens=6, seed=1))
    check_faithful(c, PROMPTS[2])
    ids = torch.tensor([[*c.prompt_ids, *c.completion_ids]])
    with torch.no_grad():
        logits = reference_model(ids).logits[0]
    P = len(c.prompt_ids)
    for t, (tok, lp) in enumerate(zip(c.completion_ids, c.completion_logprobs)):
        full = torch.log_softmax(logits[P - 1 + t] / 0.8, dim=-1)
        top5 = torch.topk(full, 5)
        assert tok in top5.indices.tolist()
        # The logprob is that of the T=0.8 distribution renormalised over the top-k/top-p set.
        kept = filter_logprobs(full, 5, 0.9)
        assert lp == pytest.approx(float(kept[tok]), abs=1e-4)
        assert lp > float(full[tok])  # renormalising over a subset raises the logprob


def test_filter_logprobs_hand_values() -> None:
    lp = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    # top-p 0.6: mass before id1 = 0.5 < 0.6 (kept), before id2 = 0.8 >= 0.6 (dropped);
    # renormalised: 0.5/0.8 = 0.625, 0.3/0.8 = 0.375.
    out = filter_logprobs(lp, 0, 0.6).exp()
    assert torch.allclose(out, torch.tensor([0.625, 0.375, 0.0]), atol=1e-6)
    # top-k 1 keeps the argmax with probability 1.
    assert torch.allclose(filter_logprobs(lp, 1, 1.0).exp(), torch.tensor([1.0, 0.0, 0.0]))
    # top-k 2 then top-p 0.5: 0.5/0.8 = 0.625 >= 0.5, so only id0 survives.
    assert torch.allclose(filter_logprobs(lp, 2, 0.5).exp(), torch.tensor([1.0, 0.0, 0.0]))
    # Greedy: argmax, logprob of the T=1 distribution = log 0.5.
    ids, lps = sample_next(lp.unsqueeze(0), [RowSampling(0.0)], [torch.Generator()])
    assert ids == [0] and lps[0] == pytest.approx(math.log(0.5), abs=1e-6)


@pytest.mark.parametrize("scale", [0.5, 8.0])  # near-uniform (full sort) and peaked (top-1024 path)
def test_top_p_matches_a_full_sort_reference(scale: float) -> None:
    lp = torch.log_softmax(torch.randn(5000, generator=torch.Generator().manual_seed(1)) * scale, dim=-1)
    probs, order = torch.sort(lp.exp().double(), descending=True)
    kept, mass = [], 0.0
    for p_i, i in zip(probs.tolist(), order.tolist()):  # smallest prefix reaching 0.9
        kept.append(i)
        mass += p_i
        if mass >= 0.9:
            break
    out = filter_logprobs(lp, 0, 0.9)
    assert sorted(torch.nonzero(torch.isfinite(out)).squeeze(-1).tolist()) == sorted(kept)
    assert float(torch.logsumexp(out, dim=-1)) == pytest.approx(0.0, abs=1e-5)
    if scale == 8.0:
        assert len(kept) < 1024, "the peaked case must exercise the fast path"


def test_max_tokens_clipped_to_context(tiny_model_dir: Path) -> None:
    with EmbeddedEngine(tiny_model_dir, num_threads=1, max_context_tokens=24) as eng:
        c = eng.generate_blocking(list(range(10, 30)), Sampling(temperature=0.0, max_tokens=100), timeout_s=60)
        assert len(c.completion_ids) == 4 and c.finish_reason == "length"
        with pytest.raises(ContextLengthError, match="len\\(prompt_ids\\)=24"):
            eng.generate_blocking(list(range(10, 34)), Sampling(max_tokens=1))


def test_bad_inputs_raise(engine: EmbeddedEngine) -> None:
    with pytest.raises(EngineError, match="empty"):
        engine.generate_blocking([], Sampling())
    with pytest.raises(EngineError, match=r"prompt_ids\[1\]=-1"):
        engine.generate_blocking([5, -1], Sampling())
    vocab = len(load_tokenizer(resolve_model("tiny-random")))
    with pytest.raises(EngineError, match=rf"prompt_ids\[0\]={vocab} "):
        engine.generate_blocking([vocab], Sampling())
    with pytest.raises(EngineError, match="unknown parameter names"):
        engine.load_weights({"not.a.weight": torch.zeros(1)}, version=1)
    assert engine.policy_version == 0


def _copy_with_eos(src: Path, dst: Path, eos: list[int]) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, dst / f.name)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_any_of_several_eos_ids_stops(engine: EmbeddedEngine, tiny_model_dir: Path, tmp_path: Path) -> None:
    sampling = Sampling(temperature=1.0, max_tokens=20, seed=5)
    free = engine.generate_blocking(PROMPTS[2], sampling)
    target = free.completion_ids[6]
    k = free.completion_ids.index(target)  # first occurrence
    model_dir = _copy_with_eos(tiny_model_dir, tmp_path / "m", [2, target])
    with EmbeddedEngine(model_dir, num_threads=1) as eng:
        assert eng.eos_token_ids == (2, target)
        c = eng.generate_blocking(PROMPTS[2], sampling)
    assert c.completion_ids == free.completion_ids[: k + 1]  # the EOS id is included
    assert c.finish_reason == "stop"
    assert c.completion_logprobs == pytest.approx(free.completion_logprobs[: k + 1], abs=1e-5)


def test_stop_string_ends_generation_keeping_ids(engine: EmbeddedEngine, tokenizer) -> None:  # noqa: ANN001
    sampling = Sampling(temperature=1.0, max_tokens=24, seed=9)
    free = engine.generate_blocking(PROMPTS[1], sampling)
    ids = list(free.completion_ids)
    stop = next(s for s in (tokenizer.decode([t]).strip() for t in ids[8:]) if len(s) >= 2)
    k = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    c = engine.generate_blocking(PROMPTS[1], sampling.model_copy(update={"stop": (stop,)}))
    assert c.completion_ids == tuple(ids[: k + 1])
    assert c.finish_reason == ("length" if k + 1 == 24 else "stop")


async def test_request_joins_mid_generation(engine: EmbeddedEngine, reference_model: torch.nn.Module) -> None:
    long_task = asyncio.create_task(engine.generate(PROMPTS[2], Sampling(temperature=0.0, max_tokens=60)))
    start = engine.stats()
    while engine.stats().decode_steps < start.decode_steps + 5:
        await asyncio.sleep(0.002)
    short = await engine.generate(PROMPTS[0], Sampling(temperature=0.7, max_tokens=8, seed=4))
    assert not long_task.done(), "the long request should still be running when the short one finishes"
    long = await long_task
    assert engine.stats().batched_steps >= start.batched_steps + 7  # the short one decoded 7 steps alongside
    assert len(long.completion_ids) == 60 and len(short.completion_ids) == 8
    for c, t in ((long, 0.0), (short, 0.7)):
        ref = reference_logprobs(reference_model, c, t)
        assert torch.allclose(torch.tensor(c.completion_logprobs), ref, atol=1e-4)


async def test_cancelled_request_leaves_the_batch(engine: EmbeddedEngine) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(engine.generate(PROMPTS[0], Sampling(max_tokens=5000)), timeout=0.3)
    batched_before = engine.stats().batched_steps
    c = await engine.generate(PROMPTS[3], Sampling(temperature=0.0, max_tokens=3))
    assert len(c.completion_ids) == 3
    assert engine.stats().batched_steps == batched_before, "the cancelled request kept decoding"


def test_blocking_calls_from_threads_batch_together(engine: EmbeddedEngine) -> None:
    sampling = Sampling(temperature=0.0, max_tokens=20)
    batched_before = engine.stats().batched_steps
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        done = list(pool.map(lambda p: engine.generate_blocking(p, sampling, timeout_s=60), PROMPTS[:3]))
    for c, p in zip(done, PROMPTS[:3]):
        check_faithful(c, p)
        assert c.completion_ids == engine.generate_blocking(p, sampling).completion_ids
    assert engine.stats().batched_steps > batched_before


def test_stop_watcher_handles_split_characters(tokenizer) -> None:  # noqa: ANN001
    text = "naïve café 🙂 done. END here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    watcher = StopWatcher(tokenizer, ["END"])
    hits = [watcher.push(t) for t in ids]
    first = hits.index(True)
    assert "END" in tokenizer.decode(ids[: first + 1]) and "END" not in tokenizer.decode(ids[:first])
    assert watcher.text == text
    assert "\ufffd" not in watcher.text


async def test_load_weights_bumps_version_and_changes_outputs(tiny_model_dir: Path) -> None:
    trainer_copy = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in trainer_copy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    sampling = Sampling(temperature=0.0, max_tokens=8)
    with EmbeddedEngine(tiny_model_dir, num_threads=1) as eng:
        in_flight = asyncio.create_task(eng.generate(PROMPTS[2], Sampling(temperature=0.0, max_tokens=400)))
        while eng.stats().decode_steps < 3:
            await asyncio.sleep(0.002)
        before = await eng.generate(PROMPTS[1], sampling)
        await asyncio.to_thread(eng.load_weights, dict(trainer_copy.state_dict()), 7)
        assert eng.policy_version == 7 and eng.stats().weight_loads == 1
        after = await eng.generate(PROMPTS[1], sampling)
        swapped = await in_flight
    assert before.policy_version == 0 and after.policy_version == 7
    assert swapped.policy_version == 0, "an in-flight request keeps its admission version"
    assert after.completion_logprobs != before.completion_logprobs
    ref = reference_logprobs(trainer_copy, after, 0.0)
    assert torch.allclose(torch.tensor(after.completion_logprobs), ref, atol=1e-4)


def test_close_is_idempotent_and_rejects_new_work(tiny_model_dir: Path) -> None:
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1)
    eng.close()
    eng.close()
    assert not eng._thread.is_alive()
    with pytest.raises(EngineError, match="closed"):
        eng.generate_blocking([1, 2], Sampling())


@pytest.mark.e2e
def test_smollm2_greedy_chat_reply() -> None:
    model_dir = resolve_model("smollm2-135m")
    tok = load_tokenizer(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    with EmbeddedEngine(model_dir, num_threads=1) as eng:
        c = eng.generate_blocking(list(prompt), Sampling(temperature=0.0, max_tokens=40), timeout_s=120)
    check_faithful(c, list(prompt))
    text = tok.decode(list(c.completion_ids), skip_special_tokens=True)
    letters = sum(ch.isascii() and ch.isalpha() for ch in text)
    assert len(text.split()) >= 3 and letters / len(text) > 0.6, text
    assert "Paris" in text, text
    assert c.finish_reason == "length" or c.completion_ids[-1] in eng.eos_token_ids


def test_device_is_checked_before_the_model_loads(tiny_model_dir: Path) -> None:
    with pytest.raises(EngineError, match="device='tpu' is not 'cpu' or 'cuda'"):
        EmbeddedEngine(tiny_model_dir, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="device='cuda' but torch sees no CUDA device"):
            EmbeddedEngine(tiny_model_dir, device="cuda")
    from harnessrl.config import load_config

    assert load_config(None, ['engine.device="cuda"']).engine.device == "cuda"  # bench/gpu_check.py runs it


async def test_busy_seconds_count_work_not_waiting(engine: EmbeddedEngine) -> None:
    import time

    before = engine.stats().busy_seconds
    await asyncio.sleep(0.3)  # idle: the decode thread blocks on its queue
    assert engine.stats().busy_seconds == before
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.generate(p, Sampling(temperature=0.0, max_tokens=8)) for p in PROMPTS))
    wall = time.perf_counter() - t0
    busy = engine.stats().busy_seconds - before
    assert 0.0 < busy <= wall
    assert engine.stats().step_metrics(engine.stats())["engine/busy_seconds"] == 0.0


# -- fairness between sessions (issue 47: a session flooding the engine, a session that ended) ----------


async def test_a_flooding_session_does_not_hold_a_siblings_call_back(tiny_model_dir: Path) -> None:
    """Attack: one session sends 16 long calls with distinct 200-token prompts, then a sibling sends
    a 4-token call. First in, first out, the attacker's calls filled the batch and the sibling
    waited for one of them to finish; admitted round robin with at most 2 rows per session, the
    sibling's call is served before any attacker call finishes (order of service, not seconds)."""
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8, max_rows_per_session=2)
    try:
        finished: list[str] = []

        async def call(who: str, prompt: list[int], max_tokens: int) -> Completion:
            c = await eng.generate(prompt, Sampling(temperature=0.0, max_tokens=max_tokens), affinity=who)
            finished.append(who)
            return c

        attackers = [asyncio.create_task(call("attacker", [1000 + 200 * i + j for j in range(200)], 40))
                     for i in range(16)]
        while eng.stats().decode_steps < 2:  # the attacker's calls are queued and decoding
            await asyncio.sleep(0.002)
        sibling = await call("sibling", [5, 6, 7, 8], 1)
        assert len(sibling.completion_ids) == 1
        assert "attacker" not in finished, f"the sibling's call was served after {finished.count('attacker')} " \
                                            "of the attacker's calls had finished"
        assert eng.stats().max_batch_size_seen <= 3  # the attacker's 2 rows and the sibling's
        await asyncio.gather(*attackers)
    finally:
        eng.close()


async def test_a_siblings_short_call_does_not_wait_for_a_flooding_sessions_long_prompts(tiny_model_dir: Path) -> None:
    """Attack: one session sends 4 calls with distinct 4,000-token prompts (8 chunks of prefill
    each), a sibling a 4-token prompt once the first is being prefilled. The sibling's prompt
    goes before the rest of the long one, and while the sibling decodes, the attacker's chunks
    are a quarter of the budget (its 4 calls share it): the sibling's 8 ids are all sampled
    before any attacker call finishes (before: after the prompt in progress, then a full chunk
    before each of its ids)."""
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8, prefill_chunk_tokens=512)
    try:
        finished: list[str] = []

        async def call(who: str, prompt: list[int], max_tokens: int) -> None:
            await eng.generate(prompt, Sampling(temperature=0.0, max_tokens=max_tokens), affinity=who)
            finished.append(who)

        attackers = [asyncio.create_task(call("attacker", [1000 + 4000 * i + j for j in range(4000)], 1))
                     for i in range(4)]
        while eng.stats().prefill_chunks < 1:
            await asyncio.sleep(0.001)
        await call("sibling", [5, 6, 7, 8], 8)
        assert finished == ["sibling"], f"finished before the sibling: {finished[:-1]}"
        await asyncio.gather(*attackers)
    finally:
        eng.close()


def test_fair_order_is_round_robin_and_bounds_a_sessions_rows() -> None:
    from harnessrl.engine.embedded.prefill import fair_order
    from harnessrl.engine.embedded.request import Request
    from harnessrl.engine.embedded.sampler import RowSampling

    def req(who: str | None, n: int) -> Request:
        r = Request((n,), Sampling(), 1, lambda _: None, RowSampling(1.0, 1.0, 0), None)
        r.affinity = who
        return r

    waiting = [req("a", 1), req("a", 2), req("a", 3), req("b", 4), req(None, 5), req("b", 6), req("c", 7)]
    order, held = fair_order(waiting, {"a": 1}, max_rows=2)
    # a holds 1 row: its first waiting call ranks 1, its second 2 (held); b, c and the unkeyed rank 0
    assert [r.prompt_ids[0] for r in order] == [4, 5, 7, 1, 6]
    assert [r.prompt_ids[0] for r in held] == [2, 3]
    order, held = fair_order(waiting, {}, max_rows=None)
    assert [r.prompt_ids[0] for r in order] == [1, 4, 5, 7, 2, 6, 3] and held == []


async def test_forget_cancels_the_sessions_generation(tiny_model_dir: Path) -> None:
    """Attack: an agent starts a long generation and its session is closed (the agent exited).
    The engine stops decoding it within a step: the tokens decoded after `forget` are at most 2
    (before: the whole `max_tokens`, 3000 here), the caller gets `EngineError`; a sibling
    session's call decodes to its end."""
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8)
    try:
        gone = asyncio.create_task(eng.generate([9, 10, 11], Sampling(temperature=0.0, max_tokens=3000),
                                                affinity="gone"))
        while eng.stats().generated_tokens < 20:
            await asyncio.sleep(0.002)
        eng.forget("gone")
        at_forget = eng.stats().generated_tokens
        with pytest.raises(EngineError, match="session gone ended"):
            await asyncio.wait_for(gone, timeout=60)
        await asyncio.sleep(0.2)
        assert eng.stats().generated_tokens - at_forget <= 2
        assert eng.stats().cancelled_requests == 1

        other = asyncio.create_task(eng.generate([12, 13], Sampling(temperature=0.0, max_tokens=200),
                                                 affinity="other"))
        again = asyncio.create_task(eng.generate([9, 10, 11], Sampling(temperature=0.0, max_tokens=3000),
                                                 affinity="again"))
        while eng.stats().generated_tokens < at_forget + 20:
            await asyncio.sleep(0.002)
        eng.forget("again")
        with pytest.raises(EngineError):
            await asyncio.wait_for(again, timeout=60)
        assert len((await other).completion_ids) == 200  # the sibling's call is untouched
    finally:
        eng.close()

"""engine/embedded/decode_step.py against the model's own forward: same logits, same greedy ids, weights
loaded through the model reach the fused projections, unknown architectures left alone."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from harnessrl.engine.embedded import decode_step
from harnessrl.engine.embedded.batch import KVBatch
from harnessrl.engine.embedded.decode_step import DecodeStep
from harnessrl.engine.embedded.engine import EmbeddedEngine
from harnessrl.engine.model_store import load_causal_lm
from harnessrl.types import Sampling

PROMPTS = [list(range(100, 103)), list(range(200, 231)), list(range(300, 317)), [7, 8]]


def _batch(model: torch.nn.Module, prompts: list[list[int]]) -> KVBatch:
    """A left-padded KV batch of `prompts` prefilled one by one with the model's forward."""
    rows = []
    with torch.inference_mode():
        for p in prompts:
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([p]), cache=cache, use_cache=True)
            rows.append(([(ly.keys, ly.values) for ly in cache.layers], len(p), int(out.logits[0, -1].argmax())))
    batch = KVBatch()
    batch.add_rows(rows)
    return batch


def _steps_agree(model: torch.nn.Module, steps: int = 6, step: DecodeStep | None = None) -> None:
    """Greedy decode steps through the model's forward and through DecodeStep, from one prefill."""
    ref_batch, fast_batch = _batch(model, PROMPTS), _batch(model, PROMPTS)
    step = step if step is not None else DecodeStep.for_model(model)
    assert step is not None
    with torch.inference_mode():
        for _ in range(steps):
            inputs = ref_batch.step_inputs()
            want = model(**inputs, use_cache=True).logits[:, -1, :]
            f = fast_batch.step_inputs()
            got = step(f["input_ids"][:, 0], f["position_ids"][:, 0], f["attention_mask"], fast_batch.cache.layers)
            assert got.shape == want.shape
            diff = (got - want).abs().max().item()
            assert diff <= 1e-5, f"logits differ by {diff}"
            ids = want.argmax(-1).tolist()
            assert got.argmax(-1).tolist() == ids
            ref_batch.commit_step(ids)
            fast_batch.commit_step(ids)


def _perturbed_state(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights, each moved by noise of std 0.05 drawn with `seed`."""
    new = load_causal_lm(model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return dict(new.state_dict())


@contextlib.contextmanager
def _packed_and_plain(model_dir: Path) -> Iterator[tuple[EmbeddedEngine, EmbeddedEngine]]:
    """An engine decoding through packed weight copies and one through the model's forward;
    skips where oneDNN's packed inner products are not available."""
    with (EmbeddedEngine(model_dir, num_threads=1, prefix_cache_tokens=0) as eng,
          EmbeddedEngine(model_dir, num_threads=1, prefix_cache_tokens=0, fast_decode=False) as plain):
        assert eng._step is not None
        if not eng._step.packed:
            pytest.skip("oneDNN packed inner products are not available here")
        yield eng, plain


def test_llama_step_equals_the_model_forward(tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _steps_agree(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "fusing changed a weight"


def test_packed_weights_are_rebuilt_by_refresh(tiny_model_dir: Path) -> None:
    """The packed copies do not follow writes into the model; `refresh` (what the engine calls
    after `load_weights`) rebuilds them, and unpacked steps agree with the model too."""
    model = load_causal_lm(tiny_model_dir)
    _steps_agree(model, steps=2, step=DecodeStep.for_model(model, pack_weights=False))
    step = DecodeStep.for_model(model)  # fuses anew: the step built last is the one that follows the model
    assert step is not None
    if not step.packed:
        pytest.skip("oneDNN packed inner products are not available here")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                t.add_(torch.randn(t.shape, generator=gen) * 0.05)
    with pytest.raises(AssertionError, match="logits differ"):
        _steps_agree(model, steps=1, step=step)
    step.refresh()
    _steps_agree(model, step=step)


def test_qwen2_step_with_qkv_biases_equals_the_model_forward() -> None:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for lin in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].self_attn.v_proj):
            lin.bias.normal_(0, 0.5)  # non-zero biases, so a dropped bias would show
    _steps_agree(model)


def test_architectures_not_handled_are_left_to_transformers() -> None:
    base = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2)
    assert DecodeStep.for_model(LlamaForCausalLM(LlamaConfig(**base, hidden_act="gelu"))) is None
    assert DecodeStep.for_model(LlamaForCausalLM(LlamaConfig(**base, mlp_bias=True))) is None
    assert DecodeStep.for_model(torch.nn.Linear(2, 2)) is None
    sliding = Qwen2Config(**base, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert DecodeStep.for_model(Qwen2ForCausalLM(sliding)) is None


async def test_engine_with_and_without_the_step_agree(tiny_model_dir: Path) -> None:
    samplings = [Sampling(temperature=0.0, max_tokens=20), Sampling(temperature=0.8, max_tokens=20, seed=5),
                 Sampling(temperature=1.0, top_p=0.9, max_tokens=20, seed=6), Sampling(temperature=0.0, max_tokens=9)]
    with (EmbeddedEngine(tiny_model_dir, num_threads=1, prefix_cache_tokens=0) as fast,
          EmbeddedEngine(tiny_model_dir, num_threads=1, prefix_cache_tokens=0, fast_decode=False) as plain):
        assert fast._step is not None and plain._step is None
        got = await asyncio.gather(*(fast.generate(p, s) for p, s in zip(PROMPTS, samplings, strict=True)))
        want = await asyncio.gather(*(plain.generate(p, s) for p, s in zip(PROMPTS, samplings, strict=True)))
        assert fast.stats().batched_steps > 0
        for g, w in zip(got, want, strict=True):
            assert g.completion_ids == w.completion_ids
            assert g.completion_logprobs == pytest.approx(w.completion_logprobs, abs=1e-5)

        # weights loaded through the engine reach the fused projections
        state = _perturbed_state(tiny_model_dir, 2)
        await asyncio.to_thread(fast.load_weights, state, 1)
        await asyncio.to_thread(plain.load_weights, state, 1)
        g2 = await fast.generate(PROMPTS[1], samplings[0])
        w2 = await plain.generate(PROMPTS[1], samplings[0])
        assert g2.completion_ids == w2.completion_ids and g2.completion_ids != got[1].completion_ids
        assert g2.completion_logprobs == pytest.approx(w2.completion_logprobs, abs=1e-5)


def test_engine_falls_back_to_unpacked_weights_when_a_rebuild_fails(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed rebuild of the packed copies after `load_weights` leaves the engine serving the
    new weights through `F.linear`, not the stale copies."""
    sampling = Sampling(temperature=0.0, max_tokens=12)
    state = _perturbed_state(tiny_model_dir, 4)
    with _packed_and_plain(tiny_model_dir) as (eng, plain):
        step = eng._step
        assert step is not None
        real_pack = decode_step._pack
        calls = []

        def failing_pack(w: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("out of memory (simulated)")
            return real_pack(w)

        monkeypatch.setattr(decode_step, "_pack", failing_pack)
        eng.load_weights(state, 1)
        plain.load_weights(state, 1)
        got = eng.generate_blocking(PROMPTS[1], sampling)
        assert calls and not step.packed
        want = plain.generate_blocking(PROMPTS[1], sampling)
        assert got.completion_ids == want.completion_ids and got.policy_version == 1
        assert got.completion_logprobs == pytest.approx(want.completion_logprobs, abs=1e-5)



def test_engine_pack_weights_of_the_config_reaches_the_decode_step(tiny_model_dir: Path) -> None:
    """`engine.pack_weights = false` builds the engine's decode step without packed copies; the
    default packs them (where oneDNN's packed inner products exist)."""
    from harnessrl.engine.config import EmbeddedEngineConfig
    from harnessrl.runtime import make_engine

    for pack in (True, False):
        cfg = EmbeddedEngineConfig(model=str(tiny_model_dir), pack_weights=pack, prefix_cache_tokens=0)
        engine = make_engine(cfg, tiny_model_dir, seed=0)
        assert isinstance(engine, EmbeddedEngine)
        try:
            step = engine._step
            assert step is not None
            if pack and not step.packed:
                pytest.skip("oneDNN packed inner products are not available here")
            assert step.packed is pack
        finally:
            engine.close()


def test_a_probe_scored_right_after_a_load_does_not_wait_for_the_packed_rebuild(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weight-sync canary's `prompt_logprobs`, sent as `load_weights` returns, is scored
    between two layers of the packed copies' rebuild (with the new weights), not after it; a
    second load during a rebuild starts it over, and the decode steps after it serve the last
    weights through packed copies."""
    sampling = Sampling(temperature=0.0, max_tokens=12)
    states = [_perturbed_state(tiny_model_dir, seed) for seed in (5, 6)]
    with _packed_and_plain(tiny_model_dir) as (eng, plain):
        assert eng._step is not None
        real_pack = decode_step._pack
        packs: list[float] = []

        def slow_pack(w: torch.Tensor) -> torch.Tensor:
            time.sleep(0.1)
            packs.append(time.monotonic())
            return real_pack(w)

        monkeypatch.setattr(decode_step, "_pack", slow_pack)
        probe = PROMPTS[1]
        eng.load_weights(states[0], 1)
        got = eng.prompt_logprobs(probe)
        scored_at = time.monotonic()
        plain.load_weights(states[0], 1)
        assert got == pytest.approx(plain.prompt_logprobs(probe), abs=1e-5)
        per_rebuild = 4 * len(eng._step._layers) + 1
        deadline = time.monotonic() + 30
        while len(packs) < per_rebuild and time.monotonic() < deadline:  # the rebuild goes on after the probe
            time.sleep(0.05)
        assert 0 < sum(t > scored_at for t in packs) < per_rebuild, \
            f"the probe was scored after {len(packs)} of {per_rebuild} packs"

        eng.load_weights(states[1], 2)  # lands while the probe's rebuild may still run
        eng.load_weights(states[0], 3)
        plain.load_weights(states[0], 3)
        out = eng.generate_blocking(PROMPTS[2], sampling)
        assert eng._step.packed
        want = plain.generate_blocking(PROMPTS[2], sampling)
        assert out.policy_version == 3
        assert out.completion_ids == want.completion_ids
        assert out.completion_logprobs == pytest.approx(want.completion_logprobs, abs=1e-5)

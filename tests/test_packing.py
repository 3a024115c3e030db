"""Packing plan, row isolation inside a pack, logprob parity and exact gradient accumulation."""

from __future__ import annotations

import dataclasses
import contextlib
import random
from pathlib import Path

import pytest
import torch

from harnessrl.loss.losses import PpoClipLoss, ppo_clip_loss
from harnessrl.train.packing import (
    MIN_SHARED_TOKENS,
    SEGMENT_ATTENTION,
    compute_trainer_logprobs,
    loss_inputs,
    pack_rows,
    plan_micro_batches,
    segment_bounds,
    token_logprobs,
    unshare,
)
from harnessrl.types import Row


def _row(ids: list[int], n_prompt: int, advantage: float = 0.0, lp: float = -1.0) -> Row:
    n = len(ids)
    mask = tuple(0 if t < n_prompt else 1 for t in range(n))
    return Row(
        input_ids=tuple(ids),
        completion_mask=mask,
        sampler_logprobs=tuple(lp if m else 0.0 for m in mask),
        policy_versions=tuple(3 if m else -1 for m in mask),
        rollout_id="r",
        group_id=0,
        advantage=advantage,
    )


def _random_rows(n_rows: int, seed: int, vocab: int = 49152) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for k in range(n_rows):
        n = rng.randint(6, 40)
        ids = [rng.randrange(vocab) for _ in range(n)]
        rows.append(_row(ids, n_prompt=rng.randint(2, n - 2), advantage=(-1.0) ** k * (0.5 + k / 10)))
    return rows


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request: pytest.FixtureRequest, tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, attn_implementation=request.param
    )
    m.eval()
    return m


def test_ffd_plan_places_longest_first_into_first_fit() -> None:
    # sorted: 5(i0) 4(i1) 3(i2) 3(i3) 2(i4) 1(i5); budget 8:
    # 5->bin0(room 3), 4->bin1(4), 3->bin0(0), 3->bin1(1), 2->bin2(6), 1->bin1(0)
    plan = plan_micro_batches([5, 4, 3, 3, 2, 1], token_budget=8)
    assert plan.bins == ((0, 2), (1, 3, 5), (4,))
    assert plan.num_oversized == 0


def test_oversized_row_gets_its_own_micro_batch_and_is_counted() -> None:
    plan = plan_micro_batches([3, 10, 4], token_budget=8)
    assert plan.bins == ((1,), (2, 0))
    assert plan.num_oversized == 1
    with pytest.raises(ValueError, match="token_budget=0"):
        plan_micro_batches([1], token_budget=0)


def test_pack_rows_resets_positions_and_keeps_row_fields() -> None:
    rows = [_row([1, 2, 3, 4], 2, advantage=0.5), _row([5, 6, 7], 1, advantage=-2.0)]
    (packed,) = pack_rows(rows, token_budget=16)
    assert packed.row_indices == (0, 1)
    assert packed.input_ids_T.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert packed.position_ids_T.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert packed.mask_T.tolist() == [False, False, True, True, False, True, True]
    assert packed.sampler_logprobs_T.tolist() == [0, 0, -1, -1, 0, -1, -1]
    assert packed.advantages_T.tolist() == [0.5] * 4 + [-2.0] * 3
    assert packed.seq_ids_T.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert packed.policy_versions_T.tolist() == [-1, -1, 3, 3, -1, 3, 3]
    assert packed.num_trained_tokens == 4


def _full_logprobs(model: torch.nn.Module, ids: list[int], temperature: float) -> torch.Tensor:
    """Naive reference: full-vocab log_softmax at every position of a lone sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def test_row_inside_pack_matches_row_alone(model: torch.nn.Module) -> None:
    rows = _random_rows(5, seed=1)
    (packed,) = pack_rows(rows, token_budget=10_000)
    with torch.no_grad():
        in_pack = compute_trainer_logprobs(model, packed, temperature=1.0)
    offset = 0
    for i in packed.row_indices:
        (alone,) = pack_rows([rows[i]], token_budget=10_000)
        with torch.no_grad():
            lone = compute_trainer_logprobs(model, alone, temperature=1.0)
        n = len(rows[i].input_ids)
        torch.testing.assert_close(in_pack[offset:offset + n], lone, atol=1e-5, rtol=0)
        offset += n
    # and packing without position resets really would leak across rows (the test can fail):
    with torch.no_grad():
        leaked = model(input_ids=packed.input_ids_T[None]).logits[0]
        isolated = model(input_ids=packed.input_ids_T[None], position_ids=packed.position_ids_T[None],
                         use_cache=False).logits[0]
    assert (leaked[-1] - isolated[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_naive_forward(model: torch.nn.Module, temperature: float) -> None:
    rows = _random_rows(3, seed=2)
    (packed,) = pack_rows(rows, token_budget=10_000)
    with torch.no_grad():
        got = compute_trainer_logprobs(model, packed, temperature=temperature)
    offset = 0
    for i in packed.row_indices:
        row = rows[i]
        n = len(row.input_ids)
        want = _full_logprobs(model, list(row.input_ids), temperature)
        mask = torch.tensor(row.completion_mask, dtype=torch.bool)
        torch.testing.assert_close(got[offset:offset + n][mask], want[mask], atol=1e-4, rtol=0)
        assert (got[offset:offset + n][~mask] == 0).all()
        offset += n


def _grads(model: torch.nn.Module, rows: list[Row], packs: list) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    n_global = sum(r.num_trained_tokens for r in rows)
    total = 0.0
    for packed in packs:
        lp = compute_trainer_logprobs(model, packed, temperature=1.0)
        out = ppo_clip_loss(loss_inputs(packed, lp, n_global), PpoClipLoss())
        out.loss.backward()
        total += out.loss.item()
    return total, [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _with_near_policy_sampler_logprobs(model: torch.nn.Module, rows: list[Row]) -> list[Row]:
    """Sampler logprobs = the model's own +- 0.1, so ratios sit near 1 as in training."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for row in rows:
        (packed,) = pack_rows([row], token_budget=10_000)
        with torch.no_grad():
            lp = compute_trainer_logprobs(model, packed, temperature=1.0)
        noisy = (lp + 0.2 * (torch.rand(lp.shape, generator=gen) - 0.5)) * packed.mask_T
        out.append(dataclasses.replace(row, sampler_logprobs=tuple(noisy.tolist())))
    return out


def test_gradient_accumulation_one_pack_equals_eight_micro_batches(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.train()
    rows = _with_near_policy_sampler_logprobs(model, _random_rows(8, seed=3))
    one_pack = pack_rows(rows, token_budget=10_000)
    assert len(one_pack) == 1 and len(one_pack[0].row_indices) == 8
    loss_1, grads_1 = _grads(model, rows, one_pack)
    loss_8, grads_8 = _grads(model, rows, [pack_rows([r], token_budget=10_000)[0] for r in rows])
    assert loss_1 == pytest.approx(loss_8, abs=1e-6)
    assert len(grads_1) == len(grads_8) > 0
    for g1, g8 in zip(grads_1, grads_8, strict=True):
        torch.testing.assert_close(g1, g8, atol=1e-6, rtol=0)
    assert max(g.abs().max().item() for g in grads_1) > 1e-4  # the loss has a real gradient


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_trainer_logprobs_reproduce_embedded_engine_sampler_logprobs(
    tiny_model_dir: Path, tokenizer, temperature: float
) -> None:
    """Parity (DESIGN §3.2): the trainer's logprobs on the engine's own ids equal its logprobs."""
    import asyncio

    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.model_store import load_causal_lm
    from harnessrl.types import Sampling

    prompts = [
        list(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False))
        for q in ("Hi!", "Write a haiku about packing rows without padding.")
    ]
    engine = EmbeddedEngine(tiny_model_dir, num_threads=1, seed=1)
    try:
        sampling = Sampling(temperature=temperature, max_tokens=12, seed=3)
        completions = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    finally:
        engine.close()
    rows = []
    for c in completions:
        assert len(c.completion_ids) > 0
        rows.append(Row(
            input_ids=c.prompt_ids + c.completion_ids,
            completion_mask=(0,) * len(c.prompt_ids) + (1,) * len(c.completion_ids),
            sampler_logprobs=(0.0,) * len(c.prompt_ids) + c.completion_logprobs,
            policy_versions=(-1,) * len(c.prompt_ids) + (c.policy_version,) * len(c.completion_ids),
            rollout_id="r", group_id=0,
        ))
    model = load_causal_lm(tiny_model_dir)
    (packed,) = pack_rows(rows, token_budget=10_000)
    with torch.no_grad():
        trainer = compute_trainer_logprobs(model, packed, temperature=temperature)
    torch.testing.assert_close(trainer[packed.mask_T], packed.sampler_logprobs_T[packed.mask_T], atol=1e-4, rtol=0)


def test_greedy_temperature_uses_the_unscaled_distribution(model: torch.nn.Module) -> None:
    (packed,) = pack_rows(_random_rows(2, seed=4), token_budget=10_000)
    with torch.no_grad():
        greedy = compute_trainer_logprobs(model, packed, temperature=0.0)
        plain = compute_trainer_logprobs(model, packed, temperature=1.0)
        hot = compute_trainer_logprobs(model, packed, temperature=0.5)
    torch.testing.assert_close(greedy, plain, atol=0, rtol=0)
    assert (hot - plain).abs().max() > 1e-3


def test_segment_bounds_follow_position_resets() -> None:
    assert segment_bounds(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])) == [(0, 3), (3, 5), (5, 9)]
    assert segment_bounds(torch.tensor([0])) == [(0, 1)]
    assert segment_bounds(torch.tensor([5, 6, 7, 0])) == [(0, 3), (3, 4)]


def test_segment_attention_builds_no_dense_mask(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    embeds = torch.zeros(1, 9, config.hidden_size)
    config._attn_implementation = "sdpa"
    dense = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=pos)
    assert dense is not None and tuple(dense.shape[-2:]) == (9, 9)
    config._attn_implementation = SEGMENT_ATTENTION
    assert create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=pos) is None
    padded = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=torch.ones(1, 9, dtype=torch.long),
                                cache=None, position_ids=torch.arange(9)[None])
    assert padded is None or tuple(padded.shape[-2:]) == (9, 9), "a padding mask still goes to sdpa's mask"


def test_segment_attention_equals_dense_mask_logprobs_and_grads(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    rows = _random_rows(7, seed=4)
    (packed,) = pack_rows(rows, token_budget=10_000)
    n_global = sum(r.num_trained_tokens for r in rows)
    grads = {}
    lps = {}
    for attention in ("segments", "dense"):
        model.zero_grad(set_to_none=True)
        lp = compute_trainer_logprobs(model, packed, temperature=0.8, attention=attention)
        ppo_clip_loss(loss_inputs(packed, lp, n_global), PpoClipLoss()).loss.backward()
        lps[attention] = lp.detach()
        grads[attention] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert model.config._attn_implementation == "sdpa", "the model's attention setting is restored"
    torch.testing.assert_close(lps["segments"], lps["dense"], atol=1e-5, rtol=0)
    assert lps["segments"].abs().sum() > 0
    for g_seg, g_dense in zip(grads["segments"], grads["dense"], strict=True):
        torch.testing.assert_close(g_seg, g_dense, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="attention='sparse'"):
        compute_trainer_logprobs(model, packed, temperature=1.0, attention="sparse")  # type: ignore[arg-type]


def _group_rows(seed: int, vocab: int = 49152) -> list[Row]:
    """Rows shaped like a group and its forks: 3 rollouts share a 48-id task prompt; rollout 0
    also forked after its first turn (its second row shares prompt + first reply + more)."""
    rng = random.Random(seed)
    task = [rng.randrange(vocab) for _ in range(48)]

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    turn1 = task + ids(10)  # the first turn's prompt tail and reply of rollout 0
    rows = [
        _row(turn1 + ids(30), n_prompt=len(turn1) + 5, advantage=1.0),  # rollout 0, first row (longest)
        _row(turn1 + ids(9) + ids(14), n_prompt=len(turn1) + 9, advantage=1.0),  # rollout 0, fork row
        _row(task + ids(25), n_prompt=len(task) + 3, advantage=-0.5),  # rollout 1
        _row(task + ids(30), n_prompt=len(task) + 1, advantage=-0.5),  # rollout 2
        _row(ids(40), n_prompt=20, advantage=0.25),  # another group: nothing shared
    ]
    return rows


def test_shared_prefixes_are_stored_once_and_trained_tokens_never_shared() -> None:
    rows = _group_rows(seed=5)
    (packed,) = pack_rows(rows, token_budget=10_000)
    (whole,) = pack_rows(rows, token_budget=10_000, share_prefixes=False)
    assert whole.shared_tokens == 0 and whole.num_tokens == sum(len(r.input_ids) for r in rows)
    # rollout 0's first row is the longest with the task prompt: the root; the fork shares
    # 58 + 0 ids (up to one before its first trained id), rollouts 1 and 2 the 48-id task
    by_row = {packed.row_indices[k]: seg for k, seg in enumerate(packed.segments)}
    assert [by_row[i][3] for i in range(5)] == [0, 58, 48, 48, 0]
    assert packed.shared_tokens == 58 + 48 + 48 >= 3 * MIN_SHARED_TOKENS
    assert packed.num_tokens == whole.num_tokens - packed.shared_tokens
    assert packed.num_trained_tokens == whole.num_trained_tokens
    for i, (start, end, ctx_start, ctx_len) in by_row.items():
        row = rows[i]
        assert packed.input_ids_T[start:end].tolist() == list(row.input_ids[ctx_len:])
        assert packed.position_ids_T[start:end].tolist() == list(range(ctx_len, len(row.input_ids)))
        assert packed.input_ids_T[ctx_start:ctx_start + ctx_len].tolist() == list(row.input_ids[:ctx_len])
        assert packed.mask_T[start:end].tolist() == [bool(m) for m in row.completion_mask[ctx_len:]]
        assert set(packed.seq_ids_T[start:end].tolist()) == {i}
        assert not packed.mask_T[start]  # a branch's first own id is context
    # a fork's budget: the unit does not grow past it (the branch becomes its own unit)
    packs = pack_rows(rows[:2], token_budget=len(rows[0].input_ids) + 10)
    assert sum(p.shared_tokens for p in packs) == 0


def test_unshare_restores_whole_rows() -> None:
    rows = _group_rows(seed=6)
    (packed,) = pack_rows(rows, token_budget=10_000)
    expanded, index = unshare(packed)
    assert expanded.shared_tokens == 0 and expanded.num_tokens == sum(len(r.input_ids) for r in rows)
    offset = 0
    for i in expanded.row_indices:
        n = len(rows[i].input_ids)
        assert expanded.input_ids_T[offset:offset + n].tolist() == list(rows[i].input_ids)
        assert expanded.mask_T[offset:offset + n].tolist() == [bool(m) for m in rows[i].completion_mask]
        assert set(expanded.seq_ids_T[offset:offset + n].tolist()) == {i}
        offset += n
    assert torch.equal(expanded.input_ids_T[index], packed.input_ids_T)
    assert torch.equal(expanded.mask_T[index], packed.mask_T)


@pytest.mark.parametrize("attention", ["segments", "dense"])
def test_shared_prefix_layout_equals_whole_rows_logprobs_and_grads(tiny_model_dir: Path, attention: str) -> None:
    """Loss and gradients of the shared layout equal the unshared one's (float32, 1e-5)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    rows = _with_near_policy_sampler_logprobs(model, _group_rows(seed=7))
    shared = pack_rows(rows, token_budget=10_000)
    whole = pack_rows(rows, token_budget=10_000, share_prefixes=False)
    assert shared[0].shared_tokens > 0
    n_global = sum(r.num_trained_tokens for r in rows)
    results = {}
    for name, packs in (("shared", shared), ("whole", whole)):
        model.zero_grad(set_to_none=True)
        lps, total = {}, 0.0
        for packed in packs:
            lp = compute_trainer_logprobs(model, packed, temperature=0.9, attention=attention)  # type: ignore[arg-type]
            out = ppo_clip_loss(loss_inputs(packed, lp, n_global), PpoClipLoss())
            out.loss.backward()
            total += out.loss.item()
            for k, i in enumerate(packed.row_indices):  # each row's trained logprobs, in row order
                s, e, _, ctx = packed.segments[k]
                lps[i] = lp.detach()[s:e][packed.mask_T[s:e]]
        results[name] = (total, lps, [p.grad.clone() for p in model.parameters() if p.grad is not None])
    (loss_s, lps_s, grads_s), (loss_w, lps_w, grads_w) = results["shared"], results["whole"]
    assert loss_s == pytest.approx(loss_w, abs=1e-6)
    for i in range(len(rows)):
        assert lps_s[i].numel() == rows[i].num_trained_tokens
        torch.testing.assert_close(lps_s[i], lps_w[i], atol=1e-5, rtol=0)
    assert max(g.abs().max().item() for g in grads_s) > 1e-4
    for g_s, g_w in zip(grads_s, grads_w, strict=True):
        torch.testing.assert_close(g_s, g_w, atol=1e-5, rtol=1e-4)


def test_the_training_step_forwards_each_shared_prefix_once(tiny_model_dir: Path) -> None:
    """`accumulate_gradients` (the training step) runs the shared layout, not whole rows: the
    model forwards the pack's tokens, and loss and gradients equal the whole-row layout's.
    Before the step's own `segment_attention` block let `compute_trainer_logprobs` see an sdpa
    model, every pack was expanded back to whole rows (360 tokens forwarded here instead of 206)."""
    from transformers import AutoModelForCausalLM

    from harnessrl.train.step import accumulate_gradients

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    rows = _with_near_policy_sampler_logprobs(model, _group_rows(seed=7))
    (shared,) = pack_rows(rows, token_budget=10_000)
    (whole,) = pack_rows(rows, token_budget=10_000, share_prefixes=False)
    assert shared.num_tokens < whole.num_tokens
    forwarded: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: forwarded.append(args[0].numel()))
    try:
        model.zero_grad(set_to_none=True)
        acc = accumulate_gradients(model, rows, lambda inputs: ppo_clip_loss(inputs, PpoClipLoss()),
                                   temperature=1.0, token_budget=10_000)
    finally:
        hook.remove()
    assert acc is not None
    assert forwarded == [shared.num_tokens]
    assert acc.metrics["tokens_packed"] == shared.num_tokens
    grads_step = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    n_global = sum(r.num_trained_tokens for r in rows)
    lp = compute_trainer_logprobs(model, whole, temperature=1.0, attention="dense")
    loss_whole = ppo_clip_loss(loss_inputs(whole, lp, n_global), PpoClipLoss()).loss
    loss_whole.backward()
    assert acc.metrics["loss"] == pytest.approx(loss_whole.item(), abs=1e-6)
    grads_whole = [p.grad for p in model.parameters() if p.grad is not None]
    for g_s, g_w in zip(grads_step, grads_whole, strict=True):
        torch.testing.assert_close(g_s, g_w, atol=1e-5, rtol=1e-4)


def test_shared_prefix_attention_sees_the_prefix(tiny_model_dir: Path) -> None:
    """The test can fail: a branch run without its shared prefix gives other logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    (packed,) = pack_rows(_group_rows(seed=8), token_budget=10_000)
    cut = dataclasses.replace(packed, segments=tuple((s, e, cs, 0) for s, e, cs, _ in packed.segments))
    with torch.no_grad():
        right = compute_trainer_logprobs(model, packed, temperature=1.0)
        wrong = compute_trainer_logprobs(model, cut, temperature=1.0)
    assert (right - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_token_logprobs_equal_the_autograd_formula_values_and_grads(scale: float) -> None:
    """The hand-written backward: values and gradients of logits (through a vocabulary
    projection, as in the trainer) equal autograd through gather - logsumexp, 1e-5 float32."""
    torch.manual_seed(3)
    hidden_K_H = torch.randn(37, 16, requires_grad=True)
    head_V_H = (torch.randn(1000, 16) * 0.5).requires_grad_()
    targets_K = torch.randint(0, 1000, (37,))
    weights_K = torch.randn(37)
    results = []
    for fused in (True, False):
        hidden_K_H.grad = head_V_H.grad = None
        logits_K_V = hidden_K_H @ head_V_H.T
        if fused:
            lp_K = token_logprobs(logits_K_V, targets_K, scale)
        else:
            z = logits_K_V / scale
            lp_K = z.gather(-1, targets_K[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        (lp_K * weights_K).sum().backward()
        results.append((lp_K.detach(), hidden_K_H.grad.clone(), head_V_H.grad.clone()))
    assert results[0][1].abs().max() > 1e-2  # a real gradient
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_token_logprobs_gradcheck_and_bad_input() -> None:
    logits = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 7])
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.8).double(), (logits,), atol=1e-4)
    with pytest.raises(ValueError, match="scale=0"):
        token_logprobs(logits, targets, 0.0)
    with pytest.raises(ValueError, match=r"\[K, V\] and \[K\]"):
        token_logprobs(logits, targets[:3])


def test_trainer_logprobs_in_bfloat16_keep_float32_math(tiny_model_dir: Path) -> None:
    """A bf16 model's logits are upcast before the log-softmax; the gradient comes back in bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
    (packed,) = pack_rows(_random_rows(2, seed=4), token_budget=10_000)
    lp = compute_trainer_logprobs(model, packed, temperature=1.0)
    assert lp.dtype == torch.float32 and bool((lp[packed.mask_T] < 0).all())
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.bfloat16 for g in grads)


def test_short_segments_take_the_math_kernel_with_flash_values_and_grads(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments of <= MATH_KV_MAX keys run SDPA's math kernel on CPU (cheaper backward for short
    rows); logprobs and gradients equal the flash kernel's (float32, 1e-5)."""
    from transformers import AutoModelForCausalLM

    import harnessrl.train.packing as packing

    chosen: list[tuple[int, bool]] = []
    real = packing._kernel_for

    def spy(device: torch.device, n_keys: int):  # type: ignore[no-untyped-def]
        ctx = real(device, n_keys)
        chosen.append((n_keys, not isinstance(ctx, contextlib.nullcontext)))
        return ctx

    monkeypatch.setattr(packing, "_kernel_for", spy)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    rows = _with_near_policy_sampler_logprobs(model, _group_rows(seed=11))
    (packed,) = pack_rows(rows, token_budget=10_000)
    n_global = sum(r.num_trained_tokens for r in rows)
    results = {}
    for name, limit in (("math", packing.MATH_KV_MAX), ("flash", 0)):
        monkeypatch.setattr(packing, "MATH_KV_MAX", limit)
        chosen.clear()
        model.zero_grad(set_to_none=True)
        lp = compute_trainer_logprobs(model, packed, temperature=0.9)
        ppo_clip_loss(loss_inputs(packed, lp, n_global), PpoClipLoss()).loss.backward()
        results[name] = (lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert chosen and all(math == (n <= limit) for n, math in chosen)
        assert any(math for _, math in chosen) == (name == "math")
    torch.testing.assert_close(results["math"][0], results["flash"][0], atol=1e-5, rtol=0)
    for g_m, g_f in zip(results["math"][1], results["flash"][1], strict=True):
        torch.testing.assert_close(g_m, g_f, atol=1e-5, rtol=1e-4)
    assert isinstance(real(torch.device("cpu"), packing.MATH_KV_MAX + 1), contextlib.nullcontext)
    assert isinstance(real(torch.device("meta"), 4), contextlib.nullcontext), "CPU only"

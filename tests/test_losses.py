"""Losses: hand-computed values and gradients, clip fractions, non-finite masking, KL."""

from __future__ import annotations

import math

import pytest
import torch

from harnessrl.errors import ConfigError
from harnessrl.loss.losses import (
    CispoLoss,
    GspoLoss,
    LossInputs,
    PpoClipLoss,
    cispo_loss,
    gspo_loss,
    loss_fn_for,
    ppo_clip_loss,
)


def _inputs(
    trainer: list[float],
    ratios: list[float],
    advantages: list[float],
    *,
    seq_ids: list[int] | None = None,
    mask: list[bool] | None = None,
    num_tokens_global: int | None = None,
    ref: list[float] | None = None,
) -> tuple[LossInputs, torch.Tensor]:
    """Inputs whose token ratios are exactly `ratios` (sampler = trainer - ln r)."""
    lp = torch.tensor(trainer, dtype=torch.float32, requires_grad=True)
    sampler = torch.tensor([t - math.log(r) for t, r in zip(trainer, ratios, strict=True)])
    n = len(trainer)
    inputs = LossInputs(
        trainer_logprobs_T=lp,
        sampler_logprobs_T=sampler,
        advantages_T=torch.tensor(advantages, dtype=torch.float32),
        mask_T=torch.tensor(mask if mask is not None else [True] * n),
        seq_ids_T=torch.tensor(seq_ids if seq_ids is not None else [0] * n),
        num_tokens_global=num_tokens_global if num_tokens_global is not None else n,
        ref_logprobs_T=None if ref is None else torch.tensor(ref),
    )
    return inputs, lp


PPO_CFG = PpoClipLoss(epsilon_low=0.2, epsilon_high=0.28, tis_cap=2.0, clip_center="behaviour")
"""The behaviour-centred loss: the ratio against the sampler, `tis_cap` as the dual clip."""


def test_ppo_clip_hand_computed_value_gradient_and_fractions() -> None:
    # token: r,   A  -> surrogate min(rA, clip(r, .8, 1.28) A), A<0 floored at 2A
    # 1:    1.5, +1 -> min(1.5, 1.28) = 1.28   (clipped high, no grad)   loss -1.28
    # 2:    0.5, -1 -> min(-0.5, -0.8) = -0.8  (clipped low, no grad)    loss +0.8
    # 3:    1.1, +2 -> min(2.2, 2.2) = 2.2     (grad -r A = -2.2)        loss -2.2
    # 4:    3.0, -1 -> min(-3, -1.28) = -3 -> max(-3, -2) = -2 (truncated, no grad)  loss +2
    # sum = -0.68, / 4 tokens = -0.17; d/dlp = [0, 0, -2.2/4, 0]
    inputs, lp = _inputs([-1.0, -2.0, -0.5, -3.0], [1.5, 0.5, 1.1, 3.0], [1.0, -1.0, 2.0, -1.0])
    out = ppo_clip_loss(inputs, PPO_CFG)
    assert out.loss.item() == pytest.approx(-0.17, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 0.0, -0.55, 0.0]), atol=1e-6, rtol=0)
    m = out.metrics
    assert m["clip_high_frac"] == 0.25 and m["clip_low_frac"] == 0.25 and m["is_truncated_frac"] == 0.25
    assert m["ratio_mean"] == pytest.approx(1.525, abs=1e-6)
    assert m["ratio_min"] == pytest.approx(0.5, abs=1e-6) and m["ratio_max"] == pytest.approx(3.0, abs=1e-5)
    assert m["nonfinite_count"] == 0 and m["num_valid_tokens"] == 4


def test_ppo_without_tis_cap_keeps_the_unclipped_negative_branch() -> None:
    # token 4 alone: r = 3, A = -1, cap 100: loss = -min(-3, -1.28) = 3; grad -r A = 3
    inputs, lp = _inputs([-3.0], [3.0], [-1.0])
    out = ppo_clip_loss(inputs, PpoClipLoss(tis_cap=100.0, clip_center="behaviour"))
    assert out.loss.item() == pytest.approx(3.0, abs=1e-5)
    out.loss.backward()
    assert lp.grad.item() == pytest.approx(3.0, abs=1e-5)


def test_global_token_normaliser_divides_the_sum() -> None:
    # one token r = 1, A = 1: loss_t = -1; normalised by 10 global tokens -> -0.1
    inputs, _ = _inputs([-1.0], [1.0], [1.0], num_tokens_global=10)
    assert ppo_clip_loss(inputs, PPO_CFG).loss.item() == pytest.approx(-0.1, abs=1e-7)


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, gspo_loss, cispo_loss])
def test_non_finite_ratios_are_masked_counted_and_never_nan(loss_fn) -> None:
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0], requires_grad=True)
    sampler = torch.tensor([-1.0, float("nan"), -201.0, float("-inf"), -500.0])
    # token 0: r = 1; token 1: NaN; token 2: log r = 200 (exp overflows); token 3: log r = inf;
    # token 4: masked out (huge ratio, but not trained, so not counted)
    inputs = LossInputs(
        trainer_logprobs_T=lp,
        sampler_logprobs_T=sampler,
        advantages_T=torch.tensor([1.0, 1.0, -1.0, 1.0, 1.0]),
        mask_T=torch.tensor([True, True, True, True, False]),
        seq_ids_T=torch.zeros(5, dtype=torch.long),
        num_tokens_global=4,
    )
    out = loss_fn(inputs)
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[1:].abs().sum().item() == 0.0
    assert out.metrics["nonfinite_count"] == 3 and out.metrics["num_valid_tokens"] == 1
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_gspo_sequence_ratio_value_and_gradient() -> None:
    # seq 0: log r = [ln 2, 0] -> s0 = exp(ln2 / 2) = 1.414214, A = +1, not clipped (eps_high .5)
    # seq 1: log r = 3 x ln 0.9 -> s1 = 0.9, A = -1, not clipped (eps_low .2)
    # loss = (2 * -1.414214 + 3 * 0.9) / 5 = -0.025686
    # token form: d loss / d lp_t = -s_i A_i / 5 -> seq0: -0.282843, seq1: +0.18
    cfg = GspoLoss(epsilon_low=0.2, epsilon_high=0.5, clip_center="behaviour")
    inputs, lp = _inputs(
        [-1.0, -2.0, -1.0, -1.5, -0.5], [2.0, 1.0, 0.9, 0.9, 0.9], [1.0, 1.0, -1.0, -1.0, -1.0],
        seq_ids=[7, 7, 3, 3, 3],
    )
    out = gspo_loss(inputs, cfg)
    assert out.loss.item() == pytest.approx((-2 * math.sqrt(2) + 2.7) / 5, abs=1e-6)
    out.loss.backward()
    want = torch.tensor([-math.sqrt(2) / 5] * 2 + [0.18] * 3)
    torch.testing.assert_close(lp.grad, want, atol=1e-6, rtol=0)
    assert out.metrics["clip_high_frac"] == 0.0 and out.metrics["clip_low_frac"] == 0.0


def test_gspo_clips_the_whole_sequence() -> None:
    # default eps 3e-4 / 4e-4: seq ratio sqrt(2) with A > 0 is clipped: loss -(1.0004), no grad
    inputs, lp = _inputs([-1.0, -2.0], [2.0, 1.0], [1.0, 1.0])
    out = gspo_loss(inputs, GspoLoss(clip_center="behaviour"))
    assert out.loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-6)
    out.loss.backward()
    assert lp.grad.abs().sum().item() == 0.0
    assert out.metrics["clip_high_frac"] == 1.0


def test_cispo_stop_gradient_clipped_weight() -> None:
    # r = [1.5, 0.5, 10], A = [1, -1, 1], cap 1 + 4 = 5 -> w = [1.5, 0.5, 5]; lp = [-1, -2, -0.5]
    # loss = -sum(w A lp) / 3 = -(-1.5 - 1.0 ... ) : -(1.5*-1) - (0.5*-1*-2) - (5*-0.5) = 1.5 - 1 + 2.5 = 3; / 3 = 1
    # grad = -w A / 3 = [-0.5, 0.166667, -1.666667] (every token keeps a gradient)
    inputs, lp = _inputs([-1.0, -2.0, -0.5], [1.5, 0.5, 10.0], [1.0, -1.0, 1.0])
    out = cispo_loss(inputs, CispoLoss(epsilon_high=4.0))
    assert out.loss.item() == pytest.approx(1.0, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.5, 0.5 / 3, -5 / 3]), atol=1e-6, rtol=0)
    assert out.metrics["is_truncated_frac"] == pytest.approx(1 / 3)


def test_k3_kl_penalty_to_reference() -> None:
    # r = 1 and A = 0, so the surrogate is 0; ref - lp = [ln 2, ln 0.5]
    # k3 = rho - 1 - ln rho = [2 - 1 - .693147, .5 - 1 + .693147] = [.306853, .193147], mean .25
    # loss = 0.1 * (.306853 + .193147) / 2 = 0.025; d k3 / d lp = 1 - rho -> [-1, .5] * 0.1 / 2
    inputs, lp = _inputs([-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], ref=[-1.0 + math.log(2), -1.0 + math.log(0.5)])
    out = ppo_clip_loss(inputs, PpoClipLoss(kl_coef=0.1))
    assert out.loss.item() == pytest.approx(0.025, abs=1e-7)
    assert out.metrics["kl"] == pytest.approx(0.25, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.05, 0.025]), atol=1e-7, rtol=0)
    # off by default: the same inputs give a zero loss
    assert ppo_clip_loss(inputs, PpoClipLoss()).loss.item() == 0.0


def test_mismatch_kl_metric() -> None:
    # r = 2: k3 of the sampler against the trainer = r - 1 - ln r = 1 - 0.693147 = 0.306853
    inputs, _ = _inputs([-1.0], [2.0], [0.0])
    assert ppo_clip_loss(inputs, PPO_CFG).metrics["mismatch_kl"] == pytest.approx(1 - math.log(2), abs=1e-6)


def test_loss_fn_for_binds_config_and_rejects_unknown_names() -> None:
    inputs, _ = _inputs([-1.0], [1.5], [1.0])
    fn = loss_fn_for(PpoClipLoss(epsilon_high=0.1, clip_center="behaviour"))
    assert fn(inputs).loss.item() == pytest.approx(-1.1, abs=1e-6)  # clipped at 1 + 0.1
    # the default (proximal): the weight 1.5 is under the cap 2, so loss = -1.5 * A
    assert loss_fn_for("gspo")(inputs).loss.item() == pytest.approx(-1.5, abs=1e-6)
    with pytest.raises(ConfigError, match="'grpo'"):
        loss_fn_for("grpo")


def test_kl_coef_without_reference_logprobs_is_an_error() -> None:
    inputs, _ = _inputs([-1.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs_T"):
        ppo_clip_loss(inputs, PpoClipLoss(kl_coef=0.1))


# --- the decoupled objective (clip_center = "proximal"): PPO clip on pi_theta / pi_prox, the
# sampler's gap w = pi_prox / mu as a detached, bounded weight (AReaL arXiv 2505.24298 eq. 5)

def test_decoupled_ppo_hand_computed_token_outside_the_old_clip_keeps_its_gradient() -> None:
    # same tokens as the behaviour-centred test: w = [1.5, 0.5, 1.1, 3.0], A = [1, -1, 2, -1]
    # pi_prox = sg(pi_theta): rho = 1 (no clip), w truncated at 2 -> [1.5, 0.5, 1.1, 2.0]
    # loss = -sum(w A) / 4 = -(1.5 - 0.5 + 2.2 - 2.0) / 4 = -0.3; d/dlp = -w A / 4
    # token 1 (w 1.5, A > 0) was clipped high by the behaviour-centred clip (gradient 0): now -0.375
    inputs, lp = _inputs([-1.0, -2.0, -0.5, -3.0], [1.5, 0.5, 1.1, 3.0], [1.0, -1.0, 2.0, -1.0])
    out = ppo_clip_loss(inputs, PpoClipLoss())
    assert out.loss.item() == pytest.approx(-0.3, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.375, 0.125, -0.55, 0.5]), atol=1e-6, rtol=0)
    m = out.metrics
    assert m["clip_high_frac"] == 0.0 and m["clip_low_frac"] == 0.0
    assert m["is_truncated_frac"] == 0.25 and m["is_masked_frac"] == 0.0
    assert m["ratio_mean"] == 1.0 and m["ratio_max"] == 1.0  # the clipped ratio is rho
    assert m["mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in [1.5, 0.5, 1.1, 3.0]) / 4, abs=1e-6)
    torch.testing.assert_close(out.weight_T, torch.tensor([1.5, 0.5, 1.1, 2.0]), atol=1e-6, rtol=0)
    assert out.bounded_T.tolist() == [False, False, False, True]
    assert not out.clipped_T.any()


def test_decoupled_truncation_floor() -> None:
    # w = [0.25, 4.0], floor 0.5, cap 2 -> [0.5, 2.0]; A = 1: loss = -(0.5 + 2) / 2 = -1.25
    inputs, lp = _inputs([-1.0, -1.0], [0.25, 4.0], [1.0, 1.0])
    out = ppo_clip_loss(inputs, PpoClipLoss(tis_floor=0.5))
    assert out.loss.item() == pytest.approx(-1.25, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.25, -1.0]), atol=1e-6, rtol=0)
    assert out.metrics["is_truncated_frac"] == 1.0


def test_decoupled_mask_drops_tokens_outside_the_bounds() -> None:
    # IcePop mask [0.6, 2.5]: w = [1.5, 0.5, 1.1, 3.0] -> tokens 2 (0.5) and 4 (3.0) dropped
    # loss = -(1.5 * 1 + 1.1 * 2) / 4 = -0.925 (dropped tokens stay in the normaliser)
    inputs, lp = _inputs([-1.0, -2.0, -0.5, -3.0], [1.5, 0.5, 1.1, 3.0], [1.0, -1.0, 2.0, -1.0])
    out = ppo_clip_loss(inputs, PpoClipLoss(behaviour_weight="mask", mask_low=0.6, mask_high=2.5))
    assert out.loss.item() == pytest.approx(-0.925, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.375, 0.0, -0.55, 0.0]), atol=1e-6, rtol=0)
    assert out.metrics["is_masked_frac"] == 0.5 and out.metrics["is_truncated_frac"] == 0.0
    # the defaults are IcePop's [0.5, 5]: 3.0 is kept, so only a weight past 5 is dropped
    inputs, _ = _inputs([-1.0, -1.0], [3.0, 6.0], [1.0, 1.0])
    assert ppo_clip_loss(inputs, PpoClipLoss(behaviour_weight="mask")).loss.item() == pytest.approx(-1.5, abs=1e-6)


def test_decoupled_sequence_level_weight_is_the_geometric_mean_bounded_once() -> None:
    # row 7: w = [2, 8] -> geometric mean 4 -> truncated to 2; row 3: w = [0.5, 2] -> 1
    # A = 1: loss = -(2 + 2 + 1 + 1) / 4 = -1.5; d/dlp = -[2, 2, 1, 1] / 4
    inputs, lp = _inputs([-1.0, -2.0, -1.0, -1.5], [2.0, 8.0, 0.5, 2.0], [1.0] * 4, seq_ids=[7, 7, 3, 3])
    out = ppo_clip_loss(inputs, PpoClipLoss(behaviour_weight_level="sequence"))
    assert out.loss.item() == pytest.approx(-1.5, abs=1e-5)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.5, -0.5, -0.25, -0.25]), atol=1e-6, rtol=0)
    assert out.metrics["is_truncated_frac"] == 0.5
    # sequence-level mask: row 7's mean 4 is inside [0.5, 5] though its token 8 is not
    inputs, _ = _inputs([-1.0, -2.0], [2.0, 8.0], [1.0, 1.0])
    cfg = PpoClipLoss(behaviour_weight="mask", behaviour_weight_level="sequence")
    assert ppo_clip_loss(inputs, cfg).loss.item() == pytest.approx(-4.0, abs=1e-5)


def test_decoupled_ppo_clip_binds_against_supplied_proximal_logprobs() -> None:
    # several optimizer steps per batch would supply pi_prox of an earlier state:
    # rho = [1.5, 1.1], w = [1, 1], A = 1: token 1 clipped at 1.28 (no grad), token 2 grad -1.1 / 2
    lp = torch.tensor([-1.0, -1.0], requires_grad=True)
    prox = torch.tensor([-1.0 - math.log(1.5), -1.0 - math.log(1.1)])
    inputs = LossInputs(trainer_logprobs_T=lp, sampler_logprobs_T=prox.clone(), advantages_T=torch.ones(2),
                        mask_T=torch.ones(2, dtype=torch.bool), seq_ids_T=torch.zeros(2, dtype=torch.long),
                        num_tokens_global=2, proximal_logprobs_T=prox)
    out = ppo_clip_loss(inputs, PpoClipLoss())
    assert out.loss.item() == pytest.approx(-(1.28 + 1.1) / 2, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -0.55]), atol=1e-6, rtol=0)
    assert out.metrics["clip_high_frac"] == 0.5 and out.clipped_T.tolist() == [True, False]


def _random_inputs(seed: int, n: int = 64, gap: float = 0.0) -> tuple[LossInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = (-3.0 * torch.rand(n, generator=g)).requires_grad_(True)
    sampler = lp.detach() + gap * torch.randn(n, generator=g)
    inputs = LossInputs(
        trainer_logprobs_T=lp, sampler_logprobs_T=sampler, advantages_T=torch.randn(n, generator=g),
        mask_T=torch.rand(n, generator=g) > 0.2, seq_ids_T=torch.arange(n) // 8, num_tokens_global=n)
    return inputs, lp


@pytest.mark.parametrize("kind", ["ppo_clip", "gspo"])
def test_no_lag_and_no_precision_gap_gives_the_behaviour_centred_loss_exactly(kind: str) -> None:
    """mu = pi_prox (no lag, no gap): w = 1 and rho = r, so values and gradients are the old loss's."""
    cls = PpoClipLoss if kind == "ppo_clip" else GspoLoss
    results = []
    for center in ("proximal", "behaviour"):
        inputs, lp = _random_inputs(3, gap=0.0)
        out = loss_fn_for(cls(clip_center=center))(inputs)
        out.loss.backward()
        results.append((out.loss.detach(), lp.grad.clone()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][1].abs().sum() > 0


def _old_ppo_clip(inputs: LossInputs, eps_low: float, eps_high: float, cap: float) -> torch.Tensor:
    """The loss before the decoupled objective, written out: ratio against the sampler, dual clip."""
    mask = inputs.mask_T
    log_r = inputs.trainer_logprobs_T - inputs.sampler_logprobs_T
    r = torch.exp(torch.where(mask, log_r, torch.zeros_like(log_r)))
    adv = torch.where(mask, inputs.advantages_T, torch.zeros_like(r))
    surrogate = torch.minimum(r * adv, torch.clamp(r, 1.0 - eps_low, 1.0 + eps_high) * adv)
    loss_t = -torch.where(adv < 0, torch.maximum(surrogate, cap * adv), surrogate)
    return torch.where(mask, loss_t, torch.zeros_like(loss_t)).sum() / inputs.num_tokens_global


def test_clip_center_behaviour_is_the_old_loss_bit_for_bit() -> None:
    inputs, lp = _random_inputs(5, gap=0.5)  # ratios spread over the clip and the cap
    out = ppo_clip_loss(inputs, PPO_CFG)
    out.loss.backward()
    lp2 = lp.detach().clone().requires_grad_(True)
    old = _old_ppo_clip(LossInputs(lp2, inputs.sampler_logprobs_T, inputs.advantages_T, inputs.mask_T,
                                   inputs.seq_ids_T, inputs.num_tokens_global), 0.2, 0.28, 2.0)
    old.backward()
    assert torch.equal(out.loss.detach(), old.detach())
    assert torch.equal(lp.grad, lp2.grad)
    assert 0 < out.metrics["clip_high_frac"] and 0 < out.metrics["is_truncated_frac"]
    # and the default (proximal) differs on the same inputs
    inputs3, _ = _random_inputs(5, gap=0.5)
    assert ppo_clip_loss(inputs3, PpoClipLoss()).loss.item() != pytest.approx(out.loss.item(), abs=1e-4)


def test_decoupled_non_finite_weight_is_masked_and_counted() -> None:
    # sampler -inf: log w = inf -> masked like a non-finite ratio, never a NaN gradient
    lp = torch.tensor([-1.0, -1.0], requires_grad=True)
    inputs = LossInputs(lp, torch.tensor([-1.0, float("-inf")]), torch.ones(2), torch.ones(2, dtype=torch.bool),
                        torch.zeros(2, dtype=torch.long), 2)
    out = ppo_clip_loss(inputs, PpoClipLoss())
    out.loss.backward()
    assert out.metrics["nonfinite_count"] == 1 and lp.grad.tolist() == [-0.5, 0.0]


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"clip_center": "behaviour", "mask_low": 0.4}, "mask_low"),
    ({"clip_center": "behaviour", "behaviour_weight": "mask"}, "behaviour_weight"),
    ({"behaviour_weight": "mask", "tis_cap": 3.0}, "tis_cap"),
    ({"mask_high": 4.0}, "mask_high"),
])
def test_a_key_the_mode_does_not_use_is_refused(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=f"train.loss.{key} has no effect"):
        PpoClipLoss(**kwargs)
    assert PpoClipLoss(clip_center="behaviour", tis_cap=3.0).tis_cap == 3.0  # the dual clip's
    # an idle key at its default is accepted (a saved config holds every key)
    assert PpoClipLoss(clip_center="behaviour", mask_low=0.5).clip_center == "behaviour"

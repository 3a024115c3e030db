"""Policy-gradient losses: one pure function per variant, `LossInputs -> LossOutputs`.

Responsibility: the per-token surrogate objectives, their off-policy correction, masking of
non-finite ratios, the optional KL penalty, and the metrics that describe them.

The ratio. There is no separate pi_old recompute: every ratio is
`r_t = exp(trainer_logprob_t - sampler_logprob_t)`, numerator the policy being trained
(current weights, with gradient), denominator the sampler's recorded logprob of the token
(the behaviour policy that actually drew it, at the turn's `policy_version`). Staleness and
trainer/engine mismatch both show up in `r_t`, and the clip bounds them.

Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training"): the importance weight is capped at `tis_cap`. Because the
sampler is the ratio's denominator, the PPO / GSPO clip already stops the gradient of A > 0
tokens above `1 + epsilon_high`; the cap binds for A < 0 tokens, whose loss becomes
`-max(surrogate, tis_cap * A)`: identical to dual-clip PPO (Ye et al. 2020, "Mastering Complex
Control in MOBA Games with Deep RL", eq. 5). CISPO's clipped weight is itself the truncated
weight.

Normalisation: the loss of one micro-batch is `sum_t loss_t / num_tokens_global`, where
`num_tokens_global` is the number of trained tokens (mask 1) in the whole optimizer step's
batch. Summing the micro-batch losses' gradients therefore gives exactly the gradient of the
token mean over the global batch, however the rows are split (gradient accumulation is exact).
Tokens masked for non-finite ratios contribute 0 to the sum but stay in the denominator.

Non-finite ratios (inf/NaN log-ratios, or exp overflow) are masked *before* any
multiplication with `torch.where`, counted in `nonfinite_count`, and never reach the loss or
its gradient (0 * inf would be NaN).

What this module does not do: compute logprobs (`packing.py`) or advantages
(`advantages.py`), step optimizers, or branch on the variant (`loss_fn_for` picks once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from harnessrl.errors import ConfigError
from harnessrl.loss.config import CispoLoss, GspoLoss, LossConfig, PpoClipLoss

__all__ = ["CispoLoss", "GspoLoss", "LossConfig", "LossFn", "LossInputs", "LossOutputs", "PpoClipLoss",
           "cispo_loss", "gspo_loss", "loss_fn_for", "ppo_clip_loss"]


@dataclass(frozen=True, slots=True)
class LossInputs:
    """One micro-batch, flattened. Every `_T` tensor has shape [T] (the packed tokens).

    The logprob at index t is that of token t given the tokens before it in its row.
    """

    trainer_logprobs_T: torch.Tensor
    """float32, with gradient: current policy's logprob of each token (0 where mask is 0)."""
    sampler_logprobs_T: torch.Tensor
    """float32: the engine's logprob of each sampled token (0 where mask is 0)."""
    advantages_T: torch.Tensor
    """float32: the row's advantage on each token."""
    mask_T: torch.Tensor
    """bool: True for trained (sampled) tokens."""
    seq_ids_T: torch.Tensor
    """int64: which row each token belongs to (GSPO's sequences)."""
    num_tokens_global: int
    """Trained tokens in the whole optimizer step's batch (the normaliser)."""
    ref_logprobs_T: torch.Tensor | None = None
    """float32: a reference policy's logprobs (for the KL penalty), or None."""


@dataclass(frozen=True, slots=True)
class LossOutputs:
    loss: torch.Tensor
    """Scalar: this micro-batch's share of the global token-mean loss (call `.backward()`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """ratio_mean/min/max, clip_low_frac, clip_high_frac, is_truncated_frac, nonfinite_count,
    num_valid_tokens, mismatch_kl (k3 estimate of KL(sampler || trainer) on the sampled tokens,
    `r - 1 - ln r`), kl (k3 to the reference)."""


LossFn = Callable[[LossInputs], LossOutputs]


@dataclass(frozen=True, slots=True)
class _Ratios:
    valid_T: torch.Tensor  # bool: mask & finite ratio
    log_ratio_T: torch.Tensor  # 0 where not valid; grad flows to trainer logprobs
    ratio_T: torch.Tensor  # exp(log_ratio_T), finite everywhere
    nonfinite_count: int


def _ratios(inputs: LossInputs) -> _Ratios:
    """Token log-ratios with non-finite entries replaced by 0 *before* exp (no NaN grads)."""
    mask = inputs.mask_T.bool()
    log_ratio = inputs.trainer_logprobs_T.float() - inputs.sampler_logprobs_T.float()
    with torch.no_grad():
        ok = torch.isfinite(log_ratio) & torch.isfinite(torch.exp(log_ratio))
        ok &= torch.isfinite(inputs.advantages_T)
    valid = mask & ok
    safe_log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    nonfinite = int((mask & ~ok).sum().item())
    return _Ratios(valid, safe_log_ratio, torch.exp(safe_log_ratio), nonfinite)


def _k3(log_rho_T: torch.Tensor) -> torch.Tensor:
    """k3 estimator `rho - 1 - log rho` of KL (Schulman 2020, "Approximating KL Divergence")."""
    return torch.exp(log_rho_T) - 1.0 - log_rho_T


def _finish(
    inputs: LossInputs, r: _Ratios, loss_T: torch.Tensor, cfg: LossConfig, extra: dict[str, float]
) -> LossOutputs:
    """Mask, add the KL penalty, normalise by `num_tokens_global`, and collect metrics."""
    if inputs.num_tokens_global <= 0:
        raise ValueError(f"num_tokens_global={inputs.num_tokens_global} must be > 0")
    zeros = torch.zeros_like(loss_T)
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), zeros)
    if cfg.kl_coef > 0.0:
        if inputs.ref_logprobs_T is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs_T (the reference policy's logprobs)")
        log_rho = torch.where(r.valid_T, inputs.ref_logprobs_T.float() - inputs.trainer_logprobs_T.float(), zeros)
        kl_T = _k3(log_rho)
        loss_T = loss_T + cfg.kl_coef * kl_T
    else:
        kl_T = None
    loss = torch.where(r.valid_T, loss_T, zeros).sum() / inputs.num_tokens_global
    with torch.no_grad():
        n = int(r.valid_T.sum().item())
        ratios = r.ratio_T[r.valid_T]
        metrics = {
            "num_valid_tokens": float(n),
            "nonfinite_count": float(r.nonfinite_count),
            "ratio_mean": float(ratios.mean()) if n else 1.0,
            "ratio_min": float(ratios.min()) if n else 1.0,
            "ratio_max": float(ratios.max()) if n else 1.0,
            "mismatch_kl": float(_k3(r.log_ratio_T)[r.valid_T].mean()) if n else 0.0,
            "kl": float(kl_T[r.valid_T].mean()) if (kl_T is not None and n) else 0.0,
        }
        metrics["advantage_mean"] = float(adv[r.valid_T].mean()) if n else 0.0
        metrics.update(extra)
    return LossOutputs(loss=loss, metrics=metrics)


def _frac(flags_T: torch.Tensor, valid_T: torch.Tensor) -> float:
    n = int(valid_T.sum().item())
    return float((flags_T & valid_T).sum().item()) / n if n else 0.0


def _clipped_surrogate(
    ratio_T: torch.Tensor, adv_T: torch.Tensor, eps_low: float, eps_high: float, tis_cap: float
) -> torch.Tensor:
    """`-max(min(r A, clip(r, 1-eps_low, 1+eps_high) A), C A)` for A < 0; without the C term
    for A >= 0 (clip-higher: Yu et al. 2025 DAPO eq. 10; cap: Ye et al. 2020 dual-clip)."""
    surrogate = torch.minimum(ratio_T * adv_T, torch.clamp(ratio_T, 1.0 - eps_low, 1.0 + eps_high) * adv_T)
    capped = torch.maximum(surrogate, tis_cap * adv_T)
    return -torch.where(adv_T < 0, capped, surrogate)


def ppo_clip_loss(inputs: LossInputs, cfg: PpoClipLoss = PpoClipLoss()) -> LossOutputs:
    """PPO-clip with asymmetric bounds and a truncated-IS cap, per token.

    `loss_t = -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t)`, and for A_t < 0 the
    result is floored at `-(tis_cap * A_t)`; `r_t = exp(trainer_lp - sampler_lp)`.
    Sources: Schulman et al. 2017 (PPO, eq. 7); Yu et al. 2025 (DAPO clip-higher, eq. 10);
    Yao et al. 2025 (truncated IS) realised as dual-clip (Ye et al. 2020).
    """
    r = _ratios(inputs)
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), torch.zeros_like(r.ratio_T))
    loss_T = _clipped_surrogate(r.ratio_T, adv, cfg.epsilon_low, cfg.epsilon_high, cfg.tis_cap)
    with torch.no_grad():
        extra = {
            "clip_low_frac": _frac((r.ratio_T < 1.0 - cfg.epsilon_low) & (adv < 0), r.valid_T),
            "clip_high_frac": _frac((r.ratio_T > 1.0 + cfg.epsilon_high) & (adv > 0), r.valid_T),
            "is_truncated_frac": _frac((r.ratio_T > cfg.tis_cap) & (adv < 0), r.valid_T),
        }
    return _finish(inputs, r, loss_T, cfg, extra)


def _sequence_log_ratio(r: _Ratios, seq_ids_T: torch.Tensor) -> torch.Tensor:
    """Per-token copy of its sequence's mean log-ratio over valid tokens ([T], with grad)."""
    _, inverse = torch.unique(seq_ids_T, return_inverse=True)
    num_seq = int(inverse.max().item()) + 1 if inverse.numel() else 0
    weights = r.valid_T.float()
    sums = torch.zeros(num_seq, dtype=r.log_ratio_T.dtype, device=r.log_ratio_T.device).index_add(
        0, inverse, r.log_ratio_T * weights)
    counts = torch.zeros(num_seq, dtype=weights.dtype, device=weights.device).index_add(0, inverse, weights)
    return (sums / counts.clamp(min=1.0))[inverse]


def gspo_loss(inputs: LossInputs, cfg: GspoLoss = GspoLoss()) -> LossOutputs:
    """GSPO: clipped sequence-level ratio, in its token form (GSPO-token).

    `s_i = exp(mean_{t in i} log r_t)` (geometric mean of the token ratios of sequence i);
    token form `s_{i,t} = sg(s_i) * exp(log r_t - sg(log r_t))` (value s_i, gradient
    s_i * grad log pi(y_t)); `loss_t = -min(s A, clip(s, 1-eps_low, 1+eps_high) A)`, floored at
    `-(tis_cap * A)` for A < 0. Source: Zheng et al. 2025, "Group Sequence Policy
    Optimization", eqs. 5-7 and 13 (GSPO-token). With the global token mean the sequence
    terms are weighted by their trained-token count.
    """
    r = _ratios(inputs)
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), torch.zeros_like(r.ratio_T))
    seq_log_ratio = _sequence_log_ratio(r, inputs.seq_ids_T).detach()
    s_T = torch.exp(seq_log_ratio + r.log_ratio_T - r.log_ratio_T.detach())
    loss_T = _clipped_surrogate(s_T, adv, cfg.epsilon_low, cfg.epsilon_high, cfg.tis_cap)
    with torch.no_grad():
        extra = {
            "clip_low_frac": _frac((s_T < 1.0 - cfg.epsilon_low) & (adv < 0), r.valid_T),
            "clip_high_frac": _frac((s_T > 1.0 + cfg.epsilon_high) & (adv > 0), r.valid_T),
            "is_truncated_frac": _frac((s_T > cfg.tis_cap) & (adv < 0), r.valid_T),
        }
    return _finish(inputs, r, loss_T, cfg, extra)


def cispo_loss(inputs: LossInputs, cfg: CispoLoss = CispoLoss()) -> LossOutputs:
    """CISPO: `loss_t = -sg(min(r_t, 1 + eps_high)) * A_t * log pi(y_t)`.

    The clipped IS weight is stop-gradient, so every token keeps a gradient (none is dropped
    as in PPO-clip); the weight is the truncated IS weight. Source: MiniMax 2025,
    "MiniMax-M1", §3.1, eq. 4-5 (lower bound unused).
    """
    r = _ratios(inputs)
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), torch.zeros_like(r.ratio_T))
    weight = torch.clamp(r.ratio_T, max=1.0 + cfg.epsilon_high).detach()
    logprob = torch.where(r.valid_T, inputs.trainer_logprobs_T.float(), torch.zeros_like(r.ratio_T))
    loss_T = -weight * adv * logprob
    with torch.no_grad():
        truncated = _frac(r.ratio_T > 1.0 + cfg.epsilon_high, r.valid_T)
        extra = {"clip_low_frac": 0.0, "clip_high_frac": truncated, "is_truncated_frac": truncated}
    return _finish(inputs, r, loss_T, cfg, extra)


def loss_fn_for(cfg: LossConfig | str | None = None) -> LossFn:
    """The loss of `cfg`'s variant bound to it: `fn(inputs)`. A string names a variant
    (`ppo_clip`, `gspo`, `cispo`) with its defaults; None is PPO-clip with its defaults.

    Raises:
        ConfigError: an unknown variant name or an object that is not one of the loss configs.
    """
    if cfg is None:
        cfg = PpoClipLoss()
    elif isinstance(cfg, str):
        defaults = {"ppo_clip": PpoClipLoss, "gspo": GspoLoss, "cispo": CispoLoss}
        if cfg not in defaults:
            raise ConfigError(f"loss={cfg!r} is not one of 'ppo_clip', 'gspo', 'cispo'")
        cfg = defaults[cfg]()
    match cfg:
        case PpoClipLoss():
            return partial(ppo_clip_loss, cfg=cfg)
        case GspoLoss():
            return partial(gspo_loss, cfg=cfg)
        case CispoLoss():
            return partial(cispo_loss, cfg=cfg)
        case _:
            raise ConfigError(f"train.loss={cfg!r} is not a PpoClipLoss, GspoLoss or CispoLoss")

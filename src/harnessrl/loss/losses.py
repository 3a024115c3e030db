"""Policy-gradient losses: one pure function per variant, `LossInputs -> LossOutputs`.

Responsibility: the per-token surrogate objectives, their off-policy correction, masking of
non-finite ratios, the optional KL penalty, and the metrics that describe them.

Three policies (AReaL's terms, Fu et al. 2025, "AReaL", arXiv 2505.24298, §5): the policy being
trained `pi_theta` (current weights, with gradient), the proximal policy `pi_prox` (the
trainer's weights at the start of the optimizer step), and the behaviour policy `mu` (the
engine that drew the token, at the turn's `policy_version`, in the engine's precision; its
logprob is the sampler's recorded one).

The decoupled objective (`clip_center = "proximal"`, the default of PPO-clip and GSPO):

    loss_t = w_t * -min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t)
    rho_t  = exp(log pi_theta - log pi_prox)          (the trust region: trainer vs itself)
    w_t    = bound(exp(log pi_prox - log mu)), detached (the sampler's gap: lag and precision)

(Fu et al. 2025, eq. 5). `bound` is truncation `clamp(w, tis_floor, tis_cap)` (Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training": C = 2) or
masking, `w * 1[mask_low <= w <= mask_high]` (IcePop, arXiv 2510.18855: [0.5, 5]), at token
level or at sequence level (w_i = the geometric mean of the row's token weights, bounded once).
The trainer takes one optimizer step per batch (`train/step.py`), so the proximal policy is the
current weights and `log pi_prox = sg(log pi_theta)`: no extra forward pass, `rho_t = 1` in
value with gradient `grad log pi_theta`, and the PPO clip binds only where proximal logprobs
of an earlier state are supplied (`LossInputs.proximal_logprobs_T`). A batch with no lag and no
precision gap (mu = pi_prox) has w = 1 and gives the behaviour-centred loss's values and
gradients.

The behaviour-centred loss (`clip_center = "behaviour"`, the loss before the decoupled
objective): `r_t = exp(log pi_theta - log mu)` inside the clip, so the policy lag and the
engine's precision gap both sit in the trust region and a token the engine scored off by more
than the clip loses its gradient ("phantom clipping"). `tis_cap` then floors A < 0 tokens at
`-(tis_cap * A)`: the loss becomes `-max(surrogate, tis_cap * A)`, dual-clip PPO (Ye et al.
2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5), which is truncated IS
for the sampler ratio. CISPO's clipped weight is itself the truncated weight (no centre).

Normalisation: the loss of one micro-batch is `sum_t loss_t / num_tokens_global`, where
`num_tokens_global` is the number of trained tokens (mask 1) in the whole optimizer step's
batch. Summing the micro-batch losses' gradients therefore gives exactly the gradient of the
token mean over the global batch, however the rows are split (gradient accumulation is exact).
Tokens masked for non-finite ratios, or by the behaviour weight's mask, contribute 0 to the
sum but stay in the denominator.

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
    proximal_logprobs_T: torch.Tensor | None = None
    """float32, no gradient: the proximal policy's logprobs (the weights at the optimizer
    step's start). None: `sg(trainer_logprobs_T)`, exact when each batch gets one optimizer
    step (the trainer's case). Used by `clip_center = "proximal"` only."""


@dataclass(frozen=True, slots=True)
class LossOutputs:
    loss: torch.Tensor
    """Scalar: this micro-batch's share of the global token-mean loss (call `.backward()`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """ratio_mean/min/max (of the clipped ratio), clip_low_frac, clip_high_frac,
    is_truncated_frac, is_masked_frac, nonfinite_count, num_valid_tokens, mismatch_kl (k3
    estimate of KL(sampler || trainer) on the sampled tokens, `r - 1 - ln r` with
    `r = pi_theta / mu`), kl (k3 to the reference)."""
    clipped_T: torch.Tensor | None = None
    """bool [T]: tokens whose gradient the ratio clip stopped (for the diagnostics by staleness)."""
    bounded_T: torch.Tensor | None = None
    """bool [T]: tokens whose importance weight was truncated or masked."""
    weight_T: torch.Tensor | None = None
    """float32 [T], detached: the bounded behaviour weight on each token (1 where the variant
    has none; 0 where masked or not trained)."""


LossFn = Callable[[LossInputs], LossOutputs]


@dataclass(frozen=True, slots=True)
class _Ratios:
    valid_T: torch.Tensor  # bool: mask & finite ratio
    log_ratio_T: torch.Tensor  # 0 where not valid; grad flows to trainer logprobs
    ratio_T: torch.Tensor  # exp(log_ratio_T), finite everywhere
    nonfinite_count: int
    log_w_T: torch.Tensor | None = None  # proximal: log(pi_prox / mu), 0 where not valid, no grad


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


def _proximal_ratios(inputs: LossInputs) -> _Ratios:
    """`log rho = log pi_theta - log pi_prox` (with grad) and `log w = log pi_prox - log mu`
    (detached); a token where either is non-finite or overflows `exp` is masked and counted."""
    mask = inputs.mask_T.bool()
    lp = inputs.trainer_logprobs_T.float()
    prox = lp.detach() if inputs.proximal_logprobs_T is None else inputs.proximal_logprobs_T.float().detach()
    log_ratio = lp - prox
    with torch.no_grad():
        log_w = prox - inputs.sampler_logprobs_T.float()
        ok = torch.isfinite(log_ratio) & torch.isfinite(torch.exp(log_ratio))
        ok &= torch.isfinite(log_w) & torch.isfinite(torch.exp(log_w))
        ok &= torch.isfinite(inputs.advantages_T)
    valid = mask & ok
    zeros = torch.zeros_like(log_ratio)
    safe_log_ratio = torch.where(valid, log_ratio, zeros)
    nonfinite = int((mask & ~ok).sum().item())
    return _Ratios(valid, safe_log_ratio, torch.exp(safe_log_ratio), nonfinite,
                   torch.where(valid, log_w, zeros.detach()))


def _k3(log_rho_T: torch.Tensor) -> torch.Tensor:
    """k3 estimator `rho - 1 - log rho` of KL (Schulman 2020, "Approximating KL Divergence")."""
    return torch.exp(log_rho_T) - 1.0 - log_rho_T


def _finish(
    inputs: LossInputs, r: _Ratios, loss_T: torch.Tensor, cfg: LossConfig, extra: dict[str, float],
    flags: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> LossOutputs:
    """Mask, add the KL penalty, normalise by `num_tokens_global`, and collect metrics.
    `flags`: the (clipped, bounded, weight) per-token tensors for `LossOutputs`."""
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
        # trainer vs sampler: the clipped ratio itself when behaviour-centred, rho * w otherwise
        mismatch_log = r.log_ratio_T if r.log_w_T is None else r.log_ratio_T + r.log_w_T
        metrics = {
            "num_valid_tokens": float(n),
            "nonfinite_count": float(r.nonfinite_count),
            "ratio_mean": float(ratios.mean()) if n else 1.0,
            "ratio_min": float(ratios.min()) if n else 1.0,
            "ratio_max": float(ratios.max()) if n else 1.0,
            "mismatch_kl": float(_k3(mismatch_log)[r.valid_T].mean()) if n else 0.0,
            "kl": float(kl_T[r.valid_T].mean()) if (kl_T is not None and n) else 0.0,
        }
        metrics["advantage_mean"] = float(adv[r.valid_T].mean()) if n else 0.0
        metrics.update(extra)
    if flags is None:
        return LossOutputs(loss=loss, metrics=metrics)
    clipped, bounded, weight = flags
    if weight is None:
        weight = r.valid_T.float()
    return LossOutputs(loss=loss, metrics=metrics, clipped_T=clipped & r.valid_T, bounded_T=bounded & r.valid_T,
                       weight_T=weight.detach())


def _frac(flags_T: torch.Tensor, valid_T: torch.Tensor) -> float:
    n = int(valid_T.sum().item())
    return float((flags_T & valid_T).sum().item()) / n if n else 0.0


def _surrogate(ratio_T: torch.Tensor, adv_T: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """`min(r A, clip(r, 1-eps_low, 1+eps_high) A)` (Schulman et al. 2017, eq. 7; clip-higher:
    Yu et al. 2025 DAPO eq. 10)."""
    return torch.minimum(ratio_T * adv_T, torch.clamp(ratio_T, 1.0 - eps_low, 1.0 + eps_high) * adv_T)


def _clipped_surrogate(
    ratio_T: torch.Tensor, adv_T: torch.Tensor, eps_low: float, eps_high: float, tis_cap: float
) -> torch.Tensor:
    """`-max(min(r A, clip(r, 1-eps_low, 1+eps_high) A), C A)` for A < 0; without the C term
    for A >= 0 (clip-higher: Yu et al. 2025 DAPO eq. 10; cap: Ye et al. 2020 dual-clip)."""
    surrogate = _surrogate(ratio_T, adv_T, eps_low, eps_high)
    capped = torch.maximum(surrogate, tis_cap * adv_T)
    return -torch.where(adv_T < 0, capped, surrogate)


def _clip_flags(ratio_T: torch.Tensor, adv_T: torch.Tensor, eps_low: float, eps_high: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped low, clipped high): the tokens whose gradient the clip stops."""
    return (ratio_T < 1.0 - eps_low) & (adv_T < 0), (ratio_T > 1.0 + eps_high) & (adv_T > 0)


def _bounded_weight(
    log_w_T: torch.Tensor, r: _Ratios, seq_ids_T: torch.Tensor, cfg: PpoClipLoss | GspoLoss
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The behaviour weight, bounded as `cfg` says: (weight [T], truncated [T], masked [T]),
    detached, 0 where not valid. Sequence level: `exp(mean of the row's log w)` (geometric
    mean), bounded once for the whole row. Truncation: `clamp(w, tis_floor, tis_cap)` (Yao et
    al. 2025); masking: `w` where `mask_low <= w <= mask_high`, else 0 (IcePop, arXiv
    2510.18855, eq. 4)."""
    with torch.no_grad():
        if cfg.behaviour_weight_level == "sequence":
            log_w_T = _sequence_mean(log_w_T, r.valid_T, seq_ids_T)
        w = torch.exp(log_w_T)
        none = torch.zeros_like(r.valid_T)
        if cfg.behaviour_weight == "truncate":
            truncated = r.valid_T & ((w > cfg.tis_cap) | (w < cfg.tis_floor))
            bounded = torch.clamp(w, min=cfg.tis_floor, max=cfg.tis_cap)
            return torch.where(r.valid_T, bounded, torch.zeros_like(w)), truncated, none
        keep = (w >= cfg.mask_low) & (w <= cfg.mask_high)
        return torch.where(r.valid_T & keep, w, torch.zeros_like(w)), none, r.valid_T & ~keep


def _decoupled(inputs: LossInputs, cfg: PpoClipLoss | GspoLoss, sequence_ratio: bool) -> LossOutputs:
    """The decoupled objective (module docstring): the PPO (or GSPO-token) clip on
    `rho = pi_theta / pi_prox`, times the bounded, detached behaviour weight."""
    r = _proximal_ratios(inputs)
    assert r.log_w_T is not None
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), torch.zeros_like(r.ratio_T))
    ratio = r.ratio_T
    if sequence_ratio:  # GSPO-token: sg(s_i) * exp(log rho - sg(log rho))
        seq = _sequence_mean(r.log_ratio_T, r.valid_T, inputs.seq_ids_T).detach()
        ratio = torch.exp(seq + r.log_ratio_T - r.log_ratio_T.detach())
    weight, truncated, masked = _bounded_weight(r.log_w_T, r, inputs.seq_ids_T, cfg)
    loss_T = -weight * _surrogate(ratio, adv, cfg.epsilon_low, cfg.epsilon_high)
    with torch.no_grad():
        low, high = _clip_flags(ratio, adv, cfg.epsilon_low, cfg.epsilon_high)
        extra = {
            "clip_low_frac": _frac(low, r.valid_T),
            "clip_high_frac": _frac(high, r.valid_T),
            "is_truncated_frac": _frac(truncated, r.valid_T),
            "is_masked_frac": _frac(masked, r.valid_T),
        }
    return _finish(inputs, r, loss_T, cfg, extra, (low | high, truncated | masked, weight))


def ppo_clip_loss(inputs: LossInputs, cfg: PpoClipLoss = PpoClipLoss()) -> LossOutputs:
    """PPO-clip with asymmetric bounds, per token.

    `clip_center = "proximal"` (default): `loss_t = -w_t min(rho_t A_t, clip(rho_t, 1-eps_low,
    1+eps_high) A_t)`, `rho_t = exp(trainer_lp - proximal_lp)`, `w_t` the bounded, detached
    behaviour weight `exp(proximal_lp - sampler_lp)` (AReaL decoupled PPO, arXiv 2505.24298,
    eq. 5; module docstring). `"behaviour"`: `loss_t = -min(r_t A_t, clip(r_t, 1-eps_low,
    1+eps_high) A_t)`, floored at `-(tis_cap * A_t)` for A_t < 0, `r_t = exp(trainer_lp -
    sampler_lp)`. Sources: Schulman et al. 2017 (PPO, eq. 7); Yu et al. 2025 (DAPO
    clip-higher, eq. 10); Yao et al. 2025 (truncated IS) realised as dual-clip (Ye et al. 2020).
    """
    if cfg.clip_center == "proximal":
        return _decoupled(inputs, cfg, sequence_ratio=False)
    r = _ratios(inputs)
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), torch.zeros_like(r.ratio_T))
    loss_T = _clipped_surrogate(r.ratio_T, adv, cfg.epsilon_low, cfg.epsilon_high, cfg.tis_cap)
    with torch.no_grad():
        low, high = _clip_flags(r.ratio_T, adv, cfg.epsilon_low, cfg.epsilon_high)
        truncated = (r.ratio_T > cfg.tis_cap) & (adv < 0)
        extra = {
            "clip_low_frac": _frac(low, r.valid_T),
            "clip_high_frac": _frac(high, r.valid_T),
            "is_truncated_frac": _frac(truncated, r.valid_T),
            "is_masked_frac": 0.0,
        }
    return _finish(inputs, r, loss_T, cfg, extra, (low | high, truncated, None))


def _sequence_mean(values_T: torch.Tensor, valid_T: torch.Tensor, seq_ids_T: torch.Tensor) -> torch.Tensor:
    """Per-token copy of its sequence's mean of `values_T` over valid tokens ([T], with grad
    if `values_T` has one)."""
    _, inverse = torch.unique(seq_ids_T, return_inverse=True)
    num_seq = int(inverse.max().item()) + 1 if inverse.numel() else 0
    weights = valid_T.float()
    sums = torch.zeros(num_seq, dtype=values_T.dtype, device=values_T.device).index_add(
        0, inverse, values_T * weights)
    counts = torch.zeros(num_seq, dtype=weights.dtype, device=weights.device).index_add(0, inverse, weights)
    return (sums / counts.clamp(min=1.0))[inverse]


def gspo_loss(inputs: LossInputs, cfg: GspoLoss = GspoLoss()) -> LossOutputs:
    """GSPO: clipped sequence-level ratio, in its token form (GSPO-token).

    `s_i = exp(mean_{t in i} log r_t)` (geometric mean of the token ratios of sequence i);
    token form `s_{i,t} = sg(s_i) * exp(log r_t - sg(log r_t))` (value s_i, gradient
    s_i * grad log pi(y_t)); `loss_t = -min(s A, clip(s, 1-eps_low, 1+eps_high) A)`. Source:
    Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7 and 13 (GSPO-token).
    `clip_center = "proximal"` (default): `r_t = pi_theta / pi_prox` and the loss is multiplied
    by the bounded, detached behaviour weight (as `ppo_clip_loss`; AReaL arXiv 2505.24298
    eq. 5); `"behaviour"`: `r_t = pi_theta / mu`, floored at `-(tis_cap * A)` for A < 0. With
    the global token mean the sequence terms are weighted by their trained-token count.
    """
    if cfg.clip_center == "proximal":
        return _decoupled(inputs, cfg, sequence_ratio=True)
    r = _ratios(inputs)
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), torch.zeros_like(r.ratio_T))
    seq_log_ratio = _sequence_mean(r.log_ratio_T, r.valid_T, inputs.seq_ids_T).detach()
    s_T = torch.exp(seq_log_ratio + r.log_ratio_T - r.log_ratio_T.detach())
    loss_T = _clipped_surrogate(s_T, adv, cfg.epsilon_low, cfg.epsilon_high, cfg.tis_cap)
    with torch.no_grad():
        low, high = _clip_flags(s_T, adv, cfg.epsilon_low, cfg.epsilon_high)
        truncated = (s_T > cfg.tis_cap) & (adv < 0)
        extra = {
            "clip_low_frac": _frac(low, r.valid_T),
            "clip_high_frac": _frac(high, r.valid_T),
            "is_truncated_frac": _frac(truncated, r.valid_T),
            "is_masked_frac": 0.0,
        }
    return _finish(inputs, r, loss_T, cfg, extra, (low | high, truncated, None))


def cispo_loss(inputs: LossInputs, cfg: CispoLoss = CispoLoss()) -> LossOutputs:
    """CISPO: `loss_t = -sg(min(r_t, 1 + eps_high)) * A_t * log pi(y_t)`.

    The clipped IS weight is stop-gradient, so every token keeps a gradient (none is dropped
    as in PPO-clip); the weight is the truncated IS weight. Source: MiniMax 2025,
    "MiniMax-M1", §3.1, eq. 4-5 (lower bound unused). No clip centre: with one optimizer step
    per batch the decoupled form `sg(min(rho_t, .)) * w_t` is this same weight.
    """
    r = _ratios(inputs)
    adv = torch.where(r.valid_T, inputs.advantages_T.float(), torch.zeros_like(r.ratio_T))
    weight = torch.clamp(r.ratio_T, max=1.0 + cfg.epsilon_high).detach()
    logprob = torch.where(r.valid_T, inputs.trainer_logprobs_T.float(), torch.zeros_like(r.ratio_T))
    loss_T = -weight * adv * logprob
    with torch.no_grad():
        over = r.ratio_T > 1.0 + cfg.epsilon_high
        truncated = _frac(over, r.valid_T)
        extra = {"clip_low_frac": 0.0, "clip_high_frac": truncated, "is_truncated_frac": truncated,
                 "is_masked_frac": 0.0}
    return _finish(inputs, r, loss_T, cfg, extra,
                   (torch.zeros_like(r.valid_T), over, torch.where(r.valid_T, weight, torch.zeros_like(weight))))


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

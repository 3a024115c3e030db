"""The loss's configuration: one typed model per `train.loss.kind`, a discriminated union.

Responsibility: the knobs of each loss variant in `loss/losses.py`, validated at config load
without importing torch. Each variant accepts only the knobs its formula uses, so a knob of
another variant (e.g. `epsilon_low` under `cispo`) fails at load, naming the key.

PPO-clip and GSPO also take the decoupled objective's keys (`_Decoupled`): `clip_center`
picks what the PPO ratio is taken against, and `behaviour_weight*`, `tis_cap`, `tis_floor`,
`mask_low`, `mask_high` bound the separate behaviour importance weight. A key that the chosen
mode does not use is refused at load when it is set to another value than its default (it
would do nothing).

Common to all: `kl_coef`, the weight of the k3 KL penalty to the reference policy (the initial
weights, frozen; `train/step.py` computes the reference logprobs, `train/policy.py` keeps the
reference model).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _LossBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL penalty `KL(pi_theta || pi_ref)` per trained token (Schulman 2020,
    "Approximating KL Divergence"); the reference is the initial weights, frozen. 0 disables
    it. Cost: with LoRA none (the base with adapters disabled is the reference); with full
    fine-tuning a second, frozen fp32 copy of the model and one more forward per micro-batch."""


_MODE_KEYS = {
    "behaviour": ("behaviour_weight", "behaviour_weight_level", "tis_floor", "mask_low", "mask_high"),
    "truncate": ("mask_low", "mask_high"),
    "mask": ("tis_cap", "tis_floor"),
}
"""Keys that do nothing under a `clip_center` (behaviour) or a `behaviour_weight` mode."""


class _Decoupled(_LossBase):
    """The decoupled objective's keys (PPO-clip and GSPO).

    `clip_center = "proximal"`: the PPO clip works on `pi_theta / pi_prox` (the trainer against
    its own weights at the step's start) and the sampler's gap `w = pi_prox / mu` (mu: the
    engine's recorded logprob, at the turn's `policy_version`) multiplies the token's loss as a
    detached, bounded importance weight (AReaL decoupled PPO, Fu et al. 2025, arXiv 2505.24298,
    eq. 5; the bound: Yao et al. 2025 truncated IS, or IcePop masking, arXiv 2510.18855).
    `"behaviour"`: the ratio is `pi_theta / mu`, clipped, with `tis_cap` as a dual clip for
    A < 0 (the loss before the decoupled objective, bit for bit)."""

    clip_center: Literal["proximal", "behaviour"] = "proximal"
    """What the PPO ratio's denominator is: "proximal" (the trainer's own logprobs at the
    step's start; the sampler's gap goes to the behaviour weight) or "behaviour" (the
    sampler's recorded logprobs: policy lag and engine precision gap both inside the clip)."""
    behaviour_weight: Literal["truncate", "mask"] = "truncate"
    """How the behaviour weight `w = pi_prox / mu` is bounded (clip_center "proximal"):
    "truncate" uses `clamp(w, tis_floor, tis_cap)` (Yao et al. 2025); "mask" drops the token
    (weight 0) when w is outside `[mask_low, mask_high]` (IcePop, arXiv 2510.18855)."""
    behaviour_weight_level: Literal["token", "sequence"] = "token"
    """"token": each token's own w; "sequence": the geometric mean of w over the row's trained
    tokens, bounded once and applied to each of them (verl rollout correction, sequence IS)."""
    tis_cap: float = Field(default=2.0, gt=1.0)
    """Truncated-IS cap C (Yao et al. 2025 use C = 2). clip_center "proximal" with "truncate":
    the behaviour weight's upper bound; "behaviour": the dual clip on the ratio for A < 0."""
    tis_floor: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Lower bound of the truncated behaviour weight (0: none; slime's GLM recipe uses 0.5)."""
    mask_low: float = Field(default=0.5, ge=0.0, lt=1.0)
    """"mask": a token whose w is below this is dropped (IcePop's 0.5, verl preset "0.5_5.0")."""
    mask_high: float = Field(default=5.0, gt=1.0)
    """"mask": a token whose w is above this is dropped (IcePop's 5.0; AReaL's default 5.0)."""

    @model_validator(mode="after")
    def _keys_used(self) -> _Decoupled:
        idle = _MODE_KEYS["behaviour"] if self.clip_center == "behaviour" else _MODE_KEYS[self.behaviour_weight]
        # set to another value than the default (a saved config holds every key at its value)
        values = self.model_dump()
        set_idle = [k for k in idle if values[k] != type(self).model_fields[k].default]
        if set_idle:
            mode = ("clip_center = 'behaviour'" if self.clip_center == "behaviour"
                    else f"behaviour_weight = {self.behaviour_weight!r}")
            raise ValueError(f"train.loss.{set_idle[0]} has no effect with {mode}")
        return self


class PpoClipLoss(_Decoupled):
    """PPO-clip with asymmetric bounds, per token, decoupled from the sampler by default."""

    kind: Literal["ppo_clip"] = "ppo_clip"
    epsilon_low: float = Field(default=0.2, gt=0.0)
    """Lower bound of the ratio clip, `1 - epsilon_low` (Schulman et al. 2017)."""
    epsilon_high: float = Field(default=0.28, gt=0.0)
    """Upper bound `1 + epsilon_high`; 0.28 is DAPO's clip-higher (Yu et al. 2025)."""


class GspoLoss(_Decoupled):
    """GSPO: the clipped sequence-level ratio (GSPO-token), decoupled by default."""

    kind: Literal["gspo"] = "gspo"
    epsilon_low: float = Field(default=3e-4, gt=0.0)
    """Lower bound on the sequence ratio (Zheng et al. 2025, §5.1: 3e-4)."""
    epsilon_high: float = Field(default=4e-4, gt=0.0)
    """Upper bound on the sequence ratio (Zheng et al. 2025, §5.1: 4e-4)."""


class CispoLoss(_LossBase):
    """CISPO: the clipped, stop-gradient IS weight times the advantage times the logprob."""

    kind: Literal["cispo"] = "cispo"
    epsilon_high: float = Field(default=4.0, gt=0.0)
    """The IS weight is capped at `1 + epsilon_high`; no lower bound (MiniMax-M1 §3.1 sets it
    out of reach; the upper value is ours, tune it). The cap is the truncation: no `tis_cap`.
    CISPO has no `clip_center`: its weight `sg(min(pi_theta / mu, 1 + epsilon_high))` is
    already a detached, truncated behaviour weight, and with one optimizer step per batch
    (pi_theta = pi_prox in value) the decoupled form `sg(min(r_prox, .)) * w` is the same
    product."""


LossConfig = Annotated[PpoClipLoss | GspoLoss | CispoLoss, Field(discriminator="kind")]
"""`train.loss`: the variant named by `kind` with its own knobs."""

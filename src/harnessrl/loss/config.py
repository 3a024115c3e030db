"""The loss's configuration: one typed model per `train.loss.kind`, a discriminated union.

Responsibility: the knobs of each loss variant in `loss/losses.py`, validated at config load
without importing torch. Each variant accepts only the knobs its formula uses, so a knob of
another variant (e.g. `epsilon_low` under `cispo`) fails at load, naming the key.

Common to all: `kl_coef`, the weight of the k3 KL penalty to the reference policy (the initial
weights, frozen; `train/step.py` computes the reference logprobs, `train/policy.py` keeps the
reference model).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _LossBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL penalty `KL(pi_theta || pi_ref)` per trained token (Schulman 2020,
    "Approximating KL Divergence"); the reference is the initial weights, frozen. 0 disables
    it. Cost: with LoRA none (the base with adapters disabled is the reference); with full
    fine-tuning a second, frozen fp32 copy of the model and one more forward per micro-batch."""


class PpoClipLoss(_LossBase):
    """PPO-clip with asymmetric bounds and a truncated-IS cap, per token."""

    kind: Literal["ppo_clip"] = "ppo_clip"
    epsilon_low: float = Field(default=0.2, gt=0.0)
    """Lower bound of the ratio clip, `1 - epsilon_low` (Schulman et al. 2017)."""
    epsilon_high: float = Field(default=0.28, gt=0.0)
    """Upper bound `1 + epsilon_high`; 0.28 is DAPO's clip-higher (Yu et al. 2025)."""
    tis_cap: float = Field(default=2.0, gt=1.0)
    """Truncated-IS cap C on the ratio for A < 0 tokens (Yao et al. 2025 use C = 2)."""


class GspoLoss(_LossBase):
    """GSPO: the clipped sequence-level ratio (GSPO-token)."""

    kind: Literal["gspo"] = "gspo"
    epsilon_low: float = Field(default=3e-4, gt=0.0)
    """Lower bound on the sequence ratio (Zheng et al. 2025, §5.1: 3e-4)."""
    epsilon_high: float = Field(default=4e-4, gt=0.0)
    """Upper bound on the sequence ratio (Zheng et al. 2025, §5.1: 4e-4)."""
    tis_cap: float = Field(default=2.0, gt=1.0)
    """Truncated-IS cap C on the sequence ratio for A < 0 tokens."""


class CispoLoss(_LossBase):
    """CISPO: the clipped, stop-gradient IS weight times the advantage times the logprob."""

    kind: Literal["cispo"] = "cispo"
    epsilon_high: float = Field(default=4.0, gt=0.0)
    """The IS weight is capped at `1 + epsilon_high`; no lower bound (MiniMax-M1 §3.1 sets it
    out of reach; the upper value is ours, tune it). The cap is the truncation: no `tis_cap`."""


LossConfig = Annotated[PpoClipLoss | GspoLoss | CispoLoss, Field(discriminator="kind")]
"""`train.loss`: the variant named by `kind` with its own knobs."""

LOSS_KINDS = ("ppo_clip", "gspo", "cispo")

"""Off-policy diagnostics of one optimizer step, split by staleness.

Responsibility: from each micro-batch's trainer logprobs at the step's start (the proximal
policy), the sampler's recorded logprobs and each token's staleness (the trainer's policy
version minus the token's turn `policy_version`), accumulate what shows whether async training
is safe, and turn it into the step's metrics:

* the behaviour importance weight `w = exp(log pi_prox - log mu)` per trained token (before any
  bound; log w clamped to [-20, 20] against overflow, verl's safety clamp): mean, max and the
  effective sample size `ESS = (sum w)^2 / (n sum w^2)` in (0, 1] (Kong 1992; verl rollout
  correction `rollout_corr/ess`; 1 when every weight is equal);
* the mismatch KL, k3 `w - 1 - ln w` averaged over tokens (Schulman 2020, "Approximating KL
  Divergence"), and the mean |log pi_prox - log mu|;
* the fraction of tokens the ratio clip stopped and the fraction whose weight was truncated or
  masked (the loss's `clipped_T` / `bounded_T`).

Tokens at staleness 0 were sampled from the weights the trainer holds, so their w measures the
engine's precision gap alone (the gap, not the lag); tokens at staleness >= 1 add the policy
lag. `train/console.offpolicy_warnings` names which of the two crosses the field's thresholds
(`KL_WARN`, `ESS_WARN`, `WEIGHT_MEAN_WARN`: verl's rollout correction monitoring).

Metric keys (all floats): `offpolicy/<name>` over every trained token, `offpolicy/s<k>/<name>`
for the tokens at staleness k, and `offpolicy/lag/<name>` for staleness >= 1; `<name>` is
tokens, is_weight_mean, is_weight_max, is_weight_ess, mismatch_kl, abs_logprob_diff,
clip_frac, bounded_frac.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ESS_WARN", "KL_WARN", "WEIGHT_MEAN_WARN", "OffPolicyStats", "staleness_of"]

KL_WARN = 0.1
"""Mismatch KL above which a step warns (verl rollout correction: |kl| > 0.1)."""
ESS_WARN = 0.3
"""Effective sample size below which a step warns (verl: ESS < 0.3)."""
WEIGHT_MEAN_WARN = (0.5, 2.0)
"""Mean importance weight outside this range warns (verl: outside [0.5, 2])."""

_LOG_W_CLAMP = 20.0


@dataclass
class _Sums:
    tokens: int = 0
    w: float = 0.0
    w_sq: float = 0.0
    w_max: float = 0.0
    k3: float = 0.0
    abs_diff: float = 0.0
    clipped: int = 0
    bounded: int = 0

    def add(self, other: _Sums) -> None:
        self.tokens += other.tokens
        self.w += other.w
        self.w_sq += other.w_sq
        self.w_max = max(self.w_max, other.w_max)
        self.k3 += other.k3
        self.abs_diff += other.abs_diff
        self.clipped += other.clipped
        self.bounded += other.bounded

    def metrics(self, prefix: str) -> dict[str, float]:
        n = self.tokens
        return {
            f"{prefix}tokens": float(n),
            f"{prefix}is_weight_mean": self.w / n,
            f"{prefix}is_weight_max": self.w_max,
            f"{prefix}is_weight_ess": self.w ** 2 / (n * self.w_sq) if self.w_sq > 0 else 0.0,
            f"{prefix}mismatch_kl": self.k3 / n,
            f"{prefix}abs_logprob_diff": self.abs_diff / n,
            f"{prefix}clip_frac": self.clipped / n,
            f"{prefix}bounded_frac": self.bounded / n,
        }


def staleness_of(policy_versions_T: torch.Tensor, trainer_version: int | None) -> torch.Tensor | None:
    """int64 [T]: `trainer_version - policy_versions_T` (the token's staleness in optimizer
    steps), -1 where the token's version is unknown (-1: a context token); None without a
    trainer version."""
    if trainer_version is None:
        return None
    versions = policy_versions_T.long()
    return torch.where(versions >= 0, trainer_version - versions, torch.full_like(versions, -1))


class OffPolicyStats:
    """Sums of one step's diagnostics, by staleness; `add` per micro-batch, `merge` over ranks,
    `metrics()` at the end. Unknown staleness (-1, or no version given) counts in the totals only."""

    def __init__(self) -> None:
        self.by_staleness: dict[int, _Sums] = {}

    def add(self, proximal_lp_T: torch.Tensor, sampler_lp_T: torch.Tensor, mask_T: torch.Tensor,
            staleness_T: torch.Tensor | None, clipped_T: torch.Tensor | None = None,
            bounded_T: torch.Tensor | None = None) -> None:
        """One micro-batch's tokens (all [T]; the logprobs float32, no gradient needed). Tokens
        with a non-finite log-weight are left out (the loss masks them and counts them)."""
        with torch.no_grad():
            log_w = proximal_lp_T.detach().float() - sampler_lp_T.float().to(proximal_lp_T.device)
            keep = mask_T.to(log_w.device).bool() & torch.isfinite(log_w)
            log_w = log_w.clamp(-_LOG_W_CLAMP, _LOG_W_CLAMP)
            w = torch.exp(log_w)
            k3 = w - 1.0 - log_w
            stale = (torch.full_like(log_w, -1, dtype=torch.long) if staleness_T is None
                     else staleness_T.to(log_w.device).long())
            none = torch.zeros_like(keep)
            clipped = none if clipped_T is None else clipped_T.to(log_w.device).bool()
            bounded = none if bounded_T is None else bounded_T.to(log_w.device).bool()
            for k in torch.unique(stale[keep]).tolist():
                sel = keep & (stale == k)
                ws = w[sel]
                part = _Sums(int(sel.sum()), float(ws.sum()), float((ws * ws).sum()), float(ws.max()),
                             float(k3[sel].sum()), float(log_w[sel].abs().sum()),
                             int((clipped & sel).sum()), int((bounded & sel).sum()))
                self.by_staleness.setdefault(int(k), _Sums()).add(part)

    def merge(self, other: OffPolicyStats) -> None:
        for k, sums in other.by_staleness.items():
            self.by_staleness.setdefault(k, _Sums()).add(sums)

    def metrics(self) -> dict[str, float]:
        """The step's `offpolicy/*` metrics (module docstring); empty with no trained token."""
        total, lag = _Sums(), _Sums()
        out: dict[str, float] = {}
        for k in sorted(self.by_staleness):
            sums = self.by_staleness[k]
            total.add(sums)
            if k >= 0:
                out.update(sums.metrics(f"offpolicy/s{k}/"))
            if k >= 1:
                lag.add(sums)
        if not total.tokens:
            return {}
        out.update(total.metrics("offpolicy/"))
        if lag.tokens:
            out.update(lag.metrics("offpolicy/lag/"))
        return out

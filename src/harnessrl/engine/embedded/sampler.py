"""Next-token choice for a batch of rows, each with its own sampling parameters, and its logprob.

Responsibility: given the last-position logits of B rows, pick one id per row (greedy or
sampled with the row's own `torch.Generator`) and return the natural-log probability of that
id under the distribution it was drawn from.

The distribution (the order of HF's `TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper`, and of vLLM's sampler):
  1. `lp = log_softmax(logits / T)`, with T = 1 when the row is greedy (temperature 0);
  2. top-k: keep the k largest `lp` (ties at the k-th value are kept), renormalise;
  3. top-p (nucleus, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"):
     keep the smallest prefix of ids sorted by probability whose mass reaches `top_p`
     (an id is kept when the mass strictly before it is < top_p), renormalise.
Renormalising is `lp - logsumexp(lp[kept])`. When neither filter is active, the logprob is
exactly `log_softmax(logits / T)[id]`, what a trainer computes on the same ids.

Temperatures between 0 and `MIN_TEMPERATURE` are raised to it (`effective_temperature`):
dividing float32 logits by a denormal such as 1e-45 gives inf and NaN probabilities, from
which no id can be drawn. The engine and the proxy record the value actually used.

What it deliberately does not do: repetition penalties, min-p, logit bias, beam search.
Invariant: every returned logprob is <= 0 (the chosen id is always in the kept set), finite
whenever the logits are; a row whose distribution cannot be sampled (non-finite logits)
raises `ValueError` naming the row instead of returning an id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harnessrl.types import MIN_TEMPERATURE, effective_temperature

__all__ = ["MIN_TEMPERATURE", "RowSampling", "effective_temperature", "filter_logprobs", "sample_next"]


@dataclass(frozen=True, slots=True)
class RowSampling:
    """Sampling parameters of one row (the subset of `types.Sampling` the sampler needs)."""

    temperature: float
    """0 means greedy (argmax; logprobs of the T=1 distribution)."""
    top_p: float = 1.0
    top_k: int = 0

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def filter_logprobs(lp_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Restrict a row's log-distribution to its top-k / top-p set and renormalise.

    Args:
        lp_V: log-probabilities over the vocabulary, shape [V], float32.
        top_k: ids kept by rank; 0 keeps all.
        top_p: nucleus mass kept, in (0, 1]; 1.0 keeps all.

    Returns:
        Shape [V]: renormalised log-probabilities, -inf outside the kept set.
    """
    if 0 < top_k < lp_V.shape[-1]:
        kth_value = torch.topk(lp_V, top_k).values[-1]
        lp_V = lp_V.masked_fill(lp_V < kth_value, float("-inf"))
        lp_V = lp_V - torch.logsumexp(lp_V, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = _sorted_head(lp_V, top_p)
        probs = sorted_lp.exp()
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False  # the most likely id is always kept
        drop = torch.ones_like(lp_V, dtype=torch.bool).scatter_(-1, order, drop_sorted)
        lp_V = lp_V.masked_fill(drop, float("-inf"))
        lp_V = lp_V - torch.logsumexp(lp_V, dim=-1)
    return lp_V


_TOP_P_HEAD_IDS = 1024
"""Ids examined first for top-p: when they hold >= top_p of the mass the nucleus lies within
them (exact), which avoids sorting the whole vocabulary."""


def _sorted_head(lp_V: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The highest log-probabilities in descending order, enough of them to hold mass top_p."""
    if lp_V.shape[-1] > _TOP_P_HEAD_IDS:
        head = torch.topk(lp_V, _TOP_P_HEAD_IDS)
        if float(torch.logsumexp(head.values, dim=-1)) >= math.log(top_p):
            return head.values, head.indices
    return torch.sort(lp_V, descending=True)


def sample_next(
    logits_B_V: torch.Tensor,
    rows: Sequence[RowSampling],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[float]]:
    """Choose the next id of every row and its logprob.

    Args:
        logits_B_V: last-position logits, shape [B, V] (cast to float32 here).
        rows: B sampling parameter sets, one per row.
        generators: B CPU generators; row b draws only from `generators[b]`, so a row's
            samples depend on its own seed and logits, not on which rows share the batch.

    Returns:
        (ids, logprobs): two lists of length B.
    """
    assert logits_B_V.shape[0] == len(rows) == len(generators), "one RowSampling and generator per row"
    temps = [effective_temperature(r.temperature) if r.temperature > 0 else 1.0 for r in rows]
    scaled_B_V = logits_B_V.float()
    if any(t != 1.0 for t in temps):  # dividing by 1.0 changes nothing: skipped (one [B, V] copy less)
        scaled_B_V = scaled_B_V / torch.tensor(temps, dtype=torch.float32).unsqueeze(-1)
    lp_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    if any(r.needs_filter for r in rows):
        lp_B_V = torch.stack(
            [
                filter_logprobs(lp_B_V[b], r.top_k, r.top_p) if r.needs_filter else lp_B_V[b]
                for b, r in enumerate(rows)
            ]
        )
    ids_B = torch.argmax(lp_B_V, dim=-1)
    sampled = [b for b, r in enumerate(rows) if r.temperature > 0]
    if sampled:
        ids_B[sampled] = _inverse_cdf_sample(lp_B_V[sampled], [generators[b] for b in sampled])
    logprobs_B = lp_B_V.gather(-1, ids_B.unsqueeze(-1)).squeeze(-1)
    return ids_B.tolist(), logprobs_B.tolist()


def _inverse_cdf_sample(lp_S_V: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per row from `exp(lp)` by inverse-CDF: the first id whose cumulative mass exceeds u.

    One uniform per row from the row's own generator (`torch.multinomial` costs a random
    number per vocabulary entry). The CDF is accumulated in float64; with `u` in [0, 1) the
    target `u * total` lies below the last CDF entry, so an id is always found, and an id of
    zero probability (CDF equal to its predecessor's) cannot be chosen.
    """
    cdf_S_V = torch.cumsum(lp_S_V.exp(), dim=-1, dtype=torch.float64)
    u_S = torch.cat([torch.rand((1,), generator=g, dtype=torch.float64) for g in generators])
    target_S_1 = (u_S * cdf_S_V[:, -1]).unsqueeze(-1)
    ids_S = torch.searchsorted(cdf_S_V, target_S_1, right=True).squeeze(-1)
    bad = (ids_S >= lp_S_V.shape[-1]).nonzero().flatten().tolist()
    if bad:  # a NaN total (non-finite logits): no id can be drawn
        raise ValueError(f"rows {bad} of the sampled batch have no valid distribution "
                         f"(total mass {cdf_S_V[bad[0], -1].item()!r})")
    return ids_S

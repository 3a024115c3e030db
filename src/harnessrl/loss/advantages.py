"""Group-relative advantages: one pure function per variant, over the rewards of one group.

Responsibility: map `rewards_G` (one reward per rollout of a group, None when unscored) to one
advantage per rollout, and stamp it on that rollout's rows.

Rules shared by every variant (DESIGN.md §6):
  * A rollout with reward None (infra error, unscorable) is excluded from the baseline and gets
    advantage None (no gradient).
  * A rollout with a reward but no trainable row still counts in the baseline: its outcome is a
    sample of the policy's returns for this task, and dropping it would bias the baseline
    towards rollouts whose turns happened to train. It simply contributes no tokens.
  * A zero-variance group (every scored reward equal, or a single scored rollout) gives
    advantage 0.0 to every scored rollout and reports `zero_variance=True`, so the trainer can
    count it; it contributes no policy gradient.

What this module does not do: combine reward parts (the verifier and `rollout_reward_fn` do),
or normalise across groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from harnessrl.errors import ConfigError
from harnessrl.types import Row


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """Advantages of one group. Shapes: `advantages_G` has length G."""

    advantages_G: tuple[float | None, ...]
    """Advantage per rollout, None for rollouts without a reward."""
    zero_variance: bool
    """All scored rewards were equal (or only one was scored): no policy gradient."""
    num_scored: int
    """Rollouts with a reward (the baseline's population)."""


AdvantageFn = Callable[[Sequence[float | None]], GroupAdvantages]


def _scored(rewards_G: Sequence[float | None]) -> list[float]:
    scored = [float(r) for r in rewards_G if r is not None]
    for r in scored:
        if not math.isfinite(r):
            raise ValueError(f"reward {r!r} is not finite; use None for an unscored rollout")
    return scored


def _degenerate(rewards_G: Sequence[float | None], scored: list[float]) -> GroupAdvantages | None:
    """The shared result for groups with no scored reward or zero variance, else None."""
    if not scored:
        return GroupAdvantages(tuple(None for _ in rewards_G), False, 0)
    if max(scored) == min(scored):
        advs = tuple(None if r is None else 0.0 for r in rewards_G)
        return GroupAdvantages(advs, True, len(scored))
    return None


def grpo_advantages(rewards_G: Sequence[float | None], eps: float = 1e-6) -> GroupAdvantages:
    """GRPO: `A_i = (r_i - mean(r)) / (std(r) + eps)` over scored rollouts.

    Source: Shao et al. 2024, "DeepSeekMath", §4.1.2 (outcome supervision). `std` is the
    population standard deviation (divide by N, not N-1).
    """
    scored = _scored(rewards_G)
    if (done := _degenerate(rewards_G, scored)) is not None:
        return done
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored))
    advs = tuple(None if r is None else (r - mean) / (std + eps) for r in rewards_G)
    return GroupAdvantages(advs, False, len(scored))


def dr_grpo_advantages(rewards_G: Sequence[float | None]) -> GroupAdvantages:
    """Dr. GRPO: `A_i = r_i - mean(r)` over scored rollouts (no division by the std).

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    §3.2. Its other half, a constant (not per-sequence-length) loss normaliser, is the
    trainer's default global token mean (`losses.py`).
    """
    scored = _scored(rewards_G)
    if (done := _degenerate(rewards_G, scored)) is not None:
        return done
    mean = sum(scored) / len(scored)
    return GroupAdvantages(tuple(None if r is None else r - mean for r in rewards_G), False, len(scored))


def rloo_advantages(rewards_G: Sequence[float | None]) -> GroupAdvantages:
    """RLOO: `A_i = r_i - mean_{j != i} r_j` over scored rollouts (leave-one-out baseline).

    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs", eq. (4) (Kool et al. 2019). Equivalently
    `N/(N-1) * (r_i - mean(r))`. A single scored rollout has no baseline: zero variance.
    """
    scored = _scored(rewards_G)
    if (done := _degenerate(rewards_G, scored)) is not None:
        return done
    n, total = len(scored), sum(scored)
    advs = tuple(None if r is None else r - (total - r) / (n - 1) for r in rewards_G)
    return GroupAdvantages(advs, False, n)


def advantage_fn_for(name: str) -> AdvantageFn:
    """The advantage function named `name`: `grpo`, `dr_grpo` or `rloo`.

    Raises:
        ConfigError: unknown name.
    """
    match name:
        case "grpo":
            return grpo_advantages
        case "dr_grpo":
            return dr_grpo_advantages
        case "rloo":
            return rloo_advantages
        case _:
            raise ConfigError(f"advantage={name!r} is not one of 'grpo', 'dr_grpo', 'rloo'")


def stamp_advantage(rows: Sequence[Row], advantage: float) -> list[Row]:
    """Copies of `rows` with `advantage` set (all rows of a rollout share its advantage)."""
    return [dataclasses.replace(row, advantage=advantage) for row in rows]

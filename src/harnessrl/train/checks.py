"""Run-time checks of the token-faithfulness invariant on the rows a step trains.

`untraceable_trained_tokens` counts trained tokens whose (id, sampler logprob) pair is not one
the engine produced in an `ok` turn of the row's rollout (DESIGN.md §3.1: every trained token id
is an id the engine sampled, with the engine's logprob). The trainer logs it every step as
`invariant/untraceable_trained_tokens`; anything but 0 is a bug.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from harnessrl.types import Rollout, Row


def untraceable_trained_tokens(rows: Sequence[Row], rollouts: Sequence[Rollout]) -> int:
    """Trained tokens of `rows` not matched, as a multiset, by sampled tokens of their rollout."""
    sampled: dict[str, Counter[tuple[int, float]]] = {}
    for rollout in rollouts:
        counter: Counter[tuple[int, float]] = Counter()
        for turn in rollout.trace.turns:
            if turn.status == "ok":
                counter.update(zip(turn.completion_ids, turn.completion_logprobs))
        sampled[rollout.rollout_id] = counter
    missing = 0
    for row in rows:
        available = sampled.get(row.rollout_id, Counter())
        for tok, lp, m in zip(row.input_ids, row.sampler_logprobs, row.completion_mask):
            if not m:
                continue
            if available[(tok, lp)] > 0:
                available[(tok, lp)] -= 1
            else:
                missing += 1
    return missing

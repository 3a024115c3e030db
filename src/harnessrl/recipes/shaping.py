"""Reward-shaping hooks usable from a config by dotted path.

* `opencode_tool_use_reward`: the reference recipe's shaping (reference-system.md §1 "Verify and
  reward"): no `bash` call → -0.1; else the verifier's reward (0 on timeout) minus
  `min(0.5, 0.03 * max(0, tool_calls - 20))`.
* `first_token_parity_reward`: a smoke-test reward with variance even for a random-weight model
  (1.0 when the first completion id of the first ok turn is even, else 0.0). It says nothing
  about the task; it exists so a pipeline test can see a gradient.
"""

from __future__ import annotations

from harnessrl.train.hooks import RolloutOutcome


def opencode_tool_use_reward(outcome: RolloutOutcome) -> float | None:
    if outcome.reward is None:
        return None
    if outcome.tool_calls_by_name.get("bash", 0) == 0:
        return -0.1
    base = 0.0 if outcome.timed_out else outcome.reward
    total_calls = sum(outcome.tool_calls_by_name.values())
    return base - min(0.5, 0.03 * max(0, total_calls - 20))


def first_token_parity_reward(outcome: RolloutOutcome) -> float | None:
    for turn in outcome.rollout.trace.turns:
        if turn.status == "ok" and turn.completion_ids:
            return 1.0 if turn.completion_ids[0] % 2 == 0 else 0.0
    return None

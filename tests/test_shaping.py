"""The reference recipe's tool-use shaping, hand-computed."""

from __future__ import annotations

import pytest

from harnessrl.recipes.shaping import opencode_tool_use_reward
from harnessrl.hooks import outcome_of
from harnessrl.types import Rollout, Trace, Turn


def _rollout(reward: float | None, calls: list[str], status: str = "ok") -> Rollout:
    tool_calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}} for i, n in enumerate(calls)]
    turn = Turn(turn_index=0, request={}, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1],
                response={"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": tool_calls}}]})
    return Rollout(rollout_id="r", group_id=0, task_id="t", harness="opencode", status=status, reward=reward,
                   trace=Trace(session_id="s", turns=[turn]))


def test_opencode_tool_use_reward() -> None:
    assert opencode_tool_use_reward(outcome_of(_rollout(1.0, ["read"]))) == -0.1  # no bash call
    assert opencode_tool_use_reward(outcome_of(_rollout(1.0, ["bash", "read"]))) == 1.0
    # 25 calls: 1.0 - min(0.5, 0.03 * (25 - 20)) = 1.0 - 0.15 = 0.85
    assert opencode_tool_use_reward(outcome_of(_rollout(1.0, ["bash"] * 25))) == pytest.approx(0.85)
    # timed out: base 0 whatever the verifier said
    assert opencode_tool_use_reward(outcome_of(_rollout(1.0, ["bash"], status="timeout"))) == 0.0
    assert opencode_tool_use_reward(outcome_of(_rollout(None, ["bash"]))) is None

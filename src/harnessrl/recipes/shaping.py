"""Reward-shaping hooks usable from a config by dotted path.

* `opencode_tool_use_reward`: the reference recipe's shaping (TRL's async GRPO opencode example,
  `opencode_reward`): no `bash` call → -0.1; else the verifier's reward (0 on timeout) minus
  `min(0.5, 0.03 * max(0, tool_calls - 20))`.
* `action_format_credit`: the default recipe's shaping for small models. A 135M model rarely
  solves a task outright, so a group's verifier rewards are mostly all 0 and carry no gradient.
  This adds partial credit for replies that are well-formed actions of the agent's text
  protocol (exactly one fenced ```` ```mswea_bash_command ```` or ```` ```bash ```` block):
  `r + bonus * (fraction of well-formed replies) * (1 - r)`, so a solved task still scores 1
  and an unscored rollout stays None. Tool-call replies (when the request had tools) count as
  well-formed too.
* `alternating_smoke_reward`: a pipeline smoke-test reward, 0.0, 1.0, 0.0, ... in call order
  (None for unscored rollouts), so every group of two or more has variance and a gradient even
  with a random-weight model. It says nothing about the task: for tests and benchmarks only.

All of them read the protocol-neutral record (`Turn.reply`, `RolloutOutcome`), so a rollout
of Codex (Responses), Claude Code (Messages) or a chat-completions agent is shaped alike.
"""

from __future__ import annotations

import itertools
import re

from harnessrl.hooks import RolloutOutcome, tool_call_names

FORMAT_BONUS = 0.3
"""Most partial credit `action_format_credit` gives for well-formed replies."""

_SMOKE_COUNTER = itertools.count()

_ACTION_BLOCK = re.compile(r"```(?:mswea_bash_command|bash)[^\n]*\n.*?```", re.DOTALL)


def opencode_tool_use_reward(outcome: RolloutOutcome) -> float | None:
    if outcome.reward is None:
        return None
    if outcome.tool_calls_by_name.get("bash", 0) == 0:
        return -0.1
    base = 0.0 if outcome.timed_out else outcome.reward
    total_calls = sum(outcome.tool_calls_by_name.values())
    return base - min(0.5, 0.03 * max(0, total_calls - 20))


def action_format_credit(outcome: RolloutOutcome) -> float | None:
    if outcome.reward is None:
        return None
    replies = 0
    well_formed = 0
    for turn in outcome.rollout.trace.turns:
        if turn.status != "ok" or turn.reply is None:
            continue
        replies += 1
        content = turn.reply.content or ""
        if tool_call_names(turn) or len(_ACTION_BLOCK.findall(content)) == 1:
            well_formed += 1
    fraction = well_formed / replies if replies else 0.0
    return outcome.reward + FORMAT_BONUS * fraction * (1.0 - outcome.reward)


def alternating_smoke_reward(outcome: RolloutOutcome) -> float | None:
    if outcome.reward is None:
        return None
    return float(next(_SMOKE_COUNTER) % 2)

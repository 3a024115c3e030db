"""The verifier of OpenEnv tasks: `session.verify(transcript, final_state)`, then `close()`.

Responsibility: score a rollout of `tasks.kind = "openenv"` with its own session's `verify`,
after the agent is dead and its key revoked (the runner's order). The reward is the
environment's own (`VerifyResult.env_reward`, else the last reward a tool result carried, as
OpenEnv resolves it); a verify result that disagrees with the tool trace, or gives no reward,
is `Reward.error`, so the rollout is `verifier_error` and is never trained. Numeric
`VerifyResult.metrics` become the reward's parts (`env_reward` included); shaping, if any,
stays in `Rollout.train_reward` (`recipes/shaping.py`), never here.

A `verify` that raises comes back as the runner's `verifier crashed: ...` (status
`verifier_error`, not a crash of the run). The session is closed whatever happened.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from harnessrl.rewards.base import Reward
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task
from harnessrl.tasks.openenv import LiveSession, _close_quietly, sessions_for


class OpenEnvVerifier:
    """Scores an OpenEnv task by calling its rollout's session (see the module docstring)."""

    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        sessions = sessions_for(task)
        live = sessions.pop(sandbox)
        if live is None:
            return Reward(value=None, error="no OpenEnv session for this rollout (factory.create failed?)")
        try:
            return await asyncio.to_thread(_verify, live)
        finally:
            await asyncio.to_thread(_close, live)


def _verify(live: LiveSession) -> Reward:
    result = live.session.verify(list(live.transcript), dict(live.final_state))
    env_reward = getattr(result, "env_reward", None)
    metrics: dict[str, Any] = dict(getattr(result, "metrics", {}) or {})
    verify_reward = None if env_reward is None else float(env_reward)
    trace_reward = live.tool_reward
    if (trace_reward is not None and verify_reward is not None
            and not math.isclose(verify_reward, trace_reward, rel_tol=1e-9, abs_tol=1e-6)):
        return Reward(value=None, error=f"verify() env_reward {verify_reward} differs from the environment's "
                                        f"last tool reward {trace_reward}")
    value = trace_reward if trace_reward is not None else verify_reward
    if value is None or not math.isfinite(value):
        return Reward(value=None, error=f"verify() gave no finite env_reward (got {env_reward!r})")
    parts = {k: float(v) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
    parts["env_reward"] = value
    if getattr(result, "done", None) is not None:
        parts["done"] = float(bool(result.done))
    return Reward(value=value, parts=parts)


def _close(live: LiveSession) -> None:
    _close_quietly(live)

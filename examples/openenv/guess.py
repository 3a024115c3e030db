"""An OpenEnv step environment, unchanged, as harnessrl tasks (`tasks.kind = "openenv"`).

`GuessFactory` is an ordinary OpenEnv `ResourceSessionFactory`: each `create` wraps a fresh
step/reset/state client in OpenEnv's `StepEnvSessionAdapter`. Nothing here imports harnessrl;
the same factory works in any OpenEnv consumer. Needs `pip install 'harnessrl[openenv]'`.

    harnessrl rollout --config examples/openenv/guess.toml --limit 2
"""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_server.mcp_types import Tool
from openenv.core.env_server.types import State
from openenv.core.harness import ResourceSessionFactory, StepEnvSessionAdapter, VerifyResult


class GuessClient:
    """Guess a number from 1 to `high` in one step; reward 1 when right."""

    def __init__(self, secret: int, high: int) -> None:
        self.secret, self.high, self.steps, self.episode_id = secret, high, 0, None

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> StepResult:
        self.steps, self.episode_id = 0, episode_id
        return StepResult(observation={"hint": f"a number from 1 to {self.high}"}, reward=None, done=False)

    def step(self, action: dict[str, Any]) -> StepResult:
        self.steps += 1
        return StepResult(observation={"right": action.get("n") == self.secret},
                          reward=float(action.get("n") == self.secret), done=True)

    def state(self) -> State:
        return State(episode_id=self.episode_id, step_count=self.steps)


def _verify(transcript: list[dict[str, Any]], final_state: Any, last: StepResult | None, state: Any) -> VerifyResult:
    return VerifyResult(env_reward=0.0 if last is None else float(last.reward or 0.0), done=last is not None,
                        metrics={"step_count": state.step_count if state else 0})


class GuessFactory(ResourceSessionFactory):
    def __init__(self, high: int = 5) -> None:
        self.high = high

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> StepEnvSessionAdapter:
        secret = 1 + (seed or 0) % self.high  # the group seed picks the group's secret
        return StepEnvSessionAdapter(
            GuessClient(secret, self.high), task=task, seed=seed, episode_id=episode_id,
            tool_specs=[Tool(name="guess", description="Guess the number.",
                             input_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"]})],
            action_builder=lambda name, args: dict(args),
            initial_messages_builder=lambda result, task: [
                {"role": "user", "content": f"Guess {result.observation['hint']} with the guess tool."}],
            verify_builder=_verify)

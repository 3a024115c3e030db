"""OpenEnv environments written against the real `openenv` package, for tests/test_openenv*.py.

Loaded by path (`tasks.factory = "tests/openenv_envs.py:GuessFactory"`), as a user's own
module would be.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_server.mcp_types import Tool
from openenv.core.env_server.types import State
from openenv.core.harness import (
    ResourceSession,
    ResourceSessionFactory,
    StepEnvSessionAdapter,
    ToolResult,
    VerifyResult,
)

CREATED: list[dict[str, Any]] = []
"""Every `create` call (task, seed, episode_id, endpoint keys), in order."""
CLOSED: list[str] = []
"""episode_id of every closed session."""
_LOCK = threading.Lock()


class GuessClient:
    """A step/reset/state environment: guess the secret number with one `step`."""

    def __init__(self, secret: int) -> None:
        self.secret = secret
        self.steps = 0
        self.episode_id: str | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> StepResult:
        self.steps, self.episode_id = 0, episode_id
        return StepResult(observation={"hint": "a number from 1 to 5"}, reward=None, done=False)

    def step(self, action: dict[str, Any]) -> StepResult:
        self.steps += 1
        right = int(action.get("n", -1)) == self.secret
        return StepResult(observation={"right": right}, reward=1.0 if right else 0.0, done=True)

    def state(self) -> State:
        return State(episode_id=self.episode_id, step_count=self.steps)

    def close(self) -> None:
        with _LOCK:
            CLOSED.append(str(self.episode_id))


GUESS_TOOL = Tool(name="guess", description="Guess the secret number.",
                  input_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


def _verify(transcript: list[dict[str, Any]], final_state: Any, last: StepResult | None, state: Any) -> VerifyResult:
    # the environment's own reward; a rollout that never guessed scores 0
    reward = 0.0 if last is None else float(last.reward or 0.0)
    return VerifyResult(env_reward=reward, done=last is not None,
                        metrics={"step_count": state.step_count if state else 0, "turns": len(transcript)})


class GuessFactory(ResourceSessionFactory):
    """One `StepEnvSessionAdapter` over a fresh `GuessClient` per rollout."""

    def __init__(self, secret: int = 3, fail_verify: bool = False) -> None:
        self.secret = secret
        self.fail_verify = fail_verify

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> ResourceSession:
        with _LOCK:
            CREATED.append({"task": task, "seed": seed, "episode_id": episode_id})

        def verify(*args: Any) -> VerifyResult:
            if self.fail_verify:
                raise RuntimeError("the grader is down")
            return _verify(*args)

        return StepEnvSessionAdapter(
            GuessClient(self.secret), task=task, seed=seed, episode_id=episode_id, tool_specs=[GUESS_TOOL],
            action_builder=lambda name, args: dict(args),
            initial_messages_builder=lambda result, task: [
                {"role": "system", "content": "Use the guess tool once."},
                {"role": "user", "content": f"Guess the secret: {result.observation['hint']}. {task or ''}".strip()}],
            verify_builder=verify)


AGENT = r"""
import json, sys, urllib.request
base, key, model = sys.argv[1:4]
body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as resp:
    reply = json.load(resp)
print(reply["choices"][0]["message"]["content"] or "")
"""


class AgentSession(ResourceSession):
    """A loop-owning session: `create` started an agent process pointed at `base_url`."""

    def __init__(self, episode_id: str, base_url: str, api_key: str, model: str, hang: bool, marker: str = "") -> None:
        self.episode_id = episode_id
        # a hanging agent ignores SIGINT (a terminal's Ctrl-C reaches it too): only close() ends it
        script = (f"import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)  # {marker}"
                  if hang else AGENT)
        self.proc = subprocess.Popen([sys.executable, "-c", script, base_url, api_key, model],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.output = ""

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Say hi."}]

    def list_tools(self) -> list[Tool]:
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        raise KeyError(f"Unknown tool: {name}")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"agent still running after {timeout_s} s") from exc
        self.output = out
        return self.proc.returncode

    def fetch_proxy_trace(self) -> list[dict[str, Any]]:
        return []

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        return VerifyResult(env_reward=1.0 if self.proc.returncode == 0 else 0.0, done=True,
                            metrics={"exit_code": float(self.proc.returncode or 0)})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with _LOCK:
            CLOSED.append(self.episode_id)


class AgentFactory(ResourceSessionFactory):
    """Starts `AgentSession`s; takes the endpoint keywords harnessrl offers."""

    def __init__(self, hang: bool = False, marker: str = "") -> None:
        self.hang = hang
        self.marker = marker
        """Put in a hanging agent's command line, so a test finds the process."""

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None, *,
               base_url: str = "", api_key: str = "", model: str = "") -> AgentSession:
        with _LOCK:
            CREATED.append({"task": task, "seed": seed, "episode_id": episode_id, "base_url": base_url})
        return AgentSession(str(episode_id), base_url, api_key, model, self.hang, self.marker)


GOOD_ENTRY = {"request": {"messages": [{"role": "user", "content": "hi"}]},
              "response": {"choices": [{"message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
              "prompt_token_ids": [1, 2, 3], "completion_token_ids": [7, 8], "per_token_logps": [-0.5, -0.25],
              "loss_mask": [0, 0, 0, 1, 1]}
BAD_ENTRIES = [
    {**GOOD_ENTRY, "per_token_logps": [-0.5]},                                  # count off
    {**GOOD_ENTRY, "prompt_token_ids": []},                                     # no prompt ids
    {**GOOD_ENTRY, "per_token_logps": [-0.5, 0.5]},                             # positive logprob
    {**GOOD_ENTRY, "loss_mask": [0, 0, 0, 0, 0]},                               # producer masked it
    {**GOOD_ENTRY, "response": {**GOOD_ENTRY["response"], "usage": {"completion_tokens": 5}}},  # usage disagrees
    "not an object",
]
STRINGS_ENTRY = {**GOOD_ENTRY, "prompt_token_ids": [1, 2, 3, 7, 8, 4], "completion_token_ids": [],  # continues GOOD
                 "completion_tokens": ["token_id:7", "token_id:9"], "loss_mask": [0] * 6 + [1, 1]}


class TraceOnlySession(AgentSession):
    """A loop-owning session whose agent used its own capture: only `fetch_proxy_trace`."""

    def __init__(self, episode_id: str) -> None:
        self.episode_id = episode_id
        self.proc = subprocess.Popen([sys.executable, "-c", "pass"])

    def fetch_proxy_trace(self) -> list[Any]:
        return [GOOD_ENTRY, *BAD_ENTRIES, STRINGS_ENTRY]


class TraceOnlyFactory(ResourceSessionFactory):
    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> TraceOnlySession:
        with _LOCK:
            CREATED.append({"task": task, "seed": seed, "episode_id": episode_id})
        return TraceOnlySession(str(episode_id))


class TrainableOnlySession(TraceOnlySession):
    """A `TrainableSession`: its own validated capture as OpenEnv's `TrainingTrace`."""

    def fetch_training_trace(self) -> Any:
        from openenv.core.harness import TrainingTrace

        entry = {**GOOD_ENTRY, "metadata": {"node_id": "n0"}}
        return TrainingTrace.from_entries([entry])


class TrainableOnlyFactory(ResourceSessionFactory):
    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> TrainableOnlySession:
        with _LOCK:
            CREATED.append({"task": task, "seed": seed, "episode_id": episode_id})
        return TrainableOnlySession(str(episode_id))

"""OpenEnv sessions as harnessrl tasks, with the real `openenv` package.

Unit level: the task source and its dataset, the white-box loop driving a session's tools (a
scripted model reply, the session real), the verifier (reward, parts, disagreement, a raising
`verify`), close on every path. End to end on tiny-random: a `StepEnvSessionAdapter`
environment trains one white-box step; a loop-owning session's own agent process, pointed at
the proxy with the rollout's key, runs a rollout; a cancelled rollout leaves nothing open.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")

import openenv_envs as envs  # noqa: E402  (tests/ is on sys.path)
from fakes import FakeSandbox  # noqa: E402

from harnessrl.config import load_config  # noqa: E402
from harnessrl.errors import ConfigError  # noqa: E402
from harnessrl.harness.openenv_loop import run_openenv_session  # noqa: E402
from harnessrl.rewards.openenv import OpenEnvVerifier  # noqa: E402
from harnessrl.rewards.select import verifier_for  # noqa: E402
from harnessrl.tasks.openenv import OpenEnvSource, sessions_for, tool_specs  # noqa: E402
from harnessrl.types import Endpoint  # noqa: E402

ENVS = str(Path(__file__).with_name("openenv_envs.py"))
GUESS = "openenv_envs:GuessFactory"
AGENT = "openenv_envs:AgentFactory"
ENDPOINT = Endpoint(base_url="http://127.0.0.1:9/v1", api_key="k" * 32, model="m")


class ScriptedModel:
    """Stands in for `WhiteBoxHarness`: `_sample` returns the scripted replies in order."""

    def __init__(self, replies: list[dict[str, Any]], max_turns: int = 4) -> None:
        self.replies = list(replies)
        self.seen: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []

        class _Cfg:
            pass

        self._config = _Cfg()
        self._config.max_turns = max_turns  # type: ignore[attr-defined]

    async def _sample(self, messages, tools, endpoint):  # noqa: ANN001
        self.seen.append((list(messages), list(tools)))
        return self.replies.pop(0), None


def _call(name: str, args: dict[str, Any], call_id: str = "c1") -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def test_source_gives_each_group_its_task_and_seed(tmp_path: Path) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"instruction": "easy"}\n\n"plain text"\n')
    source = OpenEnvSource(GUESS, {"secret": 2}, str(data))
    assert len(source) == 2
    t0, t3 = source.get(0), source.get(3)
    assert (t0.task_id, t0.family, t0.instruction) == ("openenv/0", "openenv", "easy")
    assert (t3.task_id, t3.instruction, t3.metadata["openenv_seed"]) == ("openenv/1", "plain text", 3)
    assert t0.metadata["openenv_task"] == {"instruction": "easy"}
    assert sessions_for(t0).factory.secret == 2
    assert isinstance(verifier_for(t0), OpenEnvVerifier)
    none = OpenEnvSource(GUESS).get(5)
    assert none.metadata["openenv_task"] is None and none.instruction == ""


def test_bad_factory_and_dataset_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tasks.factory"):
        OpenEnvSource(f"{ENVS}:NoSuchFactory")
    with pytest.raises(ConfigError, match=r"tasks.factory = .*GUESS_TOOL.* not a callable"):
        OpenEnvSource(f"{ENVS}:GUESS_TOOL")
    with pytest.raises(ConfigError, match=r"with kwargs \{'nope': 1\} raised TypeError"):
        OpenEnvSource(GUESS, {"nope": 1})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{nope\n')
    with pytest.raises(ConfigError, match=r"line 2 is not JSON"):
        OpenEnvSource(GUESS, {}, str(bad))
    with pytest.raises(ConfigError, match="tasks.factory is required"):
        load_config(None, ['tasks.kind="openenv"'])
    cfg = load_config(None, ['tasks.kind="openenv"', f'tasks.factory="{GUESS}"', "tasks.kwargs={secret = 4}"])
    assert cfg.tasks.factory == GUESS and cfg.tasks.kwargs == {"secret": 4}


def test_reserved_tool_names_are_refused() -> None:
    from openenv.core.env_server.mcp_types import Tool

    ok = tool_specs([envs.GUESS_TOOL])
    assert ok[0]["function"]["name"] == "guess" and ok[0]["function"]["parameters"]["required"] == ["n"]
    with pytest.raises(ValueError, match="reserved"):
        tool_specs([Tool(name="step", description="", input_schema={})])


async def test_white_box_loop_calls_the_session_tools_and_verify_scores() -> None:
    source = OpenEnvSource(GUESS, {"secret": 3})
    task = source.get(7)
    sandbox = FakeSandbox()
    model = ScriptedModel([_call("reset", {}), _call("nope", {"n": 1}, "c2"), _call("guess", {"n": 3}, "c3")])
    result = await run_openenv_session(model, task, sandbox, ENDPOINT, 30.0)  # type: ignore[arg-type]
    assert result.exit_code == 0 and result.error is None
    # the session's messages and tools were the model's task
    first_messages, tools = model.seen[0]
    assert first_messages[1]["content"].startswith("Guess the secret: a number from 1 to 5")
    assert [t["function"]["name"] for t in tools] == ["guess"]
    # a reserved name and an unknown tool are errors to the model; the guess ended the episode
    transcript = model.seen[-1][0]
    tool_msgs = [m for m in transcript if m["role"] == "tool"]
    assert tool_msgs[0]["content"] == "error: reserved orchestration tool: reset"
    assert tool_msgs[1]["content"] == "error: Unknown tool: nope"
    live = sessions_for(task).get(sandbox)
    assert live is not None and live.final_state["done"] is True
    assert live.final_state["metrics"] == {"turns": 3, "tool_calls": 1}
    assert live.tool_reward == 1.0
    created = envs.CREATED[-1]
    assert created["seed"] == 7 and created["task"] is None
    reward = await OpenEnvVerifier().score(task, sandbox, result.final_answer)
    assert reward.error is None and reward.value == 1.0
    assert reward.parts["env_reward"] == 1.0 and reward.parts["step_count"] == 1.0 and reward.parts["done"] == 1.0
    assert envs.CLOSED[-1] == created["episode_id"] and len(sessions_for(task)) == 0


async def test_wrong_guess_reply_without_tools_and_raising_verify() -> None:
    task = OpenEnvSource(GUESS, {"secret": 3}).get(0)
    sandbox = FakeSandbox()
    await run_openenv_session(ScriptedModel([_call("guess", {"n": 1})]), task, sandbox, ENDPOINT, 30.0)  # type: ignore[arg-type]
    assert (await OpenEnvVerifier().score(task, sandbox, None)).value == 0.0
    # no tool call at all: done after one reply, the environment's verify still scores it
    sandbox2 = FakeSandbox()
    await run_openenv_session(ScriptedModel([{"role": "assistant", "content": "5"}]), task, sandbox2, ENDPOINT, 30.0)  # type: ignore[arg-type]
    reward = await OpenEnvVerifier().score(task, sandbox2, "5")
    assert reward.value == 0.0 and reward.parts["step_count"] == 0.0
    # verify raises: the runner turns it into verifier_error; the session is closed anyway
    failing = OpenEnvSource(GUESS, {"fail_verify": True}).get(0)
    sandbox3 = FakeSandbox()
    await run_openenv_session(ScriptedModel([_call("guess", {"n": 3})]), failing, sandbox3, ENDPOINT, 30.0)  # type: ignore[arg-type]
    episode = envs.CREATED[-1]["episode_id"]
    with pytest.raises(RuntimeError, match="the grader is down"):
        await OpenEnvVerifier().score(failing, sandbox3, None)
    assert envs.CLOSED[-1] == episode and len(sessions_for(failing)) == 0
    # no session (create never ran): an error reward, not a crash
    assert (await OpenEnvVerifier().score(task, FakeSandbox(), None)).error.startswith("no OpenEnv session")


async def test_a_failing_create_is_the_agents_error_and_a_cancel_closes() -> None:
    task = OpenEnvSource(GUESS).get(0)
    task_bad = type(task)(task_id=task.task_id, family=task.family, instruction="",
                          metadata={**task.metadata, "openenv_seed": "not-an-int"})
    sessions = sessions_for(task)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no sandbox quota")

    real = sessions.factory.create
    sessions.factory.create = broken
    try:
        result = await run_openenv_session(ScriptedModel([]), task_bad, FakeSandbox(), ENDPOINT, 30.0)  # type: ignore[arg-type]
    finally:
        sessions.factory.create = real
    assert result.exit_code == 1 and result.error == "OpenEnv factory.create raised OSError: no sandbox quota"

    class Hanging(ScriptedModel):
        async def _sample(self, messages, tools, endpoint):  # noqa: ANN001
            await asyncio.sleep(3600)

    sandbox = FakeSandbox()
    run = asyncio.ensure_future(run_openenv_session(Hanging([]), task, sandbox, ENDPOINT, 30.0))  # type: ignore[arg-type]
    while sessions.get(sandbox) is None:
        await asyncio.sleep(0.01)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert sessions.get(sandbox) is None and envs.CLOSED[-1] == envs.CREATED[-1]["episode_id"]


def test_own_trace_entries_are_validated_like_any_upstream() -> None:
    from harnessrl.harness.openenv_trace import turn_from_entry

    good = turn_from_entry(envs.GOOD_ENTRY, 0, 5)
    assert good.status == "ok" and good.error is None
    assert (good.prompt_ids, good.completion_ids, good.completion_logprobs) == ([1, 2, 3], [7, 8], [-0.5, -0.25])
    assert good.reply is not None and good.reply.content == "yo" and good.policy_version == 5
    assert good.finish_reason == "stop" and good.protocol == "openenv"
    reasons = [turn_from_entry(e, i, 5) for i, e in enumerate(envs.BAD_ENTRIES)]
    assert [t.status for t in reasons] == ["unfaithful"] * len(envs.BAD_ENTRIES)
    assert "len(completion_ids)=2 != len(completion_logprobs)=1" in reasons[0].error
    assert reasons[1].error == "prompt_ids is empty"
    assert "completion_logprobs[1]=0.5" in reasons[2].error
    assert "masked the whole completion" in reasons[3].error
    assert "usage.completion_tokens=5 != len(completion_ids)=2" in reasons[4].error
    assert "not an object" in reasons[5].error
    strings = turn_from_entry(envs.STRINGS_ENTRY, 7, 5)
    assert strings.status == "ok" and strings.completion_ids == [7, 9]

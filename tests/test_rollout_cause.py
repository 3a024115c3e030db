"""A rollout that fails because of the proxy (context exceeded, reply cut) says so in its error,
with the setting to change, not only the agent's exit code."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.rewards.base import Reward
from harnessrl.rollout.cause import explain_agent_error, proxy_cause
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.types import Sampling, Trace, Turn

# an agent that, like Codex, reports only its exit code when a call fails or comes back cut
AGENT = r"""
import json, sys, urllib.error, urllib.request
base_url, key, words = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = {"model": "m", "messages": [{"role": "user", "content": "hello " * words}], "max_tokens": 64}
req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
try:
    reply = json.load(urllib.request.urlopen(req, timeout=60))
except urllib.error.HTTPError:
    print("0"); sys.exit(1)
if reply["choices"][0]["finish_reason"] == "length":
    print("0"); sys.exit(1)
"""


class _ZeroVerifier:
    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        return Reward(value=0.0)


@pytest.fixture(scope="module")
def small_engine(tiny_model_dir: Path) -> Iterator[object]:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, seed=0, max_context_tokens=256)
    yield eng
    eng.close()


@pytest.fixture
async def proxy(small_engine: object) -> AsyncIterator[object]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    # no call budget: an overlong prompt gets the 400 under test, not a final stop
    config = ProxyConfig(port=0, model_name="m", enforce_sampling=True, max_model_calls=0,
                         sampling=SamplingConfig(max_tokens=4))
    async with ProxyServer(small_engine, ChatLayer(small_engine.tokenizer), config) as server:  # type: ignore[attr-defined]
        yield server


@pytest.mark.parametrize(("words", "expected"), [
    (400, "the proxy refused 1 call(s) over the context limit"),
    (3, "the agent's last reply (turn 0) was cut at 4 tokens (cap 4"),
])
async def test_rollout_error_names_the_proxy_cause(proxy: object, sandbox_root: Path, words: int, expected: str) -> None:
    harness = CommandHarness(CommandHarnessConfig(
        name="script", argv=["python3", "{state_dir}/agent.py", "{base_url}", "{api_key}", str(words)],
        files={"agent.py": AGENT}))
    # the cause, not the isolation, is under test here: no network namespace to route through
    backend = LocalSandboxBackend(SandboxConfig(root_dir=sandbox_root, use_bwrap=False))
    rollout = await run_rollout(Task("t/0", "test", "go"), 0, harness, backend, proxy,  # type: ignore[arg-type]
                                _ZeroVerifier(), RolloutLimits(60.0, 10.0))
    assert rollout.status == "agent_error"
    assert rollout.error is not None and rollout.error.startswith(expected), rollout.error
    assert rollout.error.endswith("(agent: script exited with code 1: 0)")
    fix = "raise engine.max_context_tokens" if words > 100 else "raise sampling.max_tokens"
    assert fix in rollout.error


def _turn(i: int, **kw: object) -> Turn:
    return Turn(turn_index=i, **{"request": {}, **kw})  # type: ignore[arg-type]


def test_proxy_cause_precedence_and_silence() -> None:
    cut = _turn(0, completion_ids=[1, 2], completion_logprobs=[-1.0, -1.0], finish_reason="length",
                sampling=Sampling(max_tokens=2))
    ctx = _turn(1, status="error", error="the prompt has 300 tokens and the context limit is 256 tokens "
                                         "(max_context_tokens), which leaves no room for a completion")
    other = _turn(2, status="error", error="engine error: stopped")
    fine = _turn(0, completion_ids=[1], completion_logprobs=[-1.0], finish_reason="stop")
    assert "context limit (turn 1:" in proxy_cause(Trace(session_id="s", turns=[cut, ctx, other]))  # type: ignore[operator]
    assert proxy_cause(Trace(session_id="s", turns=[fine, other])) == \
        "the proxy answered 1 call(s) with an error (turn 2: engine error: stopped)"
    assert "cut at 2 tokens (cap 2" in proxy_cause(Trace(session_id="s", turns=[cut]))  # type: ignore[operator]
    assert proxy_cause(Trace(session_id="s", turns=[cut, fine])) is None
    asked = _turn(0, request={"max_tokens": 2}, completion_ids=[1, 2], completion_logprobs=[-1.0, -1.0],
                  finish_reason="length", sampling=Sampling(max_tokens=2))
    assert "cut at 2 tokens, the max_tokens the agent itself asked for" in proxy_cause(  # type: ignore[operator]
        Trace(session_id="s", turns=[asked]))
    assert proxy_cause(Trace(session_id="s")) is None
    assert explain_agent_error("codex exited with code 1: 0", Trace(session_id="s", turns=[fine])) == \
        "codex exited with code 1: 0"
    assert explain_agent_error("x", None) == "x"

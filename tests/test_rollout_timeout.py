"""A rollout that times out says why: the engine calls its agent still waited on (prompt tokens,
how far the prefill got, tokens decoded, seconds waiting and decoding) and the agent's last
output, so a slow engine reads apart from a hung agent. Real calls through the proxy to the tiny
model, made slow on purpose (a long prompt prefilled a few tokens at a time; a long greedy reply)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harnessrl.engine.base import CALL_PROGRESS, CallProgress
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.rewards.base import Reward
from harnessrl.rollout.cause import describe_call, timeout_cause
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.types import CallInFlight, Sampling, Trace

# says what it does, then makes one call (greedy, so the tiny model's reply is the same each run)
AGENT = r"""
import json, sys, time, urllib.request
base_url, key, words, sleep_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
print("asking the model", flush=True)
if sleep_s:
    print("thinking on my own", flush=True); time.sleep(sleep_s)
body = {"model": "m", "messages": [{"role": "user", "content": "hello " * words}], "temperature": 0}
req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=600).read()
print("done", flush=True)
"""


class _ZeroVerifier:
    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        return Reward(value=0.0)


@pytest.fixture(scope="module")
def slow_engine(tiny_model_dir: Path) -> Iterator[object]:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    # 4 prompt tokens a chunk: a prompt of ~3,000 tokens takes hundreds of forwards to prefill
    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, seed=0, max_context_tokens=32768, prefill_chunk_tokens=4)
    yield eng
    eng.close()


@pytest.fixture
async def proxy(slow_engine: object) -> AsyncIterator[object]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer

    config = ProxyConfig(port=0, model_name="m", sampling=SamplingConfig(max_tokens=30000), enforce_sampling=False)
    async with ProxyServer(slow_engine, ChatLayer(slow_engine.tokenizer), config) as server:  # type: ignore[attr-defined]
        yield server


async def _timed_out(proxy: object, sandbox_root: Path, words: int, sleep_s: float = 0.0):  # type: ignore[no-untyped-def]
    harness = CommandHarness(CommandHarnessConfig(
        name="script", argv=["python3", "{state_dir}/agent.py", "{base_url}", "{api_key}", str(words), str(sleep_s)],
        files={"agent.py": AGENT}))
    backend = LocalSandboxBackend(SandboxConfig(root_dir=sandbox_root, use_bwrap=False))
    return await run_rollout(Task("t/0", "test", "go"), 0, harness, backend, proxy,  # type: ignore[arg-type]
                             _ZeroVerifier(), RolloutLimits(agent_timeout_s=3.0, verify_timeout_s=10.0))


async def test_a_timeout_during_a_long_prefill_records_the_call_and_how_far_it_got(
        proxy: object, sandbox_root: Path) -> None:
    rollout = await _timed_out(proxy, sandbox_root, words=3000)
    assert rollout.status == "timeout"
    [call] = rollout.trace.in_flight
    assert call.turn_index == 0 and call.prompt_tokens > 3000
    assert call.prefilled_tokens is not None and 0 <= call.prefilled_tokens < call.prompt_tokens
    assert call.decoded_tokens == 0 and call.decode_s is None
    assert call.wait_s == call.age_s and 0.0 < call.age_s <= 3.5
    # nothing came back: a turn, if any, is the call's cancellation when the agent was killed
    assert all(t.error is not None and "cancelled" in t.error and not t.completion_ids for t in rollout.trace.turns)
    assert rollout.error is not None
    assert rollout.error.startswith(f"agent exceeded 3 s; 1 engine call(s) in flight at the timeout (turn 0: "
                                    f"{call.prompt_tokens:,} prompt tokens, {call.prefilled_tokens:,} prefilled, 0 decoded")
    assert rollout.error.endswith("the engine was still serving the agent; agent's last output: 'asking the model'")
    # and it survives the round trip through rollouts.jsonl
    assert type(rollout).model_validate_json(rollout.model_dump_json()).trace.in_flight == [call]


async def test_a_timeout_during_a_long_reply_records_tokens_decoded(proxy: object, sandbox_root: Path) -> None:
    rollout = await _timed_out(proxy, sandbox_root, words=3)
    assert rollout.status == "timeout"
    [call] = rollout.trace.in_flight
    assert call.prefilled_tokens == call.prompt_tokens < 40
    assert call.decoded_tokens is not None and call.decoded_tokens > 0
    assert call.wait_s is not None and call.decode_s is not None and call.decode_s > 0.0
    assert call.wait_s + call.decode_s == pytest.approx(call.age_s, abs=0.01)
    assert rollout.error is not None and f"{call.decoded_tokens:,} decoded" in rollout.error


async def test_a_hung_agent_has_no_call_in_flight(proxy: object, sandbox_root: Path) -> None:
    rollout = await _timed_out(proxy, sandbox_root, words=3, sleep_s=60.0)
    assert rollout.status == "timeout"
    assert rollout.trace.in_flight == []
    assert rollout.error == ("agent exceeded 3 s; no engine call in flight at the timeout: the agent itself was "
                             "busy or hung; agent's last output: 'thinking on my own'")


async def test_the_engine_advances_the_current_call_progress(slow_engine: object) -> None:
    progress = CallProgress(prompt_tokens=40)
    token = CALL_PROGRESS.set(progress)
    try:
        completion = await slow_engine.generate(list(range(100, 140)), Sampling(temperature=0.0, max_tokens=5))  # type: ignore[attr-defined]
    finally:
        CALL_PROGRESS.reset(token)
    assert progress.prefilled_tokens == 40
    assert progress.decoded_tokens == len(completion.completion_ids) > 0
    assert progress.prefilled_s is not None and progress.prefilled_s > progress.started_s


def test_the_message_names_each_call_and_an_engine_without_progress() -> None:
    trace = Trace(session_id="s", in_flight=[
        CallInFlight(turn_index=1, prompt_tokens=7501, age_s=598.04, prefilled_tokens=3072, decoded_tokens=0,
                     wait_s=598.04),
        CallInFlight(turn_index=2, prompt_tokens=120, age_s=12.0),
    ])
    assert timeout_cause(600, trace, "a\n\nlast line  \n\n") == (
        "agent exceeded 600 s; 2 engine call(s) in flight at the timeout (turn 1: 7,501 prompt tokens, "
        "3,072 prefilled, 0 decoded, 598.0 s waiting or prefilling; turn 2: 120 prompt tokens, 12.0 s since "
        "it was sent (the engine reports no progress)): the engine was still serving the agent; "
        "agent's last output: 'last line'")
    decoding = CallInFlight(turn_index=0, prompt_tokens=10, age_s=5.0, prefilled_tokens=10, decoded_tokens=77,
                            wait_s=1.0, decode_s=4.0)
    assert describe_call(decoding) == "turn 0: 10 prompt tokens, 10 prefilled, 77 decoded, 1.0 s to prefill, 4.0 s decoding"
    assert timeout_cause(5, None, "").endswith("the agent itself was busy or hung; the agent wrote no output")


def test_the_store_reports_the_longest_prefill_and_records_calls_at_close() -> None:
    from harnessrl.proxy.sessions import SessionStore

    store = SessionStore()
    a, b = store.open("a"), store.open("b")
    assert store.longest_prefill() is None
    a.engine_calls[0] = CallProgress(prompt_tokens=7501, started_s=100.0, prefilled_tokens=3072, decoded_tokens=0)
    b.engine_calls[0] = CallProgress(prompt_tokens=2000, started_s=100.0, prefilled_tokens=0, decoded_tokens=0)
    b.engine_calls[1] = CallProgress(prompt_tokens=9000, started_s=100.0)  # an engine that reports nothing
    longest = store.longest_prefill()
    assert longest is a.engine_calls[0]  # 4,429 tokens left against 2,000
    a.engine_calls[0].prefilled_s = 101.0  # decoding now: no longer a prefill
    assert store.longest_prefill() is b.engine_calls[0]
    trace = store.close(a.session_id)
    [call] = trace.in_flight
    assert (call.turn_index, call.prompt_tokens, call.prefilled_tokens, call.wait_s) == (0, 7501, 3072, 1.0)
    assert call.decode_s is not None and call.decode_s == pytest.approx(call.age_s - 1.0, abs=0.01)
    assert store.close(b.session_id).in_flight[1].prefilled_tokens is None
    assert "in_flight" not in Trace(session_id="s").model_dump_json()  # written only when there were calls

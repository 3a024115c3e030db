"""`max_model_calls`: past the budget, and when the context is exhausted, the agent gets a final
stop in its own protocol (chat completions, Anthropic Messages, Responses; unary and stream),
recorded as an error turn and never trained."""

from __future__ import annotations

import json

import pytest
from fakes import FakeEngine, in_process

from harnessrl.chat.layer import ChatLayer
from harnessrl.train.samples import build_rows
from harnessrl.types import Rollout

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def chat(tokenizer) -> ChatLayer:  # noqa: ANN001
    return ChatLayer(tokenizer)


def _rows(session) -> list:  # noqa: ANN001
    r = Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status="ok", reward=1.0, trace=session.trace)
    return build_rows(r)[0]


async def test_chat_completions_budget_gives_a_final_stop(chat: ChatLayer) -> None:
    http, store = in_process(FakeEngine(), chat, max_model_calls=2)
    session = store.open("budget")
    auth = {"authorization": f"Bearer {session.key}"}
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4}
    for _ in range(2):
        r = await http.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] != ""
    r = await http.post("/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"] == {"role": "assistant", "content": ""}
    r = await http.post("/v1/chat/completions", json={**body, "stream": True}, headers=auth)
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    turns = session.trace.turns
    assert [t.status for t in turns] == ["ok", "ok", "error", "error"]
    assert turns[2].notes[-1] == "final_stop: max_model_calls=2 reached" and turns[2].completion_ids == []
    # what trains is the engine's reply (the identical first call is a superseded retry), nothing of the stops
    trained = [t for row in _rows(session) for t, m in zip(row.input_ids, row.completion_mask) if m]
    assert trained == turns[1].completion_ids and trained


async def test_anthropic_budget_and_exhausted_context(chat: ChatLayer) -> None:
    http, store = in_process(FakeEngine(), chat, max_model_calls=1)
    session = store.open("anthropic")
    auth = {"x-api-key": session.key}
    body = {"model": "m", "max_tokens": 4, "messages": MESSAGES}
    assert (await http.post("/v1/messages", json=body, headers=auth)).status_code == 200
    r = await http.post("/v1/messages", json=body, headers=auth)
    assert r.status_code == 200
    msg = r.json()
    assert msg["type"] == "message" and msg["stop_reason"] == "end_turn"
    assert not [b for b in msg["content"] if b.get("type") == "tool_use"]
    assert "".join(b.get("text", "") for b in msg["content"]) == ""
    r = await http.post("/v1/messages", json={**body, "stream": True}, headers=auth)
    events = [f.splitlines()[0] for f in r.text.split("\n\n") if f.strip()]
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    delta = [json.loads(f.splitlines()[1][6:]) for f in r.text.split("\n\n") if f.startswith("event: message_delta")]
    assert delta[0]["delta"]["stop_reason"] == "end_turn"
    assert [t.status for t in session.trace.turns] == ["ok", "error", "error"]
    # the context is exhausted (a prompt longer than the engine's context): also a final stop
    small = FakeEngine(max_context_tokens=8)
    http2, store2 = in_process(small, chat, max_model_calls=10)
    s2 = store2.open("ctx")
    r = await http2.post("/v1/messages", json={**body, "messages": [{"role": "user", "content": "word " * 50}]},
                         headers={"x-api-key": s2.key})
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn"
    assert s2.trace.turns[0].status == "error" and s2.trace.turns[0].notes[-1].startswith("final_stop: context exhausted")
    # without a budget the old answer stays: a 400 naming the context
    http3, store3 = in_process(small, chat, max_model_calls=0)
    s3 = store3.open("ctx400")
    r = await http3.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "word " * 50}]},
                         headers={"authorization": f"Bearer {s3.key}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_responses_budget_gives_a_completed_response(chat: ChatLayer) -> None:
    http, store = in_process(FakeEngine(), chat, max_model_calls=1)
    session = store.open("responses")
    auth = {"authorization": f"Bearer {session.key}"}
    body = {"model": "m", "input": "hello", "max_output_tokens": 4}
    assert (await http.post("/v1/responses", json=body, headers=auth)).status_code == 200
    r = await http.post("/v1/responses", json=body, headers=auth)
    assert r.status_code == 200
    out = r.json()
    assert out["status"] == "completed"
    assert not [item for item in out["output"] if item.get("type") == "function_call"]
    assert [t.status for t in session.trace.turns] == ["ok", "error"]

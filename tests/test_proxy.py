"""Proxy in-process (httpx.ASGITransport) with a FakeEngine: routing, auth, wire, SSE, errors, traces."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from fakes import FakeEngine, in_process
from harnessrl.chat.layer import ChatLayer
from harnessrl.errors import EngineError
from harnessrl.proxy.app import ADMIN_MAX_BODY_BYTES, ProxyDeps, make_admin_app, make_app
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.sessions import SessionStore, read_traces

BASH = {"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
USER = [{"role": "user", "content": "list files"}]
ADMIN_TOKEN = "test-admin-token-0123456789"


class Proxy:
    def __init__(self, tokenizer, engine: FakeEngine, trace_path: Path | None = None, **config) -> None:
        self.engine = engine
        self.config = ProxyConfig(trace_path=trace_path, **config)
        self.store = SessionStore(trace_path)
        deps = ProxyDeps(CaptureDeps(engine, ChatLayer(tokenizer), self.config), self.store)
        self.app = make_app(deps)
        self.admin_app = make_admin_app(deps, ADMIN_TOKEN, lambda: "http://127.0.0.1:9")
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://127.0.0.1")
        self.admin = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.admin_app), base_url="http://127.0.0.1",
                                       headers={"authorization": f"Bearer {ADMIN_TOKEN}"})

    async def open(self, rollout_id: str = "r0") -> dict:
        r = await self.admin.post("/admin/sessions", json={"rollout_id": rollout_id})
        assert r.status_code == 200, r.text
        return r.json()

    def sdk(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=key, max_retries=0,
                                  http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app)))

    async def chat(self, key: str, body: dict, **kw) -> httpx.Response:
        return await self.http.post("/v1/chat/completions", json=body,
                                    headers={"authorization": f"Bearer {key}", **kw.pop("headers", {})}, **kw)


def tool_call_ids(tokenizer, command: str = "ls") -> list[int]:
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "%s"}}\n</tool_call>' % command
    return tokenizer.encode(text, add_special_tokens=False) + [2]


@pytest.fixture
def tool_proxy(tokenizer) -> Proxy:
    return Proxy(tokenizer, FakeEngine(completion_ids=tool_call_ids(tokenizer)),
                 sampling=SamplingConfig(temperature=0.7, max_tokens=100))


async def test_sdk_unary_tool_call_and_recorded_turn(tool_proxy: Proxy):
    s = await tool_proxy.open()
    client = tool_proxy.sdk(s["key"])
    resp = await client.chat.completions.create(model="m", messages=USER, tools=[BASH], temperature=0.0, max_tokens=500)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"command": "ls"}
    n = len(tool_proxy.engine.completion_ids)
    assert resp.usage.completion_tokens == n
    (prompt_ids, sampling), = tool_proxy.engine.calls
    assert resp.usage.prompt_tokens == len(prompt_ids)
    trace = (await tool_proxy.admin.get(f"/admin/sessions/{s['session_id']}/trace")).json()
    turn = trace["turns"][0]
    assert turn["prompt_ids"] == prompt_ids  # recorded ids are the engine's input
    assert len(turn["completion_ids"]) == len(turn["completion_logprobs"]) == turn["usage"]["completion_tokens"] == n
    # the run's sampling wins over the agent's temperature=0; max_tokens capped at 100
    assert turn["sampling"]["temperature"] == 0.7 and turn["sampling"]["max_tokens"] == 100
    assert sampling.temperature == 0.7 and turn["status"] == "ok" and turn["request"]["temperature"] == 0.0
    assert turn["headers"]["user-agent"].startswith("AsyncOpenAI/Python")
    assert resp.choices[0].logprobs is None


async def test_sdk_stream_reassembles_to_the_unary_message(tool_proxy: Proxy):
    s = await tool_proxy.open()
    client = tool_proxy.sdk(s["key"])
    unary = await client.chat.completions.create(model="m", messages=USER, tools=[BASH])
    stream = await client.chat.completions.create(model="m", messages=USER, tools=[BASH], stream=True,
                                                  stream_options={"include_usage": True})
    content, calls, finish, usage = "", {}, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    u = unary.choices[0]
    assert content == u.message.content and finish == u.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in u.message.tool_calls]
    assert usage.completion_tokens == unary.usage.completion_tokens
    assert usage.prompt_tokens == unary.usage.prompt_tokens


async def test_stream_helper_get_final_completion(tool_proxy: Proxy):
    s = await tool_proxy.open()
    client = tool_proxy.sdk(s["key"])
    async with client.chat.completions.stream(model="m", messages=USER, tools=[BASH]) as stream:
        final = await stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "bash"
    assert final.choices[0].finish_reason == "tool_calls"


async def test_raw_sse_shape_and_no_usage_without_include_usage(tool_proxy: Proxy):
    s = await tool_proxy.open()
    r = await tool_proxy.chat(s["key"], {"messages": USER, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # no tools sent: text stays text
    assert all("usage" not in c for c in chunks)


async def test_keyed_path_route_and_models(tool_proxy: Proxy):
    s = await tool_proxy.open()
    assert s["keyed_base_url"] == f"http://127.0.0.1:9/r/{s['key']}/v1"
    r = await tool_proxy.http.post(f"/r/{s['key']}/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    m = await tool_proxy.http.get(f"/r/{s['key']}/v1/models")
    assert m.json()["data"][0]["id"] == "harnessrl-policy"


async def test_logprobs_when_asked(tokenizer):
    proxy = Proxy(tokenizer, FakeEngine(completion_ids=tokenizer.encode("hi there", add_special_tokens=False) + [2]))
    s = await proxy.open()
    body = (await proxy.chat(s["key"], {"messages": USER, "logprobs": True})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["hi", " there", "<|im_end|>"]
    assert [c["logprob"] for c in content] == [-0.5, -0.5, -0.5]
    assert body["choices"][0]["message"]["content"] == "hi there"


async def test_length_beats_tool_calls(tokenizer):
    ids = tool_call_ids(tokenizer)
    proxy = Proxy(tokenizer, FakeEngine(completion_ids=ids), sampling=SamplingConfig(max_tokens=len(ids) - 1))
    s = await proxy.open()
    body = (await proxy.chat(s["key"], {"messages": USER, "tools": [BASH]})).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "bash"


async def test_unknown_and_revoked_keys_get_401_and_are_counted(tool_proxy: Proxy):
    r = await tool_proxy.chat("nope", {"messages": USER})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    s = await tool_proxy.open()
    assert (await tool_proxy.chat(s["key"], {"messages": USER})).status_code == 200
    closed = await tool_proxy.admin.delete(f"/admin/sessions/{s['session_id']}")
    assert closed.status_code == 200 and len(closed.json()["turns"]) == 1
    for _ in range(2):
        assert (await tool_proxy.chat(s["key"], {"messages": USER})).status_code == 401
    assert (await tool_proxy.http.post(f"/r/{s['key']}/v1/chat/completions", json={})).status_code == 401
    trace = (await tool_proxy.admin.get(f"/admin/sessions/{s['session_id']}/trace")).json()
    assert trace["rejected_calls"] == 3 and trace["closed_at"] is not None


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": USER, "temperature": "hot"}, "temperature", "number"),
    ({"messages": USER, "n": 2}, "n", "not supported"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"messages": USER, "logit_bias": {"5": 1}}, "logit_bias", "not supported"),
    ({"messages": USER, "frobnicate": 1}, "frobnicate", "unsupported field"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"messages": USER, "stream": "yes"}, "stream", "bool"),
    ({"messages": USER, "tool_choice": "required", "tools": [BASH]}, "tool_choice", "not supported"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "messages[0].content"),
    ({"model": "m"}, "messages", "messages"),
])
async def test_bad_input_is_400_naming_the_field(tool_proxy: Proxy, body, param, words):
    s = await tool_proxy.open()
    r = await tool_proxy.chat(s["key"], body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]
    assert tool_proxy.engine.calls == []
    turn = tool_proxy.store.get(s["session_id"]).trace.turns[0]
    assert turn.status == "error" and words in turn.error


async def test_malformed_json_and_oversized_body(tokenizer):
    proxy = Proxy(tokenizer, FakeEngine(), max_body_bytes=2048)
    s = await proxy.open()
    auth = {"authorization": f"Bearer {s['key']}", "content-type": "application/json"}
    r = await proxy.http.post("/v1/chat/completions", content=b'{"messages": [', headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = await proxy.http.post("/v1/chat/completions", content=b"[1, 2]", headers=auth)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = await proxy.chat(s["key"], big)
    assert r.status_code == 413 and "max_body_bytes=2048" in r.json()["error"]["message"]


async def test_context_too_long_is_400_naming_the_limit(tokenizer):
    proxy = Proxy(tokenizer, FakeEngine(max_context_tokens=64), max_model_calls=0)  # no budget: no final stop
    s = await proxy.open()
    r = await proxy.chat(s["key"], {"messages": [{"role": "user", "content": "word " * 100}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "context limit is 64 tokens" in err["message"]


async def test_max_tokens_capped_by_context_left(tokenizer):
    proxy = Proxy(tokenizer, FakeEngine(max_context_tokens=60))
    s = await proxy.open()
    await proxy.chat(s["key"], {"messages": USER, "max_completion_tokens": 4000})
    prompt_ids, sampling = proxy.engine.calls[0]
    assert sampling.max_tokens == 60 - len(prompt_ids)


async def test_engine_failure_unary_and_stream(tokenizer):
    proxy = Proxy(tokenizer, FakeEngine(fail_with=EngineError("engine stopped")))
    s = await proxy.open()
    r = await proxy.chat(s["key"], {"messages": USER})
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
    r = await proxy.chat(s["key"], {"messages": USER, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert "engine stopped" in json.loads(events[-2][6:])["error"]["message"]
    turns = proxy.store.get(s["session_id"]).trace.turns
    assert [t.status for t in turns] == ["error", "error"] and turns[0].prompt_ids  # prompt kept for inspection
    with pytest.raises(openai.APIError):
        stream = await proxy.sdk(s["key"]).chat.completions.create(model="m", messages=USER, stream=True)
        async for _ in stream:
            pass


async def test_unfaithful_turn_is_marked(tokenizer):
    proxy = Proxy(tokenizer, FakeEngine(logprob=0.5))  # a positive logprob is impossible
    s = await proxy.open()
    assert (await proxy.chat(s["key"], {"messages": USER})).status_code == 200
    turn = proxy.store.get(s["session_id"]).trace.turns[0]
    assert turn.status == "unfaithful" and "completion_logprobs[0]=0.5" in turn.error


async def test_headers_and_request_kind_recorded(tool_proxy: Proxy):
    s = await tool_proxy.open()
    meta = json.dumps({"request_kind": "compaction", "turn_id": "t"})
    await tool_proxy.chat(s["key"], {"messages": USER}, headers={
        "x-session-id": "ses_abc", "X-Stainless-Retry-Count": "1", "x-codex-turn-metadata": meta, "x-other": "no"})
    turn = tool_proxy.store.get(s["session_id"]).trace.turns[0]
    assert turn.headers["x-session-id"] == "ses_abc" and turn.headers["x-stainless-retry-count"] == "1"
    assert "x-other" not in turn.headers and turn.request_kind == "compaction"


async def test_admin_needs_its_token_and_bounds_bodies(tool_proxy: Proxy):
    anonymous = httpx.AsyncClient(transport=httpx.ASGITransport(app=tool_proxy.admin_app), base_url="http://proxy")
    wrong = {"authorization": "Bearer " + "x" * len(ADMIN_TOKEN)}
    for headers in ({}, wrong, {"x-api-key": ADMIN_TOKEN}):
        r = await anonymous.post("/admin/sessions", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    assert tool_proxy.store.live_sessions == 0
    big = {"rollout_id": "r" * (ADMIN_MAX_BODY_BYTES + 1)}
    r = await tool_proxy.admin.post("/admin/sessions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    s = await tool_proxy.open("r1")
    assert s["base_url"] == "http://127.0.0.1:9/v1"  # the agents' listener, not the admin one
    # the agents' app serves no admin route at all, with or without the token
    r = await tool_proxy.http.post("/admin/sessions", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 404
    assert (await tool_proxy.http.get("/healthz")).json() == {"ok": True}
    assert (await tool_proxy.admin.get("/admin/sessions/ses_missing/trace")).status_code == 404
    assert (await tool_proxy.http.get("/nowhere")).json()["error"]["code"] == "404"


async def test_traces_written_on_close_and_read_back(tokenizer, tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    proxy = Proxy(tokenizer, FakeEngine(), trace_path=path)
    a, b = await proxy.open("ra"), await proxy.open("rb")
    for _ in range(2):
        await proxy.chat(a["key"], {"messages": USER})
    await proxy.chat(b["key"], {"messages": USER, "stream": True})
    for s in (a, b):
        await proxy.admin.delete(f"/admin/sessions/{s['session_id']}")
    traces = read_traces(path)
    assert [(t.rollout_id, len(t.turns)) for t in traces] == [("ra", 2), ("rb", 1)]
    assert [t.turn_index for t in traces[0].turns] == [0, 1]
    assert traces[1].turns[0].completion_ids == [42, 2]


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_a_call_holding_the_closing_tag_reaches_every_protocol(tokenizer, api: str):
    """A sampled call whose string argument holds `</tool_call>` comes back as a tool call on
    chat completions, Responses and Messages alike (not as text with finish_reason stop)."""
    doc = "wrap calls in <tool_call></tool_call>"
    text = "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": f"echo '{doc}'"}}) + "\n</tool_call>"
    engine = FakeEngine(completion_ids=tokenizer.encode(text, add_special_tokens=False) + [2])
    http, store = in_process(engine, ChatLayer(tokenizer))
    key = store.open("tag").key
    params = BASH["function"]["parameters"]
    path, body = {
        "chat": ("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [BASH]}),
        "responses": ("/v1/responses", {"model": "m", "input": "list files",
                                        "tools": [{"type": "function", "name": "bash", "parameters": params}]}),
        "messages": ("/v1/messages", {"model": "m", "max_tokens": 50, "messages": USER,
                                      "tools": [{"name": "bash", "input_schema": params}]}),
    }[api]
    r = await http.post(path, json=body, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    out = r.json()
    if api == "chat":
        assert out["choices"][0]["finish_reason"] == "tool_calls"
        args = out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    elif api == "responses":
        calls = [item for item in out["output"] if item["type"] == "function_call"]
        assert len(calls) == 1 and [i for i in out["output"] if i["type"] == "message"] == []
        args = calls[0]["arguments"]
    else:
        assert out["stop_reason"] == "tool_use" and [b["type"] for b in out["content"]] == ["tool_use"]
        args = json.dumps(out["content"][0]["input"])
    assert json.loads(args) == {"command": f"echo '{doc}'"}

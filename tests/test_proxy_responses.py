"""`POST /v1/responses` on the real proxy: the official `openai` SDK (unary and stream, with
tools) on the tiny model over a real socket, stream == unary at temperature 0, captured Codex
requests replayed, input conversion, 400s naming the field, and engine failures as
`response.failed`."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fakes import CAPTURES_DIR, FakeEngine, broken_engine, in_process

from harnessrl.chat.layer import ChatLayer, normalize_messages
from harnessrl.errors import RequestError
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.responses import IGNORED_FIELDS, to_chat_body
from harnessrl.proxy.server import ProxyServer
from harnessrl.types import check_turn_faithful

CAPTURES = sorted((CAPTURES_DIR / "codex").glob("responses-*.json"))
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}



def events_of(text: str) -> list[dict]:
    out = []
    for frame in text.split("\n\n"):
        data = [ln[6:] for ln in frame.splitlines() if ln.startswith("data: ")]
        if data:
            out.append(json.loads(data[0]))
    return out


async def test_sdk_unary_and_stream_agree_on_tiny_model(engine, chat):
    config = ProxyConfig(port=0, sampling=SamplingConfig(temperature=0.0, max_tokens=10))
    async with ProxyServer(engine, chat, config) as proxy:
        session_id, key = proxy.open_session("resp")
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        kwargs = {"model": "tiny", "instructions": "Be brief.", "tools": [TOOL],
                  "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]}
        unary = await client.responses.create(**kwargs)
        async with client.responses.stream(**kwargs) as stream:
            events = [e async for e in stream]
        trace = proxy.close_session(session_id)
    # random weights never stop on their own: cut at the cap -> incomplete, as the API reports it
    assert unary.status == "incomplete" and unary.incomplete_details.reason == "max_output_tokens"
    final = events[-1]
    assert [events[0].type, events[1].type, final.type] == ["response.created", "response.in_progress",
                                                            "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.response.output_text == unary.output_text and len(unary.output_text) > 0
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == unary.output_text
    assert final.response.usage.output_tokens == unary.usage.output_tokens == 10
    a, b = trace.turns
    assert a.protocol == b.protocol == "responses" and a.status == b.status == "ok"
    assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
    assert unary.usage.input_tokens == len(a.prompt_ids)
    assert check_turn_faithful(a) is None and check_turn_faithful(b) is None
    assert a.raw_request["instructions"] == "Be brief." and a.raw_response["id"] == unary.id
    assert b.raw_response["status"] == "incomplete"
    assert b.raw_response["output"][0]["content"][0]["text"] == unary.output_text
    # the neutral record: the chat layer's messages and the parsed reply
    assert a.request["messages"][0] == {"role": "system", "content": "Be brief."}
    assert a.reply.content == b.reply.content == unary.output_text and a.reply.tool_calls == []


def _tool_call_engine(tokenizer, text: str) -> FakeEngine:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return FakeEngine(completion_ids=[*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")])


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                                  "Sunny and warm."])
async def test_sdk_stream_helper_reassembles_completed_response(tokenizer, text):
    engine = _tool_call_engine(tokenizer, text)
    chat = ChatLayer(tokenizer, eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    http, store = in_process(engine, chat)
    session = store.open("sdk")
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key=session.key, http_client=http, max_retries=0)
    kwargs = {"model": "m", "input": "Weather in Paris?", "tools": [TOOL]}
    unary = await client.responses.create(**kwargs)
    async with client.responses.stream(**kwargs) as stream:
        final = await stream.get_final_response()
    assert unary.status == final.status == "completed"
    strip = lambda items: [{k: v for k, v in i.model_dump(exclude_none=True).items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(final.output) == strip(unary.output)
    if "tool_call" in text:
        call = unary.output[0]
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    else:
        assert unary.output_text == final.output_text == "Sunny and warm."
    assert [t.protocol for t in session.trace.turns] == ["responses", "responses"]
    assert session.trace.turns[0].completion_ids == list(engine.completion_ids)


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.stem)
async def test_captured_codex_requests_stream_and_record(engine, chat, capture: Path):
    http, store = in_process(engine, chat, sampling=SamplingConfig(max_tokens=4))
    session = store.open("codex")
    recorded = json.loads(capture.read_text())
    headers = {k: v for k, v in recorded["headers"].items()
               if k.lower() not in ("authorization", "content-length", "host", "accept-encoding")}
    headers["authorization"] = f"Bearer {session.key}"
    r = await http.post("/v1/responses", json=recorded["body"], headers=headers)
    assert r.status_code == 200, r.text
    events = events_of(r.text)
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                             "response.incomplete")
    (turn,) = session.trace.turns
    assert turn.protocol == "responses" and turn.status == "ok" and check_turn_faithful(turn) is None
    # the body as received, less the fields the proxy ignores (client_metadata, prompt_cache_key, ...)
    assert turn.raw_request == {k: v for k, v in recorded["body"].items() if k not in IGNORED_FIELDS}
    assert set(recorded["body"]) - set(turn.raw_request) and turn.raw_response == events[-1]["response"]
    assert turn.request["messages"][0]["role"] in ("system", "developer") and turn.request["stream"] is False
    assert turn.reply is not None and turn.reply.content == "".join(
        e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert turn.request_kind == ("compaction" if "compaction" in capture.stem else "turn")
    assert turn.headers["originator"] == "codex_exec"
    prompt = chat.tokenizer.decode(turn.prompt_ids)
    if recorded["body"]["tools"]:  # the compaction call sends none
        assert turn.notes == ["dropped hosted tool tools[8] (type 'web_search'): the engine cannot run it"]
        assert "close_agent" in prompt  # function tools of the multi_agent_v1 namespace are flattened
    else:
        assert turn.notes == [] and "CONTEXT CHECKPOINT COMPACTION" in prompt
    assert "<tool_response>\nChunk ID:" in prompt and '"name": "exec_command"' in prompt  # call and output
    assert events[-1]["response"]["usage"]["input_tokens"] == len(turn.prompt_ids)


def test_input_items_convert_to_chat_messages():
    body = {"model": "m", "instructions": "sys", "max_output_tokens": 7, "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "pwd", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "/w"}]},
    ]}
    chat = to_chat_body(body).chat_body
    assert chat["max_tokens"] == 7 and chat["stream"] is False
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "pwd", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "/w"},
    ]
    assert len(normalize_messages(chat["messages"])) == 6


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
])
def test_unsupported_input_is_rejected_naming_the_field(body, param):
    with pytest.raises(RequestError) as info:
        to_chat_body(body)
    assert info.value.param == param and info.value.status_code == 400


async def test_bad_request_is_400_and_recorded(tokenizer):
    http, store = in_process(FakeEngine(), ChatLayer(tokenizer))
    session = store.open("bad")
    r = await http.post("/v1/responses", json={"input": "x", "background": True},
                        headers={"authorization": f"Bearer {session.key}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    (turn,) = session.trace.turns
    assert (turn.protocol, turn.status) == ("responses", "error") and "background" in turn.error


async def test_engine_failure_is_response_failed_in_stream_and_503_unary(tokenizer):
    http, store = in_process(broken_engine(), ChatLayer(tokenizer))
    session = store.open("broken")
    auth = {"authorization": f"Bearer {session.key}"}
    r = await http.post("/v1/responses", json={"input": "x", "stream": True}, headers=auth)
    events = events_of(r.text)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert "engine stopped" in events[-1]["response"]["error"]["message"]
    r = await http.post("/v1/responses", json={"input": "x"}, headers=auth)
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
    assert [(t.protocol, t.status) for t in session.trace.turns] == [("responses", "error")] * 2

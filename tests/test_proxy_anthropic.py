"""`POST /v1/messages` on the real proxy: the official `anthropic` SDK (unary and stream, with
tools; `x-api-key` and bearer auth) on the tiny model over a real socket, stream == unary at
temperature 0, block conversion, 400s in Anthropic's error form, engine failures as `error`
events, and `count_tokens`."""

from __future__ import annotations

import json

import anthropic
import pytest
from fakes import FakeEngine, broken_engine, in_process

from harnessrl.chat.layer import ChatLayer, normalize_messages
from harnessrl.errors import RequestError
from harnessrl.proxy.anthropic import to_chat_body
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.types import check_turn_faithful

TOOL = {"name": "get_weather", "description": "Weather of a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]



async def test_sdk_unary_and_stream_agree_on_tiny_model(engine, chat):
    config = ProxyConfig(port=0, sampling=SamplingConfig(temperature=0.0, max_tokens=64))
    async with ProxyServer(engine, chat, config) as proxy:
        session_id, key = proxy.open_session("msg")
        root = proxy.base_url.removesuffix("/v1")
        by_key = anthropic.AsyncAnthropic(base_url=root, api_key=key, max_retries=0)  # x-api-key
        by_token = anthropic.AsyncAnthropic(base_url=root, auth_token=key, max_retries=0)  # Authorization: Bearer
        kwargs = {"model": "tiny", "max_tokens": 10, "system": "Be brief.", "tools": [TOOL], "messages": MESSAGES}
        unary = await by_key.messages.create(**kwargs)
        async with by_token.messages.stream(**kwargs) as stream:
            final = await stream.get_final_message()
        trace = proxy.close_session(session_id)
        with pytest.raises(anthropic.AuthenticationError):
            await by_key.messages.create(**kwargs)
    # random weights never stop on their own: cut at the request's max_tokens
    assert unary.stop_reason == final.stop_reason == "max_tokens"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in unary.content]
    assert unary.content[0].type == "text" and len(unary.content[0].text) > 0
    assert final.usage.output_tokens == unary.usage.output_tokens == 10
    a, b = trace.turns
    assert a.protocol == b.protocol == "messages" and a.status == b.status == "ok"
    assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
    assert final.usage.input_tokens == unary.usage.input_tokens == len(a.prompt_ids)
    assert check_turn_faithful(a) is None and check_turn_faithful(b) is None
    assert a.sampling.max_tokens == 10 and a.raw_request["system"] == "Be brief."
    assert b.raw_response["id"] == final.id and b.raw_response["content"][0]["text"] == unary.content[0].text
    # the neutral record: the chat layer's messages and the parsed reply
    assert a.request["messages"][0] == {"role": "system", "content": "Be brief."} and a.request["max_tokens"] == 10
    assert a.reply.content == unary.content[0].text and b.reply.content == final.content[0].text
    assert trace.rejected_calls == 1


@pytest.mark.parametrize("text", ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                  '\n</tool_call>', "Sunny and warm."])
async def test_sdk_stream_helper_reassembles_tool_use(tokenizer, text):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = FakeEngine(completion_ids=[*tokenizer.encode(text, add_special_tokens=False), im_end])
    async with ProxyServer(engine, ChatLayer(tokenizer, eos_token_ids=[im_end]), ProxyConfig(port=0)) as proxy:
        session_id, key = proxy.open_session("sdk")
        client = anthropic.AsyncAnthropic(base_url=proxy.base_url.removesuffix("/v1"), api_key=key, max_retries=0)
        kwargs = {"model": "m", "max_tokens": 100, "tools": [TOOL], "messages": MESSAGES}
        unary = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            final = await stream.get_final_message()
        trace = proxy.close_session(session_id)
    strip = lambda blocks: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]  # noqa: E731
    assert strip(final.content) == strip(unary.content)
    if "tool_call" in text:
        assert unary.stop_reason == final.stop_reason == "tool_use"
        assert [b.type for b in unary.content] == ["text", "tool_use"]
        assert unary.content[0].text == "Let me check."
        assert (unary.content[1].name, unary.content[1].input) == ("get_weather", {"city": "Paris"})
    else:
        assert unary.stop_reason == "end_turn" and unary.content[0].text == "Sunny and warm."
    assert trace.turns[0].completion_ids == list(engine.completion_ids)


def test_blocks_convert_to_chat_messages():
    body = {"model": "m", "max_tokens": 5, "stop_sequences": ["END"],
            "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
            "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "looking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "text", "text": "and now?"}]},
            ]}
    converted = to_chat_body(body)
    chat = converted.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "looking", "reasoning_content": "hmm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": "and now?"},
    ]
    assert (chat["max_tokens"], chat["stop"], chat["tool_choice"]) == (5, ["END"], "auto")
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                               "parameters": TOOL["input_schema"]}}]
    assert converted.notes == ("dropped server tool tools[1] (type 'web_search_20250305'): the engine cannot run it",)
    assert len(normalize_messages(chat["messages"])) == 5


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MESSAGES, "mcp_servers": []}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": MESSAGES, "tools": [TOOL], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
])
def test_unsupported_input_is_rejected_naming_the_field(body, param):
    with pytest.raises(RequestError) as info:
        to_chat_body(body)
    assert info.value.param == param


async def test_errors_use_anthropic_form_and_are_recorded(tokenizer):
    http, store = in_process(broken_engine(), ChatLayer(tokenizer))
    session = store.open("err")
    auth = {"x-api-key": session.key}
    r = await http.post("/v1/messages", json={"max_tokens": 4, "messages": MESSAGES, "mcp_servers": []}, headers=auth)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "unsupported field 'mcp_servers'"}}
    r = await http.post("/v1/messages", json={"max_tokens": 4, "messages": MESSAGES}, headers=auth)
    assert r.status_code == 503 and r.json()["error"]["type"] == "api_error"
    r = await http.post("/v1/messages", json={"max_tokens": 4, "messages": MESSAGES, "stream": True}, headers=auth)
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    assert [f.splitlines()[0] for f in frames] == ["event: message_start", "event: error"]
    error = json.loads(frames[-1].splitlines()[1][6:])
    assert error["error"]["type"] == "api_error" and "engine stopped" in error["error"]["message"]
    assert [(t.protocol, t.status) for t in session.trace.turns] == [("messages", "error")] * 3


async def test_count_tokens_matches_the_recorded_prompt(engine, chat):
    http, store = in_process(engine, chat, sampling=SamplingConfig(max_tokens=2))
    session = store.open("count")
    auth = {"x-api-key": session.key}
    body = {"model": "m", "max_tokens": 2, "system": "sys", "tools": [TOOL], "messages": MESSAGES}
    counted = await http.post("/v1/messages/count_tokens", json=body, headers=auth)
    r = await http.post("/v1/messages", json=body, headers=auth)
    assert r.status_code == 200
    assert counted.json() == {"input_tokens": len(session.trace.turns[0].prompt_ids)}
    assert r.json()["usage"]["input_tokens"] == counted.json()["input_tokens"]


async def test_a_stop_sequence_is_reported_unary_and_streamed(tokenizer):
    """The text is cut where the stop sequence begins, and the reply says which one ended it."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = [*tokenizer.encode("The answer is 4.\nObservation: nothing more", add_special_tokens=False), im_end]
    engine = FakeEngine(completion_ids=sampled)
    async with ProxyServer(engine, ChatLayer(tokenizer, eos_token_ids=[im_end]), ProxyConfig(port=0)) as proxy:
        session_id, key = proxy.open_session("stop")
        client = anthropic.AsyncAnthropic(base_url=proxy.base_url.removesuffix("/v1"), api_key=key, max_retries=0)
        kwargs = {"model": "m", "max_tokens": 100, "messages": MESSAGES, "stop_sequences": ["never", "Obs"]}
        unary = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            final = await stream.get_final_message()
        plain = await client.messages.create(**(kwargs | {"stop_sequences": ["absent"]}))
        trace = proxy.close_session(session_id)
    for reply in (unary, final):
        assert reply.content[0].text == "The answer is 4.\n"
        assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "Obs")
    assert (plain.stop_reason, plain.stop_sequence) == ("end_turn", None)
    assert trace.turns[0].raw_response["stop_sequence"] == "Obs"
    assert trace.turns[0].completion_ids == sampled  # the ids keep every sampled token

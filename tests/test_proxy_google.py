"""Google's `generateContent` / `streamGenerateContent` on the real proxy through the official
`google-genai` SDK (key in `x-goog-api-key`): token-faithful turns, tool calls both ways, the
neutral record equal to the chat-completions one, errors in Google's form, the call budget."""

from __future__ import annotations

import json

import httpx

import pytest
from fakes import FakeEngine, in_process

from harnessrl.chat.layer import ChatLayer
from harnessrl.errors import RequestError
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.google import to_chat_body
from harnessrl.proxy.server import ProxyServer
from harnessrl.types import check_turn_faithful

genai = pytest.importorskip("google.genai")
from google.genai import types  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="get_weather", description="Weather of a city.",
    parameters=types.Schema(type="OBJECT", properties={"city": types.Schema(type="STRING")}, required=["city"]))])


def _client(proxy: ProxyServer, key: str) -> genai.Client:
    root = proxy.base_url.removesuffix("/v1")
    return genai.Client(api_key=key, http_options=types.HttpOptions(base_url=root, retry_options=None))


@pytest.mark.parametrize("text", [CALL, "Sunny and warm."])
async def test_sdk_unary_and_stream_are_token_faithful(tokenizer, text: str) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = FakeEngine(completion_ids=[*tokenizer.encode(text, add_special_tokens=False), im_end])
    async with ProxyServer(engine, ChatLayer(tokenizer, eos_token_ids=[im_end]), ProxyConfig(port=0)) as proxy:
        session_id, key = proxy.open_session("google")
        client = _client(proxy, key)
        config = types.GenerateContentConfig(system_instruction="Be brief.", tools=[WEATHER], max_output_tokens=100,
                                             automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
        unary = await client.aio.models.generate_content(model="gemini-x", contents="Weather in Paris?", config=config)
        chunks = [c async for c in await client.aio.models.generate_content_stream(
            model="gemini-x", contents="Weather in Paris?", config=config)]
        trace = proxy.close_session(session_id)
    parts = unary.candidates[0].content.parts
    if text == CALL:
        assert [p.function_call.name for p in parts if p.function_call] == ["get_weather"]
        assert unary.function_calls[0].args == {"city": "Paris"}
    else:
        assert unary.text == "Sunny and warm." and not unary.function_calls
    assert unary.candidates[0].finish_reason == types.FinishReason.STOP
    streamed = [p for c in chunks for p in c.candidates[0].content.parts]
    def shape(p):  # noqa: ANN001, ANN202 - call ids are per turn
        d = p.model_dump(exclude_none=True)
        d.get("function_call", {}).pop("id", None)
        return d

    assert [shape(p) for p in streamed] == [shape(p) for p in parts]
    a, b = trace.turns
    assert a.protocol == b.protocol == "google" and a.status == b.status == "ok"
    assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
    assert check_turn_faithful(a) is None and check_turn_faithful(b) is None
    assert unary.usage_metadata.prompt_token_count == len(a.prompt_ids)
    assert unary.usage_metadata.candidates_token_count == len(a.completion_ids)
    assert a.request["messages"][0] == {"role": "system", "content": "Be brief."}
    assert a.request["tools"][0]["function"]["parameters"]["properties"]["city"]["type"] == "string"
    assert a.headers.get("x-goog-api-client") is not None or a.raw_request is not None
    assert a.raw_request["contents"][0]["parts"][0]["text"] == "Weather in Paris?"


async def test_function_response_round_trip_matches_chat_completions(tokenizer) -> None:
    chat = ChatLayer(tokenizer)
    google_body = {"systemInstruction": {"parts": [{"text": "sys"}]},
                   "contents": [{"role": "user", "parts": [{"text": "Weather?"}]},
                                {"role": "model", "parts": [{"functionCall": {"name": "get_weather",
                                                                              "args": {"city": "Paris"}}}]},
                                {"role": "user", "parts": [{"functionResponse": {"name": "get_weather",
                                                                                 "response": {"t": 21}}}]}],
                   "tools": [{"functionDeclarations": [{"name": "get_weather", "parameters": {
                       "type": "OBJECT", "properties": {"city": {"type": "STRING"}}}}]}],
                   "generationConfig": {"maxOutputTokens": 4}}
    converted = to_chat_body(google_body, "m").chat_body
    messages = converted["messages"]
    assert messages[2]["tool_calls"][0]["id"] == messages[3]["tool_call_id"] == "call_1_0"
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1_0", "content": '{"t": 21}'}
    http, store = in_process(FakeEngine(), chat)
    s1, s2 = store.open("g"), store.open("c")
    r1 = await http.post("/v1beta/models/m:generateContent", json=google_body, headers={"x-goog-api-key": s1.key})
    assert r1.status_code == 200, r1.text
    chat_body = {k: v for k, v in converted.items() if k != "stream"}
    r2 = await http.post("/v1/chat/completions", json=chat_body, headers={"authorization": f"Bearer {s2.key}"})
    assert r2.status_code == 200
    assert s1.trace.turns[0].prompt_ids == s2.trace.turns[0].prompt_ids
    assert s1.trace.turns[0].request["messages"] == s2.trace.turns[0].request["messages"]
    # the key as a query parameter and the keyed path work too; the SSE form without the SDK
    r3 = await http.post(f"/r/{s1.key}/v1beta/models/m:streamGenerateContent?alt=sse", json=google_body)
    events = [json.loads(line[6:]) for line in r3.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["candidates"][0]["finishReason"] in ("STOP", "MAX_TOKENS")
    r4 = await http.post(f"/v1beta/models/m:streamGenerateContent?key={s1.key}", json=google_body)
    assert isinstance(r4.json(), list) and r4.json()[0]["responseId"]


async def test_errors_use_google_form_are_recorded_and_budget_stops(tokenizer) -> None:
    http, store = in_process(FakeEngine(), ChatLayer(tokenizer), max_model_calls=2)  # a rejected call counts
    session = store.open("err")
    auth = {"x-goog-api-key": session.key}
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    r = await http.post("/v1beta/models/m:generateContent", json={**body, "cachedContent": "x"}, headers=auth)
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "message": "unsupported field 'cachedContent'", "status": "INVALID_ARGUMENT"}}
    r = await http.post("/v1beta/models/m:countTokens", json=body, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    assert (await http.post("/v1beta/models/m:generateContent", json=body, headers=auth)).status_code == 200
    r = await http.post("/v1beta/models/m:generateContent", json=body, headers=auth)  # past max_model_calls
    assert r.status_code == 200
    out = r.json()["candidates"][0]
    assert out["finishReason"] == "STOP" and out["content"]["parts"] == [{"text": ""}]
    assert [(t.protocol, t.status) for t in session.trace.turns] == [("google", "error"), ("google", "ok"),
                                                                      ("google", "error")]
    r = await http.post("/v1beta/models/m:generateContent", json=body, headers={"x-goog-api-key": "nope"})
    assert r.status_code == 401


@pytest.mark.parametrize(("body", "param"), [
    ({"contents": []}, "contents"),
    ({"contents": [{"role": "tool", "parts": []}]}, "contents[0].role"),
    ({"contents": [{"parts": [{"inlineData": {"data": "x"}}]}]}, "contents[0].parts[0]"),
    ({"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
      "tools": [{"functionDeclarations": [{"name": "f"}]}]}, "toolConfig.functionCallingConfig.mode"),
    ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}},
     "generationConfig.candidateCount"),
])
def test_unsupported_input_is_rejected_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        to_chat_body(body)
    assert info.value.param == param


def _snake(obj: object) -> object:
    """`obj` with every key of parts, calls, answers, declarations and generationConfig in snake_case."""
    import re

    if isinstance(obj, list):
        return [_snake(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    return {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower(): (v if k in ("parameters", "response", "args") else _snake(v))
            for k, v in obj.items()}


async def test_snake_case_part_fields_are_read_like_camel_case(tokenizer) -> None:
    camel = {"contents": [{"role": "user", "parts": [{"text": "Weather?"}]},
                          {"role": "model", "parts": [{"functionCall": {"name": "get_weather", "id": "c7",
                                                                        "args": {"city": "Paris"}},
                                                       "thoughtSignature": "c2ln"}]},
                          {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "id": "c7",
                                                                           "response": {"t": 21}}}]}],
             "tools": [{"functionDeclarations": [{"name": "get_weather", "parametersJsonSchema": {
                 "type": "object", "properties": {"city": {"type": "string"}}}}]}],
             "generationConfig": {"maxOutputTokens": 4, "stopSequences": ["END"]}}
    snake = _snake(camel)
    assert "function_call" in snake["contents"][1]["parts"][0] and "thought_signature" in snake["contents"][1]["parts"][0]
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0)) as proxy:
        root = proxy.base_url.removesuffix("/v1")
        (id1, k1), (id2, k2) = proxy.open_session("camel"), proxy.open_session("snake")
        async with httpx.AsyncClient(base_url=root) as http:
            r1 = await http.post("/v1beta/models/m:generateContent", json=camel, headers={"x-goog-api-key": k1})
            r2 = await http.post("/v1beta/models/m:generateContent", json=snake, headers={"x-goog-api-key": k2})
            image = {"contents": [{"parts": [{"inline_data": {"mime_type": "image/png", "data": "eA=="}}]}]}
            r3 = await http.post("/v1beta/models/m:generateContent", json=image, headers={"x-goog-api-key": k2})
            twice = {"contents": [{"parts": [{"text": "a"}]}],
                     "generationConfig": {"maxOutputTokens": 4, "max_output_tokens": 5}}
            r4 = await http.post("/v1beta/models/m:generateContent", json=twice, headers={"x-goog-api-key": k2})
        a, b = proxy.close_session(id1).turns[0], proxy.close_session(id2).turns
    assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
    assert a.request == b[0].request and a.prompt_ids == b[0].prompt_ids and a.notes == b[0].notes
    assert a.request["stop"] == ["END"] and a.request["max_tokens"] == 4
    assert any("thoughtSignature" in n for n in a.notes)
    # an unsupported part is refused by the same rule whichever spelling names it
    assert r3.status_code == 400 and "inlineData" in r3.json()["error"]["message"]
    assert r4.status_code == 400 and "generationConfig.maxOutputTokens" in r4.json()["error"]["message"]

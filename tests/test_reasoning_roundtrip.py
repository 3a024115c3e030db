"""Reasoning that agents replay comes back into the prompt, never silently dropped: Responses
`encrypted_content` (written by this proxy when `include` asks for it, read back; another
server's blob is a 400 naming it) and Anthropic thinking blocks with signatures."""

from __future__ import annotations

import pytest
from fakes import FakeEngine, in_process

from harnessrl.chat.layer import ChatLayer
from harnessrl.errors import RequestError
from harnessrl.proxy.anthropic import to_chat_body as messages_to_chat
from harnessrl.proxy.responses import decode_reasoning, encode_reasoning
from harnessrl.proxy.responses import to_chat_body as responses_to_chat

THOUGHT = "The user wants 42; ünïcode too."


def test_encrypted_content_round_trips_and_foreign_blobs_are_named() -> None:
    blob = encode_reasoning(THOUGHT)
    assert blob.startswith("hrl1.") and decode_reasoning(blob, "input[1]") == THOUGHT
    body = {"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "encrypted_content": blob},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "again"}]}
    messages = responses_to_chat(body).chat_body["messages"]
    assert messages[1] == {"role": "assistant", "content": "42", "reasoning_content": THOUGHT}
    foreign = {**body, "input": [body["input"][0], {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"},
                                 *body["input"][2:]]}
    with pytest.raises(RequestError, match="not produced by this server") as info:
        responses_to_chat(foreign)
    assert info.value.param == "input[1].encrypted_content"


async def test_codex_style_replay_of_our_reasoning_item(tokenizer) -> None:
    chat = ChatLayer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = tokenizer.encode(f"<think>{THOUGHT}</think>The answer is 42.", add_special_tokens=False)
    http, store = in_process(FakeEngine(completion_ids=[*reply, im_end]), ChatLayer(tokenizer, eos_token_ids=[im_end]))
    session = store.open("codex")
    auth = {"authorization": f"Bearer {session.key}"}
    first = {"model": "m", "input": [{"role": "user", "content": "hi"}], "store": False,
             "include": ["reasoning.encrypted_content"], "max_output_tokens": 64}
    r = await http.post("/v1/responses", json=first, headers=auth)
    assert r.status_code == 200, r.text
    items = r.json()["output"]
    reasoning = next(i for i in items if i["type"] == "reasoning")
    assert decode_reasoning(reasoning["encrypted_content"], "x") == THOUGHT
    # the agent replays the items with the reasoning text only in encrypted_content (store=false)
    replay = [{"type": "reasoning", "id": reasoning["id"], "summary": [], "encrypted_content": reasoning["encrypted_content"]},
              *[i for i in items if i["type"] != "reasoning"]]
    second = {**first, "input": [*first["input"], *replay, {"role": "user", "content": "again"}]}
    assert (await http.post("/v1/responses", json=second, headers=auth)).status_code == 200
    neutral = session.trace.turns[1].request["messages"]
    assert neutral[1]["role"] == "assistant" and neutral[1]["reasoning_content"] == THOUGHT
    # the replayed reasoning is in the prompt: the turn bridges on the first one, whose exact
    # prompt + completion ids (the <think> block included) start the second prompt
    t0, t1 = session.trace.turns
    assert "bridged_from=0" in t1.notes
    assert t1.prompt_ids[: len(t0.prompt_ids) + len(t0.completion_ids) - 1] == (t0.prompt_ids + t0.completion_ids)[:-1]
    del chat


def test_anthropic_thinking_with_signature_is_kept() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": "EqQBCkgIARAB..."},
                                          {"type": "text", "text": "42"}]},
        {"role": "user", "content": "again"}]}
    converted = messages_to_chat(body)
    assert converted.chat_body["messages"][1] == {"role": "assistant", "content": "42", "reasoning_content": THOUGHT}
    assert converted.notes == ()  # nothing dropped

"""One protocol-neutral record per turn: the same conversation spoken in chat completions, the
Responses API and Anthropic Messages, through the real proxy app over HTTP (in-process ASGI, a
fake engine answering the same ids), gives the same neutral turns, and every hook, shaping
function and the console's conversation print gives the same answer on them. The protocols'
own bodies stay beside it (`raw_request`, `raw_response`); old records still load."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from rich.console import Console

from fakes import FakeEngine, in_process
from harnessrl.proxy.config import SamplingConfig
from harnessrl.chat.layer import ChatLayer
from harnessrl.recipes import shaping
from harnessrl.train.console import print_conversation
from harnessrl.hooks import has_tool_call, outcome_of, tool_call_names
from harnessrl.types import Reply, ReplyToolCall, Rollout, Trace, Turn, check_turn_faithful

SYSTEM, TASK, TOOL_OUTPUT = "Be brief.", "List the files.", "a.py\nb.py"
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
ARGS = {"command": "ls"}
FIRST = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
SECOND = "There are two files:\n```bash\necho a.py b.py\n```"
PROTOCOLS = ("chat.completions", "responses", "messages")


def _first_body(protocol: str, stream: bool) -> dict:
    match protocol:
        case "chat.completions":
            return {"model": "m", "max_tokens": 64, "stream": stream,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}],
                    "tools": [{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                                                "parameters": SCHEMA}}]}
        case "responses":
            return {"model": "m", "max_output_tokens": 64, "stream": stream, "instructions": SYSTEM,
                    "input": [{"role": "user", "content": [{"type": "input_text", "text": TASK}]}],
                    "tools": [{"type": "function", "name": "bash", "description": "Run a command.",
                               "parameters": SCHEMA}, {"type": "web_search"}]}
        case _:
            return {"model": "m", "max_tokens": 64, "stream": stream, "system": SYSTEM,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": TASK}]}],
                    "tools": [{"name": "bash", "description": "Run a command.", "input_schema": SCHEMA}]}


def _second_body(protocol: str, first: dict, content: str, call_id: str, stream: bool) -> dict:
    """The first request extended with the reply the agent got and the tool's output, in the
    protocol's own words."""
    args = json.dumps(ARGS)
    body = dict(first)
    match protocol:
        case "chat.completions":
            body["messages"] = [*first["messages"], {"role": "assistant", "content": content, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": args}}]},
                {"role": "tool", "tool_call_id": call_id, "content": TOOL_OUTPUT}]
        case "responses":
            body["input"] = [*first["input"],
                             {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                   "text": content}]},
                             {"type": "function_call", "call_id": call_id, "name": "bash", "arguments": args},
                             {"type": "function_call_output", "call_id": call_id, "output": TOOL_OUTPUT}]
        case _:
            body["messages"] = [*first["messages"],
                                {"role": "assistant", "content": [{"type": "text", "text": content},
                                                                  {"type": "tool_use", "id": call_id, "name": "bash",
                                                                   "input": ARGS}]},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                              "content": TOOL_OUTPUT}]}]
    return body | {"stream": stream}


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for frame in text.split("\n\n") for line in frame.splitlines()
            if line.startswith("data: ") and line[6:] != "[DONE]"]


def _reply_of(protocol: str, r_json: dict | None, events: list[dict]) -> tuple[str, str]:
    """(text, call id) of the first reply as the agent read it."""
    if protocol == "chat.completions":
        if r_json is None:  # SSE: the text deltas and the call id of the tool-call chunk
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
            call = next(c for e in events if e.get("choices") for c in e["choices"][0]["delta"].get("tool_calls") or [])
            return text, call["id"]
        message = r_json["choices"][0]["message"]
        return message["content"], message["tool_calls"][0]["id"]
    if protocol == "responses":
        body = r_json if r_json is not None else events[-1]["response"]
        text = next(i["content"][0]["text"] for i in body["output"] if i["type"] == "message")
        return text, next(i["call_id"] for i in body["output"] if i["type"] == "function_call")
    if r_json is None:
        starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "text_delta")
        return text, next(b["id"] for b in starts if b["type"] == "tool_use")
    return (next(b["text"] for b in r_json["content"] if b["type"] == "text"),
            next(b["id"] for b in r_json["content"] if b["type"] == "tool_use"))


async def _conversation(tokenizer, protocol: str, stream: bool) -> Trace:
    """Two calls of one session in `protocol`: a tool call, then (with its output) a text reply."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = [tokenizer.encode(t, add_special_tokens=False) + [im_end] for t in (FIRST, SECOND)]
    http, store = in_process(FakeEngine(completion_ids=lambda i: replies[i], eos_token_ids=(im_end,)),
                             ChatLayer(tokenizer, eos_token_ids=(im_end,)), sampling=SamplingConfig(max_tokens=64))
    session = store.open(f"{protocol}-{stream}")
    path = {"chat.completions": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
    headers = {"authorization": f"Bearer {session.key}"}
    first = _first_body(protocol, stream)
    r = await http.post(path[protocol], json=first, headers=headers)
    assert r.status_code == 200, r.text
    content, call_id = _reply_of(protocol, None if stream else r.json(), _events(r.text) if stream else [])
    assert content == "Let me look."
    r = await http.post(path[protocol], json=_second_body(protocol, first, content, call_id, stream), headers=headers)
    assert r.status_code == 200, r.text
    return store.close(session.session_id)


@pytest.fixture(scope="module")
def traces(tokenizer) -> dict[tuple[str, bool], Trace]:
    async def run_all() -> dict[tuple[str, bool], Trace]:
        return {(p, s): await _conversation(tokenizer, p, s) for p in PROTOCOLS for s in (False, True)}
    return asyncio.run(run_all())


def _rollout(trace: Trace, reward: float | None = 0.5, status: str = "ok") -> Rollout:
    return Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status=status, reward=reward,
                   trace=trace)  # type: ignore[arg-type]


def _normalised(turn: Turn) -> dict:
    """The neutral fields, with what legitimately differs per session and protocol (call ids,
    `stream`, model, timings, protocol headers) left out."""
    messages = turn.request["messages"]
    if len(messages) > 2:  # the call id the agent echoed (per session; Messages shows it as toolu_...)
        messages = json.loads(json.dumps(messages).replace(messages[2]["tool_calls"][0]["id"], "ID"))
    return {"messages": messages, "tools": turn.request.get("tools"), "max_tokens": turn.request.get("max_tokens"),
            "reply": turn.reply.model_dump(exclude={"tool_calls": {"__all__": {"id"}}}),
            "prompt_ids": turn.prompt_ids, "completion_ids": turn.completion_ids, "finish": turn.finish_reason,
            "sampling": turn.sampling, "usage": turn.usage}


def test_the_neutral_turns_are_the_same_in_every_protocol(traces) -> None:
    reference = [_normalised(t) for t in traces[("chat.completions", False)].turns]
    assert reference[0]["reply"] == {"content": "Let me look.", "reasoning": None,
                                     "tool_calls": [{"name": "bash", "arguments": '{"command": "ls"}'}]}
    assert reference[1]["reply"] == {"content": SECOND, "reasoning": None, "tool_calls": []}
    assert reference[1]["messages"][-1] == {"role": "tool", "tool_call_id": "ID", "content": TOOL_OUTPUT}
    for (protocol, stream), trace in traces.items():
        assert [t.status for t in trace.turns] == ["ok", "ok"], (protocol, stream)
        assert all(check_turn_faithful(t) is None for t in trace.turns)
        assert [_normalised(t) for t in trace.turns] == reference, (protocol, stream)
        for turn in trace.turns:
            assert turn.protocol == protocol
            if turn.turn_index == 0:  # the chat layer's call id (Messages shows it as toolu_<same hex>)
                assert turn.reply.tool_calls[0].id.startswith("call_")
            if protocol == "chat.completions":
                assert turn.raw_request is None and turn.raw_response is None
            else:  # the protocol's own bodies beside the neutral record, as received and as sent
                assert turn.raw_request["stream"] is stream and turn.request["stream"] is False
                assert ("output" if protocol == "responses" else "content") in turn.raw_response
        if protocol == "responses":  # the dropped hosted tool is noted on the turn
            dropped = "dropped hosted tool tools[1] (type 'web_search'): the engine cannot run it"
            assert trace.turns[0].notes == [dropped]


def test_every_hook_gives_the_same_answer_in_every_protocol(traces) -> None:
    for (protocol, stream), trace in traces.items():
        where = (protocol, stream)
        assert [tool_call_names(t) for t in trace.turns] == [["bash"], []], where
        assert [has_tool_call(t) for t in trace.turns] == [True, False], where
        outcome = outcome_of(_rollout(trace))
        assert (outcome.tool_calls_by_name, outcome.num_turns, outcome.timed_out) == ({"bash": 1}, 2, False), where


def test_every_shaping_function_gives_the_same_answer_in_every_protocol(traces, monkeypatch) -> None:
    for (protocol, stream), trace in traces.items():
        where = (protocol, stream)
        # a bash call was made: the verifier's reward, no -0.1 penalty
        assert shaping.opencode_tool_use_reward(outcome_of(_rollout(trace))) == 0.5, where
        assert shaping.opencode_tool_use_reward(outcome_of(_rollout(trace, status="timeout"))) == 0.0, where
        assert shaping.opencode_tool_use_reward(outcome_of(_rollout(trace, reward=None))) is None, where
        # both replies are well-formed actions (a tool call; one fenced bash block): full bonus
        credit = shaping.action_format_credit(outcome_of(_rollout(trace, reward=0.0)))
        assert credit == pytest.approx(shaping.FORMAT_BONUS), where
        monkeypatch.setattr(shaping, "_SMOKE_COUNTER", itertools.count())
        assert [shaping.alternating_smoke_reward(outcome_of(_rollout(trace))) for _ in range(3)] == [0.0, 1.0, 0.0]


def test_the_conversation_print_is_the_same_in_every_protocol(traces) -> None:
    printed = {}
    for key, trace in traces.items():
        console = Console(record=True, width=100, color_system=None)
        print_conversation(console, _rollout(trace))
        printed[key] = console.export_text()
    reference = printed[("chat.completions", False)]
    for line in (f"system: {SYSTEM}", f"user: {TASK}", "assistant: Let me look.", '[tool call] bash({"command":',
                 "tool: a.py", "assistant: There are two files:"):
        assert line in reference, reference
    assert all(text == reference for text in printed.values()), printed


def test_old_records_with_a_response_body_still_load() -> None:
    chat = {"turn_index": 0, "request": {"messages": [{"role": "user", "content": "hi"}]}, "prompt_ids": [1],
            "response": {"choices": [{"message": {"role": "assistant", "content": "ok", "reasoning_content": "r",
                                                  "tool_calls": [{"id": "c1", "type": "function",
                                                                  "function": {"name": "bash", "arguments": "{}"}}]}}]}}
    turn = Turn.model_validate_json(json.dumps(chat))
    assert turn.reply == Reply(content="ok", reasoning="r", tool_calls=[ReplyToolCall(id="c1", name="bash",
                                                                                      arguments="{}")])
    assert turn.request == chat["request"] and turn.raw_request is None and has_tool_call(turn)
    responses = {"turn_index": 1, "protocol": "responses", "request": {"input": "hi"}, "response": {"output": [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c2", "name": "bash", "arguments": "{}"}]}}
    turn = Turn.model_validate(responses)
    assert (turn.request, turn.raw_request, turn.raw_response) == ({}, {"input": "hi"}, responses["response"])
    assert turn.reply == Reply(content="ok", reasoning="think", tool_calls=[ReplyToolCall(id="c2", name="bash",
                                                                                          arguments="{}")])
    messages = {"turn_index": 2, "protocol": "messages", "request": {"messages": []}, "response": {"content": [
        {"type": "text", "text": "ok"}, {"type": "tool_use", "id": "t", "name": "bash", "input": {"a": 1}}]}}
    turn = Turn.model_validate(messages)
    assert turn.reply.tool_calls == [ReplyToolCall(id="t", name="bash", arguments='{"a": 1}')]
    error = {"turn_index": 3, "request": {}, "status": "error", "response": None}
    assert Turn.model_validate(error).reply is None
    # a new record round-trips and writes no raw fields for chat completions
    dumped = json.loads(turn.model_copy(update={"raw_request": None, "raw_response": None}).model_dump_json())
    assert "response" not in dumped and "raw_request" not in dumped and dumped["reply"]["content"] == "ok"
    assert Turn.model_validate(dumped) == turn.model_copy(update={"raw_request": None, "raw_response": None})


def test_the_documented_train_turn_fn_trains_the_same_tokens_in_every_protocol(traces) -> None:
    """`train_turn_fn = has_tool_call` (the example of docs/configuration.md) trains the tool-call turn of a
    Codex- or Claude-Code-style rollout as it does a chat one, not nothing."""
    from harnessrl.train.samples import build_rows

    built = {}
    for key, trace in traces.items():
        rows, _ = build_rows(_rollout(trace), train_turn_fn=has_tool_call, main_prefix_tokens=1)
        built[key] = [(r.input_ids, r.completion_mask, r.sampler_logprobs) for r in rows]
    reference = built[("chat.completions", False)]
    first = traces[("chat.completions", False)].turns[0]
    # the tool-call turn's completion trains; the last (text) reply is context only
    assert sum(sum(mask) for _, mask, _ in reference) == len(first.completion_ids) > 0
    assert all(rows == reference for rows in built.values()), {k: len(v) for k, v in built.items()}

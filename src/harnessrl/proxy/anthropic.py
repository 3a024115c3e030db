"""Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
shared capture path.

Responsibility: convert a Messages request into one chat-completions body for the chat layer
(`to_chat_body`), and the chat result back into a Messages body (`message_body`) or event
stream. Recording, sampling enforcement, limits and faithfulness are those of chat
completions (`native.py` -> `capture.py`); turns are recorded with `protocol="messages"`.
Keys: Claude Code sends `x-api-key` (ANTHROPIC_API_KEY) or `Authorization: Bearer`
(ANTHROPIC_AUTH_TOKEN); `app.session_key` accepts both.

Request conversion (each unsupported field or block type -> 400 naming it, in Anthropic's
error form `{"type": "error", "error": {"type", "message"}}`):
* `system` (string or text blocks) -> a leading system message.
* `messages[i]` with role user/assistant/system (Claude Code sends system messages between
  turns; they become system messages in place); content a string or blocks:
  - user `text` blocks -> a user message (consecutive text blocks joined with "\\n");
    `tool_result` (content a string or text blocks; `is_error` adds nothing the model sees,
    as in the API's own rendering of tool results) -> a `tool` message, in block order;
  - assistant `text` -> content, `tool_use` -> a tool call (input re-serialised as JSON),
    `thinking` -> `reasoning_content`; `redacted_thinking` is dropped (it is opaque, and this
    proxy never produces it), and named in `Turn.notes`.
* `tools`: custom tools `{name, description, input_schema}` -> chat function tools
  (`parameters` = `input_schema`); server tools with a versioned `type` (`web_search_...`,
  `bash_...`, ...) are dropped and named in `Turn.notes`, as for the Responses API.
* `tool_choice` `auto` / `none` (`any` and `tool` -> 400: the engine cannot force a call);
  `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences` -> chat fields.
* Ignored: `metadata`, `cache_control` (anywhere), `service_tier`, `thinking` (the chat
  template decides whether the model thinks), `context_management` (Claude Code asks to
  clear old thinking; nothing is stored here), `output_config` with only `effort`.

Result: content blocks `thinking` (when the completion had a `<think>` block; empty
`signature`), `text` (when there is text, or nothing else), `tool_use` (input = the parsed
arguments; a call whose arguments are not a JSON object stays in the text). `stop_reason`:
`max_tokens` when truncated, `tool_use` when calls were parsed, `stop_sequence` when a
requested stop sequence ended the text (the chat layer's parse names the one it cut at, the
chat body's `stop_reason`; `stop_sequence` is that string), else `end_turn`. Usage: `input_tokens` = prompt ids
consumed, `output_tokens` = ids sampled, cache counts 0.

Stream: `message_start` (with the prompt's `input_tokens`, sent before generation; `ping`
events keep the connection alive meanwhile), per block `content_block_start`, one delta
(`text_delta`, `input_json_delta`, `thinking_delta` + `signature_delta`) and
`content_block_stop`, then `message_delta` (`stop_reason`, usage) and `message_stop`. An
engine failure after the stream started is an `error` event, never a silent close.

What this module deliberately does not do: images, documents, citations, batches, or the
Anthropic beta features that need server state (containers, MCP servers, files).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from harnessrl.chat.layer import ToolCall, hermes_tool_call, normalize_messages, normalize_tools
from harnessrl.errors import RequestError
from harnessrl.proxy import native
from harnessrl.proxy.app import ProxyDeps, json_response, read_session_json
from harnessrl.proxy.capture import ChatOutcome, Origin
from harnessrl.proxy.wire import DEFAULT_LIMITS, RequestLimits, check_stop, dumps, limits_of, recorded_body

PROTOCOL = "messages"
EXTRA_HEADERS = ("anthropic-version", "anthropic-beta", "x-app", "x-claude-code-session-id")
USED_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature",
                         "top_p", "top_k", "stop_sequences", "stream"})
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "thinking", "context_management"})
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
PING = b"event: ping\ndata: {\"type\": \"ping\"}\n\n"


async def handle(request: Request, session: Any, deps: ProxyDeps) -> Response:
    """`POST /v1/messages`: unary JSON, or the Messages event stream."""
    headers = native.kept_headers(request.headers, EXTRA_HEADERS)
    try:
        body = await read_session_json(request, session, deps)
        converted = _convert_or_record(session, body, headers, limits_of(deps.capture.config))
    except RequestError as exc:
        return error_response(exc.status_code, exc.message)
    message_id = "msg_" + secrets.token_hex(12)

    def render(chat: dict[str, Any]) -> dict[str, Any]:
        return message_body(chat, message_id)

    origin = Origin(PROTOCOL, recorded_body(body, IGNORED_FIELDS), headers, converted.notes, render)
    call = native.Call(session, origin)
    prepared = await native.prepare(call, deps.capture, converted, request.headers)
    if isinstance(prepared, ChatOutcome):
        return error_response(prepared.status_code, _message_of(prepared.body))
    if body.get("stream") is not True:
        outcome = await native.generate(call, deps.capture, prepared)
        if outcome.status_code != 200:
            return error_response(outcome.status_code, _message_of(outcome.body))
        return json_response(200, outcome.protocol_body)
    return StreamingResponse(_stream(call, deps, prepared, message_id), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


async def count_tokens(request: Request, session: Any, deps: ProxyDeps) -> Response:
    """`POST /v1/messages/count_tokens`: `{"input_tokens": N}` as the chat layer would render
    the request (no generation, no turn recorded)."""
    try:
        body = await read_session_json(request, session, deps)
        body = {k: v for k, v in body.items() if k != "max_tokens"} | {"max_tokens": 1}
        chat = to_chat_body(body, limits_of(deps.capture.config)).chat_body
        ids = deps.capture.chat.render(normalize_messages(chat["messages"]), chat.get("tools"))
    except RequestError as exc:
        return error_response(exc.status_code, exc.message)
    return json_response(200, {"input_tokens": len(ids)})


def error_response(status_code: int, message: str) -> Response:
    """Anthropic's error form: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return json_response(status_code, {"type": "error", "error": {"type": kind, "message": message}})


def _convert_or_record(session: Any, body: dict[str, Any], headers: dict[str, str],
                       limits: RequestLimits) -> native.Converted:
    try:
        return to_chat_body(body, limits)
    except RequestError as exc:
        native.record_rejected(session, PROTOCOL, body, headers, exc)
        raise


def _message_of(error: dict[str, Any]) -> str:
    return str(error.get("error", {}).get("message", error))


# ---------------------------------------------------------------- request -> chat body


def to_chat_body(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> native.Converted:
    """Translate a Messages request body (see the module docstring); `stop_sequences` within
    `limits` (`wire.check_stop`).

    Raises:
        RequestError: unsupported field or block type, or a malformed one; `param` names it
            (`messages[2].content[0].type`, `tools[1].input_schema`, ...).
    """
    for key, value in body.items():
        if key == "output_config" and isinstance(value, dict) and set(value) <= {"effort"}:
            continue  # effort only steers Anthropic's own models; `format` would change the output
        if key not in USED_FIELDS and key not in IGNORED_FIELDS:
            raise RequestError(f"unsupported field '{key}'" if key != "output_config"
                               else f"output_config={value!r} is not supported (only 'effort')", param=key)
    notes: list[str] = []
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(raw):
        messages.extend(_message(m, f"messages[{i}]", notes))
    tools = _tools(body.get("tools"), notes)
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": messages, "stream": False}
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    optional = {"max_tokens": body.get("max_tokens"), "temperature": body.get("temperature"),
                "top_p": body.get("top_p"), "top_k": body.get("top_k"),
                "stop": list(check_stop(body.get("stop_sequences"), "stop_sequences", limits)) or None}
    chat.update({k: v for k, v in optional.items() if v is not None})
    return native.Converted(chat, tuple(notes))


def _system(system: object) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    return [{"role": "system", "content": _text_blocks(system, "system")}]


def _text_blocks(blocks: object, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RequestError(f"{where} must be a string or an array of text blocks", param=where)
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind != "text" or not isinstance(block.get("text"), str):
            raise RequestError(f"{where}[{j}].type={kind!r} is not supported here (text blocks only)",
                               param=f"{where}[{j}].type")
        texts.append(block["text"])
    return "\n".join(texts)


def _message(m: object, where: str, notes: list[str]) -> list[dict[str, Any]]:
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object", param=where)
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant", "system"):
        raise RequestError(f"{where}.role={role!r} is not one of assistant, system, user", param=f"{where}.role")
    if role == "system":  # Claude Code puts system reminders between turns
        return [{"role": "system", "content": _text_blocks(content, f"{where}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or an array of blocks", param=f"{where}.content")
    if role == "assistant":
        return [_assistant(content, where, notes)]
    return _user(content, where)


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and isinstance(block.get("text"), str):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + block["text"]
            else:
                out.append({"role": "user", "content": block["text"]})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestError(f"{at}.tool_use_id must be a string", param=f"{at}.tool_use_id")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _text_blocks(block.get("content") or "", f"{at}.content")})
        else:
            raise RequestError(f"{at}.type={kind!r} is not supported in a user message (text, tool_result)",
                               param=f"{at}.type")
    return out


def _assistant(blocks: list[Any], where: str, notes: list[str]) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            notes.append(f"dropped {at} (redacted_thinking is opaque)")
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise RequestError(f"{at} needs string 'id' and 'name'", param=at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        else:
            raise RequestError(f"{at}.type={kind!r} is not supported in an assistant message "
                               f"(text, thinking, tool_use)", param=f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _tools(raw: object, notes: list[str]) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("'tools' must be an array", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{i}].name must be a string", param=f"tools[{i}].name")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            notes.append(f"dropped server tool tools[{i}] (type {kind!r}): the engine cannot run it")
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise RequestError(f"tools[{i}].input_schema must be an object", param=f"tools[{i}].input_schema")
        fn: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        tools.append({"type": "function", "function": fn})
    return normalize_tools(tools)


def _tool_choice(choice: object) -> str:
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind in (None, "auto", "none"):
        return kind or "auto"
    raise RequestError(f"tool_choice.type={kind!r} is not supported (only 'auto' or 'none')", param="tool_choice")


# ---------------------------------------------------------------- chat result -> Messages


def message_body(chat: dict[str, Any], message_id: str) -> dict[str, Any]:
    """The Messages body for a unary chat.completion `chat` (see the module docstring)."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    text = message.get("content") or ""
    uses: list[dict[str, Any]] = []
    for c in message.get("tool_calls") or []:
        args = _object_or_none(c["function"]["arguments"])
        if args is None:  # not an object: keep the call as the text the model wrote
            call = ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            text = (text + "\n" if text else "") + hermes_tool_call(call)
        else:
            uses.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
                         "name": c["function"]["name"], "input": args})
    if text or not uses:
        content.append({"type": "text", "text": text})
    content.extend(uses)
    stop_sequence = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    if choice["finish_reason"] == "length":
        stop_reason, stop_sequence = "max_tokens", None
    elif uses:
        stop_reason, stop_sequence = "tool_use", None
    else:
        stop_reason = "stop_sequence" if stop_sequence is not None else "end_turn"
    usage = chat["usage"]
    return {"id": message_id, "type": "message", "role": "assistant", "model": chat["model"], "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def _object_or_none(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _stream(call: native.Call, deps: ProxyDeps, prepared: Any, message_id: str) -> AsyncIterator[bytes]:
    model = call.body.get("model") or deps.capture.config.model_name
    start: dict[str, Any] = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": len(prepared.prompt_ids), "output_tokens": 0,
                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
    yield _event("message_start", {"message": start})
    outcome = None
    async for outcome in native.generate_with_keepalive(call, deps.capture, prepared,
                                                        deps.capture.config.stream_keepalive_s):
        if outcome is None:
            yield PING
    assert outcome is not None
    if outcome.status_code != 200:
        error = {"type": "api_error" if outcome.status_code >= 500 else "invalid_request_error",
                 "message": _message_of(outcome.body)}
        yield _event("error", {"error": error})
        return
    result = outcome.protocol_body
    assert result is not None
    for frame in stream_events(result):
        yield frame


def stream_events(result: dict[str, Any]) -> Iterator[bytes]:
    """The events after `message_start` for a complete Messages body `result`."""
    for index, block in enumerate(result["content"]):
        match block["type"]:
            case "text":
                yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                if block["text"]:
                    yield _event("content_block_delta", {"index": index,
                                                         "delta": {"type": "text_delta", "text": block["text"]}})
            case "tool_use":
                yield _event("content_block_start", {"index": index, "content_block": block | {"input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
            case "thinking":
                yield _event("content_block_start", {"index": index, "content_block": {
                    "type": "thinking", "thinking": "", "signature": ""}})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": block["thinking"]}})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "signature_delta", "signature": block["signature"]}})
        yield _event("content_block_stop", {"index": index})
    usage = result["usage"]
    yield _event("message_delta", {"delta": {"stop_reason": result["stop_reason"],
                                             "stop_sequence": result["stop_sequence"]},
                                   "usage": {"input_tokens": usage["input_tokens"],
                                             "output_tokens": usage["output_tokens"]}})
    yield _event("message_stop", {})


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind} | data) + b"\n\n"

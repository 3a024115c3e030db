"""OpenAI Responses API (`POST /v1/responses`), unary and streamed, over the shared capture path.

Responsibility: convert a Responses request into one chat-completions body for the chat layer
(`to_chat_body`), and the chat result back into a Responses body (`response_body`) or event
stream (`stream_events`). Recording, sampling enforcement, limits and faithfulness are those
of chat completions (`native.py` -> `capture.py`); turns are recorded with
`protocol="responses"`.

Request conversion (each unsupported field or item type -> 400 naming it):
* `instructions` -> a leading system message; `input` as a string -> one user message.
* `input` items: `message` (also without `type`; roles user/system/developer/assistant;
  content a string or parts `input_text` / `output_text` / `text` / `refusal`, joined with
  "\\n" like the chat layer joins parts); `function_call` -> a tool call on the preceding
  assistant message (or a new one); `function_call_output` -> a `tool` message (output a
  string or text parts); `reasoning` (content `reasoning_text`, else its summary texts) ->
  the `reasoning_content` of the next assistant message (Codex replays reasoning items
  verbatim; the chat layer renders them only when the template has a place for them); an
  item with only `encrypted_content` is read back when this proxy wrote it (`include:
  ["reasoning.encrypted_content"]` makes reasoning items carry the text, base64url behind
  `hrl1.`), and is a 400 naming it when another server did (never silently dropped).
* `tools`: `function` tools -> chat function tools (all keys but `type` go under
  `function`); function tools inside a `namespace` are flattened (their bare names; a call
  of one comes back with its `namespace`); hosted tools the engine cannot run
  (`web_search`, `file_search`, `code_interpreter`, ...) are dropped and named in
  `Turn.notes`. This is the one documented exception to "nothing silently dropped": Codex
  sends `web_search` on every call. `custom` tools -> 400.
* `tool_choice` `auto`/`none`; `max_output_tokens` -> `max_tokens`; `temperature`,
  `top_p`, `top_k` pass through (the run's sampling wins when enforced);
  `include: ["message.output_text.logprobs"]` asks for logprobs.
* Ignored (they do not change what the model sees): `store`, `include` (other values),
  `prompt_cache_key`, `client_metadata`, `metadata`, `user`, `parallel_tool_calls`,
  `reasoning`, `service_tier`, `safety_identifier`, `stream_options`, `max_tool_calls`,
  `prompt_cache_retention`. Neutral values only: `text` (format `text`; `verbosity` ignored),
  `truncation` (`disabled`), `background` (false), `top_logprobs` (0),
  `previous_response_id` / `conversation` (null: nothing is stored server-side). The ignored
  fields are neither recorded nor echoed: a reply's `metadata` is `{}` and its
  `parallel_tool_calls` the default (an agent's large field never enters `raw_response`).

Result: output items in order reasoning (when the completion had a `<think>` block), message
(when there is text, or nothing else), function calls. A completion cut at the token cap is
`status: "incomplete"` with `incomplete_details.reason = "max_output_tokens"` and ends the
stream with `response.incomplete`, as the API does (Codex treats that as a stream error and
retries). Usage: `input_tokens` = prompt ids consumed, `output_tokens` = ids sampled;
`cached_tokens` and `reasoning_tokens` are 0 (not measured).

Stream: `response.created`, `response.in_progress` (sent before generation; SSE comments
keep the connection alive meanwhile), then per item `response.output_item.added`, its
content part / text / function-call-argument / reasoning-text events and
`response.output_item.done`, then `response.completed` (or `.incomplete`). An engine failure
after the stream started is `response.failed` with the error; errors before it started are an
ordinary HTTP error with an OpenAI error body. Every event carries `sequence_number`.

What this module deliberately does not do: store responses (`previous_response_id`), run
hosted tools, or chunk text token by token.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from harnessrl.errors import RequestError
from harnessrl.proxy import native
from harnessrl.proxy.app import ProxyDeps, json_response, read_session_json
from harnessrl.proxy.capture import ChatOutcome, Origin
from harnessrl.proxy.sse import KEEPALIVE
from harnessrl.proxy.wire import dumps, recorded_body

PROTOCOL = "responses"
EXTRA_HEADERS = ("thread-id", "originator", "x-client-request-id", "x-codex-window-id")
USED_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "stream", "max_output_tokens",
                         "temperature", "top_p", "top_k", "include"})
IGNORED_FIELDS = frozenset({"store", "prompt_cache_key", "client_metadata", "metadata", "user",
                            "parallel_tool_calls", "reasoning", "service_tier", "safety_identifier",
                            "stream_options", "max_tool_calls", "prompt_cache_retention"})
_NEUTRAL: dict[str, tuple[object, ...]] = {"truncation": (None, "disabled"), "background": (None, False),
                                           "top_logprobs": (None, 0), "previous_response_id": (None,),
                                           "conversation": (None,)}
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                          "code_interpreter", "image_generation", "computer_use_preview", "computer_use",
                          "mcp", "local_shell", "tool_search"})
"""Tool types the service runs itself; the engine cannot, so they are dropped (with a note)."""
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_LOGPROBS_INCLUDE = "message.output_text.logprobs"


async def handle(request: Request, session: Any, deps: ProxyDeps) -> Response:
    """`POST /v1/responses`: unary JSON, or the Responses event stream."""
    body = await read_session_json(request, session, deps)
    headers = native.kept_headers(request.headers, EXTRA_HEADERS)
    try:
        converted = to_chat_body(body)
    except RequestError as exc:
        native.record_rejected(session, PROTOCOL, body, headers, exc)
        raise
    response_id, created_at = "resp_" + secrets.token_hex(12), native.now_s()

    kept = recorded_body(body, IGNORED_FIELDS)  # what the turn keeps, and what the reply echoes

    def render(chat: dict[str, Any]) -> dict[str, Any]:
        return response_body(chat, kept, response_id, created_at)

    origin = Origin(PROTOCOL, kept, headers, converted.notes, render)
    call = native.Call(session, origin)
    prepared = await native.prepare(call, deps.capture, converted, request.headers)
    if isinstance(prepared, ChatOutcome):
        return json_response(prepared.status_code, prepared.body)
    if body.get("stream") is not True:
        outcome = await native.generate(call, deps.capture, prepared)
        if outcome.status_code != 200:
            return json_response(outcome.status_code, outcome.body)
        return json_response(200, outcome.protocol_body)
    return StreamingResponse(_stream(call, deps, prepared, response_id, created_at),
                             media_type="text/event-stream", headers={"cache-control": "no-cache"})


# ---------------------------------------------------------------- request -> chat body


def to_chat_body(body: dict[str, Any]) -> native.Converted:
    """Translate a Responses request body (see the module docstring).

    Raises:
        RequestError: unsupported field, item or part type, or a malformed one; `param`
            names it in the Responses body (`input[3].content[0].type`, `tools[2].type`, ...).
    """
    for key, value in body.items():
        if key in USED_FIELDS or key in IGNORED_FIELDS:
            continue
        if key in _NEUTRAL and value in _NEUTRAL[key]:
            continue
        if key == "text" and _neutral_text(value):
            continue
        raise RequestError(f"unsupported field '{key}'" if key not in _NEUTRAL and key != "text"
                           else f"{key}={value!r} is not supported by this proxy", param=key)
    tools, notes = _tools(body.get("tools"))
    include = body.get("include") or []
    if not isinstance(include, list):
        raise RequestError("'include' must be an array", param="include")
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": _messages(body), "stream": False}
    if tools:
        chat["tools"] = tools
    optional = {"tool_choice": body.get("tool_choice"), "max_tokens": body.get("max_output_tokens"),
                "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
                "logprobs": True if _LOGPROBS_INCLUDE in include else None}
    chat.update({k: v for k, v in optional.items() if v is not None})
    return native.Converted(chat, tuple(notes))


def _neutral_text(value: object) -> bool:
    if value is None:
        return True
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        return False
    fmt = value.get("format")
    return fmt is None or fmt == {"type": "text"}


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", param="instructions")
        out.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        return [*out, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError("'input' must be a string or a non-empty array of items", param="input")
    reasoning: list[str] = []
    after_assistant = False
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        match kind:
            case "message":
                out.append(_message(item, where, reasoning))
                reasoning = []
            case "reasoning":
                reasoning.append(_reasoning_text(item, where))
            case "function_call":
                _append_call(out, item, where, reasoning, continues=after_assistant)
                reasoning = []
            case "function_call_output":
                out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                            "content": _text(item.get("output"), f"{where}.output")})
            case _:
                raise RequestError(f"{where}.type={kind!r} is not supported (message, function_call, "
                                   f"function_call_output, reasoning)", param=f"{where}.type")
        if kind != "reasoning":
            after_assistant = out[-1]["role"] == "assistant"
    return out


def _message(item: dict[str, Any], where: str, reasoning: list[str]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(f"{where}.role={role!r} is not one of assistant, developer, system, user",
                           param=f"{where}.role")
    message: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
    if role == "assistant" and reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _append_call(out: list[dict[str, Any]], item: dict[str, Any], where: str, reasoning: list[str],
                 continues: bool) -> None:
    """A function_call joins the assistant message it follows (one model reply), else starts one."""
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise RequestError(f"{where}.arguments must be a JSON string", param=f"{where}.arguments")
    call = {"id": _str(item, "call_id", where), "type": "function",
            "function": {"name": _str(item, "name", where), "arguments": arguments}}
    if continues and out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
        return
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    out.append(message)


ENCRYPTED_PREFIX = "hrl1."
"""Marks an `encrypted_content` this proxy wrote: the reasoning text, base64url (it is the
agent's own context, not a secret; the prefix tells it apart from another server's blob)."""


def encode_reasoning(text: str) -> str:
    """The `encrypted_content` of a reasoning item whose text is `text` (`decode_reasoning` inverts it)."""
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def decode_reasoning(blob: str, where: str) -> str:
    """The reasoning text of an `encrypted_content` this proxy wrote.

    Raises:
        RequestError: another server's blob (opaque: it cannot be rendered, and dropping it
            would silently change the prompt), or a damaged one; `param` names the field.
    """
    if not blob.startswith(ENCRYPTED_PREFIX):
        raise RequestError(f"{where}.encrypted_content was not produced by this server: its reasoning cannot be "
                           "rendered (replay the reasoning text in 'content' or 'summary')",
                           param=f"{where}.encrypted_content")
    try:
        return base64.urlsafe_b64decode(blob.removeprefix(ENCRYPTED_PREFIX).encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError) as exc:
        raise RequestError(f"{where}.encrypted_content is damaged ({exc})", param=f"{where}.encrypted_content") from None


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not parts and isinstance(item.get("encrypted_content"), str):
        return decode_reasoning(item["encrypted_content"], where)
    if not isinstance(parts, list):
        raise RequestError(f"{where}.content must be an array", param=f"{where}.content")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise RequestError(f"{where} part [{j}] must be an object with a string 'text'", param=where)
        texts.append(part["text"])
    return "\n".join(texts)


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or an array of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise RequestError(f"{where}[{j}].type={kind!r} is not supported (text parts only)",
                               param=f"{where}[{j}].type")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _tools(raw: object) -> tuple[list[dict[str, Any]], list[str]]:
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise RequestError("'tools' must be an array", param="tools")
    tools: list[dict[str, Any]] = []
    notes: list[str] = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if not isinstance(kind, str):
            raise RequestError(f"tools[{i}].type must be a string, got {type(kind).__name__}",
                               param=f"tools[{i}].type")
        if kind == "function":
            tools.append(_function_tool(tool, f"tools[{i}]"))
        elif kind == "namespace":
            if not isinstance(tool.get("name"), str):
                raise RequestError(f"tools[{i}].name must be a string", param=f"tools[{i}].name")
            subs = tool.get("tools")
            if not isinstance(subs, list):
                raise RequestError(f"tools[{i}].tools must be an array", param=f"tools[{i}].tools")
            for j, sub in enumerate(subs):
                if not isinstance(sub, dict) or sub.get("type") != "function":
                    raise RequestError(f"tools[{i}].tools[{j}] must be a function tool", param=f"tools[{i}].tools[{j}]")
                tools.append(_function_tool(sub, f"tools[{i}].tools[{j}]"))
        elif kind in HOSTED_TOOLS:
            notes.append(f"dropped hosted tool tools[{i}] (type {kind!r}): the engine cannot run it")
        else:
            raise RequestError(f"tools[{i}].type={kind!r} is not supported (function, namespace, hosted tools)",
                               param=f"tools[{i}].type")
    return tools, notes


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str):
        raise RequestError(f"{where}.name must be a string", param=f"{where}.name")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


# ---------------------------------------------------------------- chat result -> Responses


def response_body(chat: dict[str, Any], request: dict[str, Any], response_id: str, created_at: int) -> dict[str, Any]:
    """The Responses body for a unary chat.completion `chat` (see the module docstring)."""
    choice = chat["choices"][0]
    message = choice["message"]
    truncated = choice["finish_reason"] == "length"
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        item = {"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]}
        include = request.get("include")
        if isinstance(include, list) and "reasoning.encrypted_content" in include:
            item["encrypted_content"] = encode_reasoning(message["reasoning_content"])
        output.append(item)
    calls = message.get("tool_calls") or []
    if message.get("content") is not None or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        part = {"type": "output_text", "text": message.get("content") or "", "annotations": [], "logprobs": logprobs}
        output.append({"type": "message", "id": "msg_" + secrets.token_hex(12),
                       "status": "incomplete" if truncated else "completed", "role": "assistant",
                       "content": [part]})
    namespaces = _namespaces(request.get("tools"))
    for c in calls:
        item = {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": c["id"],
                "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
        if c["function"]["name"] in namespaces:
            item["namespace"] = namespaces[c["function"]["name"]]
        output.append(item)
    usage = chat["usage"]
    return _skeleton(request, response_id, created_at, chat["model"]) | {
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "output": output,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }


def _namespaces(tools: object) -> dict[str, str]:
    """Function name -> namespace name, for the function tools inside `namespace` tools."""
    listed = tools if isinstance(tools, list) else []
    return {sub["name"]: tool["name"] for tool in listed if isinstance(tool, dict) and tool.get("type") == "namespace"
            for sub in tool.get("tools") or [] if isinstance(sub, dict) and isinstance(sub.get("name"), str)}


def _skeleton(request: dict[str, Any], response_id: str, created_at: int, model: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": request.get("instructions"), "metadata": request.get("metadata") or {},
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "temperature": request.get("temperature"), "top_p": request.get("top_p"),
            "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None}


async def _stream(call: native.Call, deps: ProxyDeps, prepared: Any, response_id: str,
                  created_at: int) -> AsyncIterator[bytes]:
    seq = iter(range(1 << 62))
    start = _skeleton(call.body, response_id, created_at, call.body.get("model") or deps.capture.config.model_name)
    yield _event("response.created", next(seq), {"response": start})
    yield _event("response.in_progress", next(seq), {"response": start})
    outcome = None
    async for outcome in native.generate_with_keepalive(call, deps.capture, prepared,
                                                        deps.capture.config.stream_keepalive_s):
        if outcome is None:
            yield KEEPALIVE
    assert outcome is not None
    if outcome.status_code != 200:
        err = outcome.body["error"]
        failed = start | {"status": "failed", "error": {"code": err.get("code") or "server_error",
                                                        "message": err["message"]}}
        yield _event("response.failed", next(seq), {"response": failed})
        return
    result = outcome.protocol_body
    assert result is not None
    for frame in stream_events(result, seq):
        yield frame


def stream_events(result: dict[str, Any], seq: Iterator[int]) -> Iterator[bytes]:
    """The events after `response.in_progress` for a complete Responses body `result`."""
    for index, item in enumerate(result["output"]):
        yield from _item_events(index, item, seq)
    kind = "response.incomplete" if result["status"] == "incomplete" else "response.completed"
    yield _event(kind, next(seq), {"response": result})


def _item_events(index: int, item: dict[str, Any], seq: Iterator[int]) -> Iterator[bytes]:
    ref = {"output_index": index, "item_id": item["id"]}
    match item["type"]:
        case "message":
            yield _event("response.output_item.added", next(seq), {"output_index": index,
                                                                   "item": item | {"status": "in_progress",
                                                                                   "content": []}})
            part = item["content"][0]
            part_ref = ref | {"content_index": 0}
            yield _event("response.content_part.added", next(seq), part_ref | {"part": part | {"text": ""}})
            if part["text"]:
                yield _event("response.output_text.delta", next(seq),
                             part_ref | {"delta": part["text"], "logprobs": part["logprobs"]})
            yield _event("response.output_text.done", next(seq),
                         part_ref | {"text": part["text"], "logprobs": part["logprobs"]})
            yield _event("response.content_part.done", next(seq), part_ref | {"part": part})
        case "function_call":
            yield _event("response.output_item.added", next(seq), {"output_index": index,
                                                                   "item": item | {"status": "in_progress",
                                                                                   "arguments": ""}})
            yield _event("response.function_call_arguments.delta", next(seq), ref | {"delta": item["arguments"]})
            yield _event("response.function_call_arguments.done", next(seq),
                         ref | {"arguments": item["arguments"], "name": item["name"]})
        case "reasoning":
            yield _event("response.output_item.added", next(seq), {"output_index": index,
                                                                   "item": item | {"content": []}})
            text = item["content"][0]["text"]
            yield _event("response.reasoning_text.delta", next(seq), ref | {"content_index": 0, "delta": text})
            yield _event("response.reasoning_text.done", next(seq), ref | {"content_index": 0, "text": text})
    yield _event("response.output_item.done", next(seq), {"output_index": index, "item": item})


def _event(kind: str, sequence_number: int, data: dict[str, Any]) -> bytes:
    payload = {"type": kind, "sequence_number": sequence_number} | data
    return b"event: " + kind.encode() + b"\ndata: " + dumps(payload) + b"\n\n"


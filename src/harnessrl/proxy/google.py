"""Google's Gemini API (`POST /v1beta/models/{model}:generateContent` and
`:streamGenerateContent`, also under `/v1/models/...`) over the shared capture path.

Responsibility: convert a `generateContent` request into one chat-completions body for the
chat layer (`to_chat_body`), and the chat result back into a `GenerateContentResponse`
(`response_body`), unary or streamed. Recording, sampling enforcement, limits, the call budget
and faithfulness are those of chat completions (`native.py` -> `capture.py`); turns are
recorded with `protocol="google"`. Key: `x-goog-api-key` (the SDKs' header), `?key=`, or any
of the other forms `app.session_key` accepts; the model in the path is recorded, the proxy
serves its one model whatever it is called.

Request conversion (each unsupported field or part -> 400 naming it, in Google's error form
`{"error": {"code", "message", "status"}}`):
* `systemInstruction` (a string or `{parts: [{text}]}`) -> a leading system message.
* `contents[i]` with role `user` (or absent) / `model`; parts:
  - `text` -> user or assistant text (parts of one content joined with "\\n"); a model part
    with `thought: true` -> `reasoning_content`; `thoughtSignature` is dropped and noted;
  - model `functionCall {name, args, id?}` -> a tool call (args re-serialised as JSON; a call
    without an id gets `call_<content>_<part>`);
  - user `functionResponse {name, response, id?}` -> a `tool` message answering the call with
    that id, else the earliest unanswered call of that name, its content the JSON of
    `response`.
* `tools[].functionDeclarations[]` (`parameters` or `parametersJsonSchema`) -> chat function
  tools; other tools (`googleSearch`, `codeExecution`, ...) are dropped and noted.
* `toolConfig.functionCallingConfig.mode` `AUTO` / `NONE` (`ANY` -> 400: the engine cannot
  force a call); `generationConfig` `maxOutputTokens`, `temperature`, `topP`, `topK`,
  `stopSequences`, `seed` -> chat fields; `candidateCount` above 1 -> 400.
* Every field of a part (`function_call`, `function_response`, `thought_signature`,
  `inline_data`, ...), of a call, an answer, a function declaration and `generationConfig` is
  read in either spelling the API accepts, camelCase or snake_case (`camel_keys`), like the
  top-level fields.
* Ignored: `safetySettings`, `labels`, `generationConfig.thinkingConfig` (the chat template
  decides whether the model thinks), `responseMimeType: "text/plain"`.

Result: one candidate, role `model`, parts: a `thought: true` text part when the completion
had a `<think>` block, the text (when there is text, or nothing else), one `functionCall`
part per parsed call (args = the parsed arguments; arguments that are not a JSON object stay in
the text). `finishReason` `MAX_TOKENS` when truncated, else `STOP` (Gemini's reason for tool
calls too). `usageMetadata`: prompt ids consumed, ids sampled, their sum.

Stream: with `alt=sse`, `data: <GenerateContentResponse>` events (the whole reply in one
event; an engine failure after the stream started is an `error` event); without it a JSON
array of responses, as the API sends.

What this module deliberately does not do: files, inline images or audio, cached contents,
code execution, grounding, or the Live API.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from harnessrl.chat.layer import ToolCall, hermes_tool_call, normalize_tools
from harnessrl.errors import RequestError
from harnessrl.proxy import native
from harnessrl.proxy.app import ProxyDeps, json_response, read_session_json
from harnessrl.proxy.capture import ChatOutcome, Origin
from harnessrl.proxy.wire import DEFAULT_LIMITS, RequestLimits, check_stop, dumps, limits_of, recorded_body

PROTOCOL = "google"
ROUTE = "/v1beta/models/{target}"
"""The route (with `/r/<key>` in front too); `target` is `<model>:generateContent` or
`<model>:streamGenerateContent`."""
V1_ROUTE = "models/{target}"
"""The same under `/v1` (`/v1/models/<model>:generateContent`), where newer SDKs default."""
EXTRA_HEADERS = ("x-goog-api-client", "x-gemini-api-privileged-user-id")
USED_FIELDS = frozenset({"contents", "systemInstruction", "system_instruction", "tools", "toolConfig",
                         "tool_config", "generationConfig", "generation_config"})
IGNORED_FIELDS = frozenset({"safetySettings", "safety_settings", "labels"})
GENERATION_FIELDS = {"maxOutputTokens": "max_tokens", "temperature": "temperature", "topP": "top_p",
                     "topK": "top_k", "stopSequences": "stop", "seed": "seed"}
_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
           413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


async def handle(request: Request, session: Any, deps: ProxyDeps) -> Response:
    """`POST /v1beta/models/{model}:generateContent` or `:streamGenerateContent`."""
    model, _, action = request.path_params["target"].partition(":")
    if action not in ("generateContent", "streamGenerateContent"):
        return error_response(404, f"unknown method {action or '(none)'!r}; expected generateContent or "
                                   "streamGenerateContent")
    headers = native.kept_headers(request.headers, EXTRA_HEADERS)
    try:
        body = await read_session_json(request, session, deps)
        converted = _convert_or_record(session, body, model, headers, limits_of(deps.capture.config))
    except RequestError as exc:
        return error_response(exc.status_code, exc.message)
    response_id = secrets.token_hex(12)

    def render(chat: dict[str, Any]) -> dict[str, Any]:
        return response_body(chat, response_id, model)

    origin = Origin(PROTOCOL, recorded_body(body, IGNORED_FIELDS), headers, converted.notes, render)
    call = native.Call(session, origin)
    prepared = await native.prepare(call, deps.capture, converted, request.headers)
    if isinstance(prepared, ChatOutcome):
        return error_response(prepared.status_code, _message_of(prepared.body))
    if action == "generateContent":
        outcome = await native.generate(call, deps.capture, prepared)
        if outcome.status_code != 200:
            return error_response(outcome.status_code, _message_of(outcome.body))
        return json_response(200, outcome.protocol_body)
    sse = request.query_params.get("alt") == "sse"
    return StreamingResponse(_stream(call, deps, prepared, sse),
                             media_type="text/event-stream" if sse else "application/json",
                             headers={"cache-control": "no-cache"})


def error_response(status_code: int, message: str) -> Response:
    """Google's error form: `{"error": {"code", "message", "status"}}`."""
    status = _STATUS.get(status_code, "INTERNAL" if status_code >= 500 else "INVALID_ARGUMENT")
    return json_response(status_code, {"error": {"code": status_code, "message": message, "status": status}})


async def _stream(call: native.Call, deps: ProxyDeps, prepared: Any, sse: bool) -> AsyncIterator[bytes]:
    outcome = None
    async for outcome in native.generate_with_keepalive(call, deps.capture, prepared,
                                                        deps.capture.config.stream_keepalive_s):
        if outcome is None and sse:
            yield b": keep-alive\n\n"
    assert outcome is not None
    if outcome.status_code != 200:
        error = {"error": {"code": outcome.status_code, "message": _message_of(outcome.body),
                           "status": _STATUS.get(outcome.status_code, "INTERNAL")}}
        yield (b"event: error\ndata: " + dumps(error) + b"\n\n") if sse else dumps([error])
        return
    assert outcome.protocol_body is not None
    yield (b"data: " + dumps(outcome.protocol_body) + b"\n\n") if sse else dumps([outcome.protocol_body])


def _convert_or_record(session: Any, body: dict[str, Any], model: str, headers: dict[str, str],
                       limits: RequestLimits) -> native.Converted:
    try:
        return to_chat_body(body, model, limits)
    except RequestError as exc:
        native.record_rejected(session, PROTOCOL, body, headers, exc)
        raise


def _message_of(error: dict[str, Any]) -> str:
    return str(error.get("error", {}).get("message", error))


# ---------------------------------------------------------------- request -> chat body


def to_chat_body(body: dict[str, Any], model: str = "", limits: RequestLimits = DEFAULT_LIMITS) -> native.Converted:
    """Translate a `generateContent` body (see the module docstring); `stopSequences` within
    `limits` (`wire.check_stop`).

    Raises:
        RequestError: unsupported field or part, or a malformed one; `param` names it
            (`contents[2].parts[0]`, `tools[0].functionDeclarations[1].parameters`, ...).
    """
    for key in body:
        if key not in USED_FIELDS and key not in IGNORED_FIELDS:
            raise RequestError(f"unsupported field '{key}'", param=key)
    notes: list[str] = []
    messages = _system(body.get("systemInstruction", body.get("system_instruction")))
    contents = body.get("contents")
    if isinstance(contents, dict):
        contents = [contents]
    if not isinstance(contents, list) or not contents:
        raise RequestError("'contents' must be a non-empty array", param="contents")
    pending: list[tuple[str, str]] = []  # (name, id) of calls not answered yet, in order
    for i, content in enumerate(contents):
        messages.extend(_content(content, i, pending, notes))
    chat: dict[str, Any] = {"model": model, "messages": messages, "stream": False}
    tools = _tools(body.get("tools"), notes)
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("toolConfig", body.get("tool_config")))
    chat.update(_generation(body.get("generationConfig", body.get("generation_config")), limits))
    return native.Converted(chat, tuple(notes))


def camel_keys(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """`obj` with its snake_case keys in Google's camelCase spelling (`function_call` ->
    `functionCall`, `thought_signature` -> `thoughtSignature`): the API accepts both spellings
    of every field (proto JSON), so parts, their calls and answers, function declarations and
    `generationConfig` are read in one. Keys without "_" are kept as they are.

    Raises:
        RequestError: both spellings of one field are given (`param` names it).
    """
    if not any("_" in k for k in obj):
        return obj
    out: dict[str, Any] = {}
    for key, value in obj.items():
        head, *rest = key.split("_")
        name = head + "".join(w[:1].upper() + w[1:] for w in rest)
        if name in out:
            raise RequestError(f"{where}.{name} is given twice (as {name} and as a snake_case spelling)",
                               param=f"{where}.{name}")
        out[name] = value
    return out


def _system(system: object) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, dict) or not isinstance(system.get("parts"), list):
        raise RequestError("systemInstruction must be a string or {parts: [{text}]}", param="systemInstruction")
    texts = []
    for j, part in enumerate(system["parts"]):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            at = f"systemInstruction.parts[{j}]"
            raise RequestError(f"{at} must be a text part", param=at)
        texts.append(part["text"])
    return [{"role": "system", "content": "\n".join(texts)}]


def _content(content: object, i: int, pending: list[tuple[str, str]], notes: list[str]) -> list[dict[str, Any]]:
    where = f"contents[{i}]"
    if not isinstance(content, dict):
        raise RequestError(f"{where} must be an object", param=where)
    role = content.get("role") or "user"
    if role not in ("user", "model"):
        raise RequestError(f"{where}.role={role!r} is not one of user, model", param=f"{where}.role")
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise RequestError(f"{where}.parts must be an array", param=f"{where}.parts")
    if role == "model":
        return [_model(parts, i, pending, notes)]
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"{at} must be an object", param=at)
        part = camel_keys(part, at)
        if isinstance(part.get("text"), str):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + part["text"]
            else:
                out.append({"role": "user", "content": part["text"]})
        elif isinstance(part.get("functionResponse"), dict):
            fr = camel_keys(part["functionResponse"], f"{at}.functionResponse")
            if not isinstance(fr.get("name"), str):
                raise RequestError(f"{at}.functionResponse.name must be a string", param=f"{at}.functionResponse.name")
            call_id = _answer(pending, fr["name"], fr.get("id"))
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": json.dumps(fr.get("response", {}), ensure_ascii=False, sort_keys=True)})
        else:
            kinds = ", ".join(sorted(k for k in part if k != "thoughtSignature")) or "(empty)"
            raise RequestError(f"{at} ({kinds}) is not supported in a user content (text, functionResponse)",
                               param=at)
    return out


def _model(parts: list[Any], i: int, pending: list[tuple[str, str]], notes: list[str]) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        at = f"contents[{i}].parts[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"{at} must be an object", param=at)
        part = camel_keys(part, at)
        if "thoughtSignature" in part:
            notes.append(f"dropped {at}.thoughtSignature (opaque)")
        if isinstance(part.get("text"), str):
            (thoughts if part.get("thought") is True else texts).append(part["text"])
        elif isinstance(part.get("functionCall"), dict):
            fc = camel_keys(part["functionCall"], f"{at}.functionCall")
            if not isinstance(fc.get("name"), str):
                raise RequestError(f"{at}.functionCall.name must be a string", param=f"{at}.functionCall.name")
            call_id = fc["id"] if isinstance(fc.get("id"), str) and fc["id"] else f"call_{i}_{j}"
            pending.append((fc["name"], call_id))
            calls.append({"id": call_id, "type": "function", "function": {
                "name": fc["name"], "arguments": json.dumps(fc.get("args") or {}, ensure_ascii=False)}})
        elif set(part) <= {"thoughtSignature", "thought"}:
            continue
        else:
            kinds = ", ".join(sorted(part)) or "(empty)"
            raise RequestError(f"{at} ({kinds}) is not supported in a model content (text, functionCall)", param=at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _answer(pending: list[tuple[str, str]], name: str, call_id: object) -> str:
    for k, (n, cid) in enumerate(pending):
        if (isinstance(call_id, str) and call_id and cid == call_id) or (not call_id and n == name):
            del pending[k]
            return cid
    return call_id if isinstance(call_id, str) and call_id else f"call_{name}"


def _tools(raw: object, notes: list[str]) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("'tools' must be an array", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}] must be an object", param=f"tools[{i}]")
        decls = tool.get("functionDeclarations", tool.get("function_declarations"))
        others = sorted(k for k in tool if k not in ("functionDeclarations", "function_declarations"))
        if others:
            notes.append(f"dropped tools[{i}] {', '.join(others)}: the engine cannot run it")
        if decls is None:
            continue
        if not isinstance(decls, list):
            at = f"tools[{i}].functionDeclarations"
            raise RequestError(f"{at} must be an array", param=at)
        for k, decl in enumerate(decls):
            at = f"tools[{i}].functionDeclarations[{k}]"
            if not isinstance(decl, dict) or not isinstance(decl.get("name"), str):
                raise RequestError(f"{at}.name must be a string", param=f"{at}.name")
            decl = camel_keys(decl, at)
            schema = decl.get("parametersJsonSchema", decl.get("parameters")) or {"type": "object", "properties": {}}
            if not isinstance(schema, dict):
                raise RequestError(f"{at}.parameters must be an object", param=f"{at}.parameters")
            fn: dict[str, Any] = {"name": decl["name"], "parameters": _lower_types(schema)}
            if decl.get("description") is not None:
                fn["description"] = decl["description"]
            tools.append({"type": "function", "function": fn})
    return normalize_tools(tools)


def _lower_types(schema: Any) -> Any:
    """Gemini's OpenAPI schemas spell types in capitals (`OBJECT`, `STRING`); JSON Schema does not."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def _tool_choice(config: object) -> str:
    mode = None
    if isinstance(config, dict):
        fcc = config.get("functionCallingConfig", config.get("function_calling_config"))
        mode = fcc.get("mode") if isinstance(fcc, dict) else None
    if mode in (None, "AUTO", "MODE_UNSPECIFIED"):
        return "auto"
    if mode == "NONE":
        return "none"
    raise RequestError(f"toolConfig.functionCallingConfig.mode={mode!r} is not supported (AUTO or NONE)",
                       param="toolConfig.functionCallingConfig.mode")


def _generation(config: object, limits: RequestLimits) -> dict[str, Any]:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise RequestError("generationConfig must be an object", param="generationConfig")
    config = camel_keys(config, "generationConfig")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key == "stopSequences":
            stop = check_stop(value, "generationConfig.stopSequences", limits)
            if stop:
                out["stop"] = list(stop)
        elif key in GENERATION_FIELDS:
            if value is not None:
                out[GENERATION_FIELDS[key]] = value
        elif key == "candidateCount":
            if value not in (None, 1):
                raise RequestError("generationConfig.candidateCount must be 1", param="generationConfig.candidateCount")
        elif key == "responseMimeType":
            if value not in (None, "text/plain"):
                raise RequestError(f"generationConfig.responseMimeType={value!r} is not supported (text/plain)",
                                   param="generationConfig.responseMimeType")
        elif key not in ("thinkingConfig",):
            raise RequestError(f"unsupported field 'generationConfig.{key}'", param=f"generationConfig.{key}")
    return out


# ---------------------------------------------------------------- chat result -> Google


def response_body(chat: dict[str, Any], response_id: str, model: str) -> dict[str, Any]:
    """The `GenerateContentResponse` for a unary chat.completion `chat` (module docstring)."""
    choice = chat["choices"][0]
    message = choice["message"]
    parts: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        parts.append({"text": message["reasoning_content"], "thought": True})
    text = message.get("content") or ""
    calls: list[dict[str, Any]] = []
    for c in message.get("tool_calls") or []:
        args = _object_or_none(c["function"]["arguments"])
        if args is None:  # not an object: keep the call as the text the model wrote
            text = (text + "\n" if text else "") + hermes_tool_call(ToolCall(c["id"], c["function"]["name"],
                                                                             c["function"]["arguments"]))
        else:
            calls.append({"functionCall": {"id": c["id"], "name": c["function"]["name"], "args": args}})
    if text or not calls:
        parts.append({"text": text})
    parts.extend(calls)
    usage = chat["usage"]
    return {"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0,
                            "finishReason": "MAX_TOKENS" if choice["finish_reason"] == "length" else "STOP"}],
            "usageMetadata": {"promptTokenCount": usage["prompt_tokens"],
                              "candidatesTokenCount": usage["completion_tokens"],
                              "totalTokenCount": usage["prompt_tokens"] + usage["completion_tokens"]},
            "modelVersion": model or chat["model"], "responseId": response_id}


def _object_or_none(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

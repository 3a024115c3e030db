"""OpenAI chat-completions wire format: request validation, error bodies, JSON codec.

Responsibility: turn a decoded request body into a `ChatRequest` or raise `RequestError`
naming the field, and build OpenAI-style error bodies. Validation is hand-written over the
dict (no pydantic pass over 60 KB message lists on the hot path).

Request fields:
* used: `model`, `messages`, `tools`, `tool_choice` (`auto`/`none`; `none` renders no tools
  and parses no calls), `stream`, `stream_options.include_usage`, `max_tokens`,
  `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, `logprobs`.
* accepted and ignored, because they do not change what the model sees: `store`, `user`,
  `metadata`, `parallel_tool_calls`, `prompt_cache_key`, `reasoning_effort`, `service_tier`,
  `safety_identifier`; they (and the ignored message keys `refusal`, `annotations`,
  `cache_control`) are not recorded on the turn (`recorded_body`).
* list fields are bounded (`RequestLimits`, from `ProxyConfig`): `stop` (`max_stop_strings`
  strings of at most `max_stop_bytes` bytes), `messages` (`max_messages`), replayed
  `tool_calls` per message (`max_tool_calls_per_message`), `tools` (`max_tools`, and
  `max_tools_bytes` of JSON in all); beyond, 400 naming the field and the knob.
* accepted only at their neutral value (else 400 naming the field): `n` (1),
  `frequency_penalty` / `presence_penalty` (0), `logit_bias` (empty), `response_format`
  (`{"type": "text"}`), `modalities` (`["text"]`), `top_logprobs` (0).
* anything else: 400 `unsupported field '<name>'`.

What this module deliberately does not do: render, sample, or decide sampling overrides
(`capture.py` does, from `ProxyConfig`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from harnessrl.chat.layer import Message, normalize_messages, normalize_tools
from harnessrl.chat.messages import IGNORED_MESSAGE_KEYS
from harnessrl.errors import RequestError

USED_FIELDS = frozenset(
    {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "max_tokens",
     "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs"}
)
IGNORED_FIELDS = frozenset(
    {"store", "user", "metadata", "parallel_tool_calls", "prompt_cache_key", "reasoning_effort",
     "service_tier", "safety_identifier"}
)
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (None, 1),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "top_logprobs": (None, 0),
}


@dataclass(slots=True)
class ChatRequest:
    """A validated chat-completions request (agent's values, before the run's overrides);
    nothing assigns to it after validation."""

    model: str
    messages: list[Message]
    tools: list[dict[str, Any]]
    """Function tools to render; empty when none were sent or `tool_choice` is `none`."""
    stream: bool
    include_usage: bool
    max_tokens: int | None
    """`max_completion_tokens`, else `max_tokens`, else None."""
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    logprobs: bool


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on the list fields whose size drives a call's CPU on the event loop (every stop
    string is searched in each reply and by the engine; every message and tool is rendered by
    the template), from `ProxyConfig` (`limits_of`); beyond one, 400 naming the field."""

    max_stop_strings: int = 16
    max_stop_bytes: int = 256
    max_messages: int = 4096
    max_tool_calls_per_message: int = 128
    max_tools: int = 256
    max_tools_bytes: int = 1024 * 1024


DEFAULT_LIMITS = RequestLimits()


def limits_of(config: Any) -> RequestLimits:
    """The `RequestLimits` of a `ProxyConfig` (one instance per config object, found by the
    object's identity: hashing a frozen pydantic config hashes every field)."""
    entry = _LIMITS.get(id(config))
    if entry is not None and entry[0] is config:
        return entry[1]
    limits = RequestLimits(config.max_stop_strings, config.max_stop_bytes, config.max_messages,
                           config.max_tool_calls_per_message, config.max_tools, config.max_tools_bytes)
    if len(_LIMITS) >= 16:
        _LIMITS.clear()
    _LIMITS[id(config)] = (config, limits)  # the config is held, so its id is not reused meanwhile
    return limits


_LIMITS: dict[int, tuple[object, RequestLimits]] = {}


def check_stop(value: object, field: str, limits: RequestLimits) -> tuple[str, ...]:
    """Stop strings as a tuple: a string or an array of at most `max_stop_strings` strings of
    at most `max_stop_bytes` UTF-8 bytes each (a string of more than a quarter of that many
    characters is measured; none shorter can exceed it).

    Raises:
        RequestError: the value has the wrong type or exceeds a bound; `param` is `field`.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise RequestError(f"'{field}' must be a string or an array of strings", param=field)
    if len(value) > limits.max_stop_strings:
        raise RequestError(f"'{field}' has {len(value)} strings; at most {limits.max_stop_strings} are accepted "
                           f"(max_stop_strings)", param=field, code="too_many_stop_strings")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise RequestError(f"'{field}' must be a string or an array of strings", param=field)
        if len(s) * 4 > limits.max_stop_bytes and len(s.encode("utf-8", "surrogatepass")) > limits.max_stop_bytes:
            raise RequestError(f"'{field}'[{i}] has {len(s.encode('utf-8', 'surrogatepass'))} bytes; at most "
                               f"{limits.max_stop_bytes} are accepted (max_stop_bytes)", param=field,
                               code="stop_string_too_long")
    return tuple(value)


def check_sizes(messages: list[Any], tools: list[dict[str, Any]], limits: RequestLimits) -> None:
    """Refuse more than `max_tool_calls_per_message` replayed calls on one message, and tool
    definitions whose JSON exceeds `max_tools_bytes` in all (the counts of messages and tools
    are checked before they are validated, in `parse_chat_request`).

    Raises:
        RequestError: naming the field and the knob.
    """
    cap = limits.max_tool_calls_per_message
    for i, m in enumerate(messages):
        if len(m.tool_calls) > cap:
            raise RequestError(f"messages[{i}] has {len(m.tool_calls)} tool calls; at most {cap} are accepted "
                               f"(max_tool_calls_per_message)", param=f"messages[{i}].tool_calls",
                               code="too_many_tool_calls")
    if not tools:
        return
    try:
        size = len(orjson.dumps(tools))
    except TypeError:  # not plain JSON (an int past 64 bits): measured the slow way
        size = len(json.dumps(tools).encode())
    if size > limits.max_tools_bytes:
        raise RequestError(f"the tool definitions have {size} bytes of JSON; at most {limits.max_tools_bytes} are "
                           f"accepted (max_tools_bytes)", param="tools", code="tools_too_large")


MAX_JSON_DEPTH = 64
"""Default nesting limit of request bodies (objects and arrays; the body itself is level 1).
Real agent bodies nest under 20 levels; the JSON encoders that later write the trace stop at
255 levels, so a body must be refused long before that (DESIGN.md §4)."""


_COUNT_BRACKETS_BELOW = 8192
"""`loads` counts a body's brackets (to skip the depth walk) only when it is smaller than this."""


def loads(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """Decode a JSON object body nested at most `max_depth` levels.

    Raises:
        RequestError: the body is not valid JSON, not an object, or nested deeper than
            `max_depth` (code `json_too_deep`; the message names the limit); param None.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc) or "recursion" in str(exc).lower():
            raise _too_deep(max_depth) from exc
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    # a body with at most max_depth brackets cannot nest deeper; a large one always has more
    # (counting them would cost as much as the walk)
    if (len(raw) > _COUNT_BRACKETS_BELOW or raw.count(b"{") + raw.count(b"[") > max_depth) \
            and json_depth(body, max_depth) > max_depth:
        raise _too_deep(max_depth)
    return body


def json_depth(obj: object, limit: int) -> int:
    """Nesting depth of decoded JSON (a scalar is 0, `{}` is 1), counted up to `limit + 1`.

    Iterative (no recursion limit); stops as soon as the depth exceeds `limit`.
    """
    if type(obj) is not dict and type(obj) is not list:
        return 0
    deepest = 1
    stack: list[tuple[Any, int]] = [(obj, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > deepest:
            deepest = depth
            if depth > limit:
                return depth
        for value in (node.values() if type(node) is dict else node):
            kind = type(value)
            if kind is dict or kind is list:
                push((value, depth + 1))
    return deepest


def _too_deep(max_depth: int) -> RequestError:
    return RequestError(f"request body nests deeper than {max_depth} levels (max_json_depth={max_depth})",
                        code="json_too_deep")


def dumps(obj: object) -> bytes:
    return orjson.dumps(obj)


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI-style error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_chat_request(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    """Validate a chat-completions body, its list fields within `limits` (`check_stop`,
    `check_sizes`).

    Raises:
        RequestError: a field has the wrong type, is unsupported, exceeds a limit, or asks for
            something the proxy cannot honour; `param` names it.
    """
    for key, value in body.items():
        if key in USED_FIELDS or key in IGNORED_FIELDS:
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise RequestError(f"{key}={value!r} is not supported by this proxy", param=key)
            continue
        raise RequestError(f"unsupported field '{key}'", param=key)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    stream = _opt(body, "stream", bool) or False
    options = _opt(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    stop = check_stop(body.get("stop"), "stop", limits)  # first: a long list costs before anything else
    raw_messages = body.get("messages")
    if isinstance(raw_messages, list) and len(raw_messages) > limits.max_messages:
        raise RequestError(f"the request has {len(raw_messages)} messages; at most {limits.max_messages} are "
                           f"accepted (max_messages)", param="messages", code="too_many_messages")
    raw_tools = body.get("tools")
    if isinstance(raw_tools, list) and len(raw_tools) > limits.max_tools:
        raise RequestError(f"the request has {len(raw_tools)} tools; at most {limits.max_tools} are accepted "
                           f"(max_tools)", param="tools", code="too_many_tools")
    messages = normalize_messages(raw_messages)
    tools = _tools(body)
    check_sizes(messages, tools, limits)
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=_opt_float(body, "temperature", 0.0, 2.0),
        top_p=_opt_float(body, "top_p", 0.0, 1.0),
        top_k=_top_k(body),
        seed=_seed(body),
        stop=stop,
        logprobs=_opt(body, "logprobs", bool) or False,
    )


UNRENDERED_KEPT_CHARS = 256
"""An unrendered message key whose value is a string of at most this many characters (an id,
a name) is kept on the record; a longer or non-string value is dropped."""


def recorded_body(body: dict[str, Any], ignored: frozenset[str] = IGNORED_FIELDS,
                  message_keys: frozenset[str] = IGNORED_MESSAGE_KEYS,
                  unrendered: frozenset[str] = frozenset()) -> dict[str, Any]:
    """What a turn records of a request body: `body` without its top-level fields in `ignored`
    and, for a chat body, without the message keys in `message_keys` (those that change nothing
    the model sees, `messages.IGNORED_MESSAGE_KEYS`) nor the values of the keys in `unrendered`
    (those the chat template never renders, `ChatLayer.unrendered_message_keys`) longer than
    `UNRENDERED_KEPT_CHARS`: a `tool_call_id` or `name` stays, megabytes of unrendered
    `reasoning_content` do not reach the trace (memory, `rollouts.jsonl`). `body` itself is
    unchanged; returned as is when nothing is dropped."""
    if not ignored.isdisjoint(body):
        body = {k: v for k, v in body.items() if k not in ignored}
    messages = body.get("messages") if ignored is IGNORED_FIELDS else None
    if type(messages) is not list:
        return body

    def dropped(key: str, value: object) -> bool:
        return key in message_keys or (key in unrendered and not (
            type(value) is str and len(value) <= UNRENDERED_KEPT_CHARS))

    if any(type(m) is dict and any(dropped(k, v) for k, v in m.items()) for m in messages):
        kept = [{k: v for k, v in m.items() if not dropped(k, v)} if type(m) is dict else m for m in messages]
        body = {**body, "messages": kept}
    return body


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = normalize_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return []
    raise RequestError(f"tool_choice={choice!r} is not supported (only 'auto' or 'none')", param="tool_choice")


def _opt(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise RequestError(f"'{key}' must be a {kind.__name__}, got {type(value).__name__}", param=key)
    return value


def _opt_int(body: dict[str, Any], key: str, minimum: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {value!r}", param=key)
    if minimum is not None and value < minimum:
        raise RequestError(f"'{key}' must be >= {minimum}, got {value}", param=key)
    return value


def _opt_float(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"'{key}' must be a number in [{low}, {high}], got {value!r}", param=key)
    return float(value)


def _seed(body: dict[str, Any]) -> int | None:
    value = _opt_int(body, "seed", None)
    if value is not None and not -(2**63) <= value < 2**64:
        raise RequestError(f"'seed' must be a 64-bit integer, got {value}", param="seed")
    return value


def _top_k(body: dict[str, Any]) -> int | None:
    value = _opt_int(body, "top_k", -1)
    return None if value is None else max(value, 0)

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
  `safety_identifier`.
* accepted only at their neutral value (else 400 naming the field): `n` (1),
  `frequency_penalty` / `presence_penalty` (0), `logit_bias` (empty), `response_format`
  (`{"type": "text"}`), `modalities` (`["text"]`), `top_logprobs` (0).
* anything else: 400 `unsupported field '<name>'`.

What this module deliberately does not do: render, sample, or decide sampling overrides
(`capture.py` does, from `ProxyConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from harnessrl.engine.chat import Message, normalize_messages, normalize_tools
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
    """A validated chat-completions request (agent's values, before the run's overrides). Not
    frozen: one is built per call, and a frozen dataclass's `__init__` costs ~6x a plain one's;
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


MAX_JSON_DEPTH = 64
"""Default nesting limit of request bodies (objects and arrays; the body itself is level 1).
Real agent bodies nest under 20 levels; the JSON encoders that later write the trace stop at
255 levels, so a body must be refused long before that (DESIGN.md §4)."""


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
    if raw.count(b"{") + raw.count(b"[") > max_depth and json_depth(body, max_depth) > max_depth:
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


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate a chat-completions body.

    Raises:
        RequestError: a field has the wrong type, is unsupported, or asks for something
            the proxy cannot honour; `param` names it.
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
    return ChatRequest(
        model=model,
        messages=normalize_messages(body.get("messages")),
        tools=_tools(body),
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=_opt_float(body, "temperature", 0.0, 2.0),
        top_p=_opt_float(body, "top_p", 0.0, 1.0),
        top_k=_top_k(body),
        seed=_seed(body),
        stop=_stop(body.get("stop")),
        logprobs=_opt(body, "logprobs", bool) or False,
    )


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


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise RequestError("'stop' must be a string or an array of strings", param="stop")

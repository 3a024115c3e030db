"""Chat messages as the chat layer takes them: validated, roles normalised, content as text.

Responsibility: turn an agent's `messages` and `tools` (OpenAI chat-completions shape, content
as a string or a list of text parts) into frozen `Message` / `ToolCall` records, or raise
`RequestError` naming the offending field (`messages[3].role`, `tools[0].function.name`). The
protocol adapters (Responses, Anthropic Messages, Google) convert to this shape first, so this
is the one validation of what a model will see. Rendering and parsing are `chat/layer.py`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from harnessrl.errors import RequestError

Role = Literal["system", "user", "assistant", "tool"]

_MESSAGE_KEYS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning",
     "refusal", "annotations", "cache_control"}
)
"""Accepted message keys; `refusal`, `annotations`, `cache_control` are ignored (they do not
change what the model sees)."""
IGNORED_MESSAGE_KEYS = frozenset({"refusal", "annotations", "cache_control"})
"""The accepted message keys that change nothing the model sees (not recorded, `wire.recorded_body`)."""
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}

@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    """`call_<hex>` for parsed calls; whatever the agent sent for replayed ones."""
    name: str
    arguments: str
    """The arguments as a JSON string (OpenAI wire form)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One validated chat message (roles normalised: `developer` -> `system`)."""

    role: Role
    content: str
    """Text content; "" when the agent sent null or nothing."""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    """Replayed `reasoning_content`, if any."""


def normalize_messages(raw: object) -> list[Message]:
    """Validate OpenAI chat `messages` and convert them to `Message` records.

    Raises:
        RequestError: with `param` naming the offending field, e.g. `messages[3].content`.
    """
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    return [_normalize_message(i, m) for i, m in enumerate(raw)]


def _normalize_message(i: int, m: object) -> Message:
    # Hot path (every message of every call): the error text is built only when raised.
    if not isinstance(m, dict):
        raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
    if not _MESSAGE_KEYS.issuperset(m):
        key = next(k for k in m if k not in _MESSAGE_KEYS)
        raise RequestError(f"unsupported field messages[{i}].{key}", param=f"messages[{i}].{key}")
    raw_role = m.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise RequestError(f"messages[{i}].role={m.get('role')!r} is not one of {sorted(_ROLES)}",
                           param=f"messages[{i}].role")
    raw_calls = m.get("tool_calls")
    if raw_calls is not None and role != "assistant" and raw_calls != []:
        raise RequestError(f"messages[{i}].tool_calls is only allowed on assistant messages",
                           param=f"messages[{i}].tool_calls")
    content = m.get("content")
    if not isinstance(content, str):
        content = _content_text(content, f"messages[{i}].content", nullable=role == "assistant")
    reasoning = m["reasoning_content"] if "reasoning_content" in m else m.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RequestError(f"messages[{i}].reasoning_content must be a string", param=f"messages[{i}].reasoning_content")
    tool_call_id, name = m.get("tool_call_id"), m.get("name")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise RequestError(f"messages[{i}].tool_call_id must be a string", param=f"messages[{i}].tool_call_id")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"messages[{i}].name must be a string", param=f"messages[{i}].name")
    # positional: role, content, tool_calls, tool_call_id, name, reasoning
    return Message(role, content,  # type: ignore[arg-type]
                   () if raw_calls is None else _normalize_tool_calls(raw_calls, f"messages[{i}].tool_calls"),
                   tool_call_id, name, reasoning or None)


def _content_text(content: object, where: str, *, nullable: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if nullable:
            return ""
        raise RequestError(f"{where} must not be null for this role", param=where)
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or an array of text parts", param=where)
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}[{j}].type={kind!r} is not supported (text parts only)",
                               param=f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _normalize_tool_calls(raw: object, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError(f"{where} must be an array", param=where)
    calls: list[ToolCall] = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}[{j}].function.name must be a string", param=f"{where}[{j}].function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise RequestError(f"{where}[{j}].function.arguments must be a JSON string",
                               param=f"{where}[{j}].function.arguments")
        call_id = call.get("id")
        calls.append(ToolCall(id=call_id if isinstance(call_id, str) else "", name=fn["name"], arguments=args))
    return tuple(calls)


def normalize_tools(raw: object) -> list[dict[str, Any]]:
    """Validate OpenAI `tools` (function tools only); returns them unchanged.

    Raises:
        RequestError: `tools`, `tools[i].type` or `tools[i].function.name` is malformed.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("'tools' must be an array", param="tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(f"tools[{i}].type={kind!r} is not supported (function tools only)",
                               param=f"tools[{i}].type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}].function.name must be a string", param=f"tools[{i}].function.name")
    return raw

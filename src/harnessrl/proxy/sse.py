"""SSE synthesis for chat completions: a standard stream built from the complete result.

The engine is always called non-streaming (DESIGN.md §4), so ids stay complete; a stream
is synthesised from the unary body: a role chunk, one reasoning delta (if any), one content
delta (with logprobs when they were asked for), one delta per tool call (with `index`, `id`,
`type`, `name`, full `arguments`), a final chunk with `finish_reason`, a usage chunk with
empty `choices` when `stream_options.include_usage` was set, then `data: [DONE]`.
Failures after the stream started are an SSE `data: {"error": ...}` event followed by
`[DONE]`: a stream never just closes (pitfall: opencode loops, pi accepts partial text).

What this module deliberately does not do: chunk text token by token (agents gain nothing
from it here; the result is complete before the first content byte).
"""

from __future__ import annotations

from typing import Any

from harnessrl.proxy.wire import dumps

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


def event(obj: object) -> bytes:
    """One SSE `data:` event."""
    return b"data: " + dumps(obj) + b"\n\n"


def role_chunk(response_id: str, created: int, model: str) -> bytes:
    """The first chunk (sent before generation so clients see the stream open)."""
    return event(_chunk(response_id, created, model, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]))


def body_chunks(response_id: str, body: dict[str, Any], include_usage: bool) -> list[bytes]:
    """Every chunk after the role chunk, from a unary chat.completion `body`, ending in [DONE].

    `response_id` is the id the role chunk used (the stream's chunks all share one id).
    """
    created, model = body["created"], body["model"]
    choice = body["choices"][0]
    message = choice["message"]
    deltas: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        deltas.append({"delta": {"reasoning_content": message["reasoning_content"]}})
    if message.get("content"):
        deltas.append({"delta": {"content": message["content"]}, "logprobs": choice.get("logprobs")})
    for i, call in enumerate(message.get("tool_calls") or []):
        deltas.append({"delta": {"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                 "function": call["function"]}]}})
    out = [
        event(_chunk(response_id, created, model, [{"index": 0, "logprobs": None, "finish_reason": None} | d]))
        for d in deltas
    ]
    out.append(event(_chunk(response_id, created, model,
                            [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
                             | ({"stop_reason": choice["stop_reason"]} if "stop_reason" in choice else {})])))
    if include_usage:
        out.append(event(_chunk(response_id, created, model, [], usage=body["usage"])))
    out.append(DONE)
    return out


def error_events(error: dict[str, Any]) -> list[bytes]:
    """An SSE error event (`error` is an OpenAI-style error body) followed by [DONE]."""
    return [event(error), DONE]


def _chunk(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
           usage: dict[str, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk

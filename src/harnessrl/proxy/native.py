"""Serving a non-chat protocol (Responses API, Anthropic Messages) through the one capture path.

Responsibility: the glue protocol modules share. A protocol module converts its request body
into a chat-completions body (`Converted`) and describes the call as a `capture.Origin`
(its protocol, body as received, extra headers, and how to render the chat result in its own
words); this module runs the converted body through `capture.prepare_chat` /
`capture.generate_chat`, the same validation, rendering, sampling enforcement, engine call
and recording as `POST /v1/chat/completions`. Capture builds the protocol-neutral turn once
(`request` = the converted body, `reply` = the parse, `raw_request` / `raw_response` = the
protocol's bodies; see `capture`'s module docstring); nothing here rewrites it.

Invariants:
  * Every call is one recorded turn, whatever fails: conversion errors are recorded here as
    `status="error"` turns with `request={}` (they never reach the chat layer), later
    failures by `capture`.
  * The recorded ids are the engine's (`capture` owns that).
  * A streamed generation runs as a task that survives a client disconnect, so the turn is
    recorded even when nobody reads the result.

What this module deliberately does not do: know any protocol's field names or event forms.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from harnessrl.errors import RequestError
from harnessrl.proxy.capture import (RECORDED_HEADERS, CaptureDeps, ChatOutcome, Origin, PreparedChat,
                                     generate_chat, prepare_chat, recorded_headers, request_kind, summarize_body)
from harnessrl.proxy.sessions import Session
from harnessrl.types import Turn

_inflight: set[asyncio.Task[ChatOutcome]] = set()
"""Streamed generations in flight (kept referenced until done)."""


@dataclass(frozen=True, slots=True)
class Converted:
    """A protocol request translated for the chat layer."""

    chat_body: dict[str, Any]
    """An OpenAI chat-completions body (always `stream: false`; the protocol streams itself)."""
    notes: tuple[str, ...] = ()
    """What the translation dropped that the request shows (e.g. hosted tools), for the trace."""


@dataclass(frozen=True, slots=True)
class Call:
    """One protocol call on its way through capture."""

    session: Session
    origin: Origin
    """What the turn records of the protocol (`capture.Origin`)."""

    @property
    def body(self) -> dict[str, Any]:
        """The request body as received."""
        return self.origin.body


def kept_headers(headers: Mapping[str, str], extra: tuple[str, ...]) -> dict[str, str]:
    """The headers recorded on a turn: `capture.RECORDED_HEADERS` plus `extra` (lower-case names),
    each cut to `capture.RECORDED_HEADER_CHARS`."""
    return recorded_headers(headers, (*RECORDED_HEADERS, *extra))


def record_rejected(session: Session, protocol: str, body: dict[str, Any], headers: dict[str, str],
                    exc: RequestError) -> Turn:
    """Record a call whose conversion failed as an error turn (no generation happened): no
    neutral request (`{}`), the body kept as `raw_request` (at most `REJECTED_BODY_CHARS`)."""
    turn = Turn(turn_index=session.reserve_turn_index(), protocol=protocol, request={},
                raw_request=summarize_body(body), status="error", error=str(exc), headers=headers,
                request_kind=request_kind(headers))
    session.record(turn)
    return turn


async def prepare(call: Call, deps: CaptureDeps, converted: Converted,
                  headers: Mapping[str, str]) -> PreparedChat | ChatOutcome:
    """`capture.prepare_chat` on the converted body, with the call's origin."""
    return await prepare_chat(deps, call.session, converted.chat_body, headers, call.origin)


async def generate(call: Call, deps: CaptureDeps, prepared: PreparedChat) -> ChatOutcome:
    """`capture.generate_chat` (the origin rides on `prepared`); a 200 outcome carries the
    protocol's body in `protocol_body`."""
    return await generate_chat(deps, prepared)


async def generate_with_keepalive(call: Call, deps: CaptureDeps, prepared: PreparedChat,
                                  keepalive_s: float) -> AsyncIterator[ChatOutcome | None]:
    """Generate in a task; yield None every `keepalive_s` while it runs, then the outcome. A
    consumer that stops early (the client went away) cancels the generation."""
    task = asyncio.ensure_future(generate(call, deps, prepared))
    _inflight.add(task)
    task.add_done_callback(_inflight.discard)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=keepalive_s)
            if not task.done():
                yield None
    finally:
        if not task.done():
            task.cancel()
    yield task.result()


def now_s() -> int:
    """Unix time in whole seconds (the `created_at` of protocol bodies)."""
    return int(time.time())

"""Serving a non-chat protocol (Responses API, Anthropic Messages) through the one capture path.

Responsibility: the glue both protocol modules share. A protocol module converts its request
body into a chat-completions body (`Converted`); this module runs that body through
`capture.prepare_chat` / `capture.generate_chat`, the same validation, rendering, sampling
enforcement, engine call and recording as `POST /v1/chat/completions`, and then restamps the
recorded turn with what the agent actually sent and got:
`Turn.protocol` (`responses` / `messages`), `Turn.request` (the body as received; an error
turn keeps at most `capture.REJECTED_BODY_CHARS` of it),
`Turn.response` (the protocol's own body), `Turn.notes` (what conversion dropped) and the
protocol's extra headers.

Invariants:
  * Every call is one recorded turn, whatever fails: conversion errors are recorded here as
    `status="error"` turns (they never reach the chat layer), later failures by `capture`.
  * The recorded ids are the engine's (`capture` owns that); restamping touches only the
    fields named above, in the same event-loop step as the recording (no await between).
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
from harnessrl.proxy.capture import (RECORDED_HEADERS, CaptureDeps, ChatOutcome, PreparedChat, generate_chat,
                                     prepare_chat, request_kind, summarize_body)
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
    protocol: str
    """`responses` or `messages` (`Turn.protocol`)."""
    body: dict[str, Any]
    """The request body as received."""
    headers: dict[str, str]
    """Protocol-specific headers of interest (added to `Turn.headers`)."""
    notes: tuple[str, ...]


def kept_headers(headers: Mapping[str, str], extra: tuple[str, ...]) -> dict[str, str]:
    """The headers recorded on a turn: `capture.RECORDED_HEADERS` plus `extra` (lower-case names)."""
    return {k: v for k in (*RECORDED_HEADERS, *extra) if (v := headers.get(k)) is not None}


def record_rejected(session: Session, protocol: str, body: dict[str, Any], headers: dict[str, str],
                    exc: RequestError) -> Turn:
    """Record a call whose conversion failed as an error turn (no generation happened)."""
    turn = Turn(turn_index=session.reserve_turn_index(), protocol=protocol, request=summarize_body(body),
                status="error", error=str(exc), headers=headers, request_kind=request_kind(headers))
    session.record(turn)
    return turn


async def prepare(call: Call, deps: CaptureDeps, converted: Converted,
                  headers: Mapping[str, str]) -> PreparedChat | ChatOutcome:
    """`capture.prepare_chat` on the converted body; a 4xx outcome comes back restamped."""
    prepared = await prepare_chat(deps, call.session, converted.chat_body, headers)
    if isinstance(prepared, ChatOutcome):
        restamp(call, prepared.turn, None)
    return prepared


async def generate(call: Call, deps: CaptureDeps, prepared: PreparedChat) -> ChatOutcome:
    """`capture.generate_chat`, restamped (the caller sets `Turn.response` once it is built)."""
    outcome = await generate_chat(deps, prepared)
    restamp(call, outcome.turn, None)
    return outcome


async def generate_with_keepalive(call: Call, deps: CaptureDeps, prepared: PreparedChat,
                                  keepalive_s: float) -> AsyncIterator[ChatOutcome | None]:
    """Generate in a task; yield None every `keepalive_s` while it runs, then the outcome."""
    task = asyncio.ensure_future(generate(call, deps, prepared))
    _inflight.add(task)
    task.add_done_callback(_inflight.discard)
    while not task.done():
        await asyncio.wait({task}, timeout=keepalive_s)
        if not task.done():
            yield None
    yield task.result()


def restamp(call: Call, turn: Turn, response: dict[str, Any] | None) -> None:
    """Make a recorded turn say what the agent sent and got in its own protocol."""
    turn.protocol = call.protocol
    turn.request = summarize_body(call.body) if turn.status == "error" else call.body
    turn.headers = {**turn.headers, **call.headers}
    turn.notes = list(call.notes)
    if response is not None:
        turn.response = response


def now_s() -> int:
    """Unix time in whole seconds (the `created_at` of protocol bodies)."""
    return int(time.time())

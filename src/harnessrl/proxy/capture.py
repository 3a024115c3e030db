"""The shared capture function: validate -> render -> sampling overrides -> engine -> parse ->
record the Turn -> OpenAI chat-completions response.

Both harness kinds go through here (DESIGN.md style rule 6): the HTTP route wraps
`complete_chat` (or its two halves, `prepare_chat` then `generate_chat`, so a stream can
start before generation); the white-box loop calls `complete_chat` directly without HTTP.

Invariants:
  * The recorded `prompt_ids` / `completion_ids` / `completion_logprobs` are the engine's
    `Completion` fields, never a re-render (DESIGN.md §3.1, §9).
  * Sampling is the run's (`ProxyConfig`) when `enforce_sampling`; the values used are
    recorded in `Turn.sampling` (§3.2). `max_tokens` is capped by `sampling.max_tokens` and by the
    context left (`engine.max_context_tokens - len(prompt_ids)`).
  * Every call is recorded as one turn: bad input and engine failures with
    `status="error"` (keeping at most `REJECTED_BODY_CHARS` of the body); turns failing
    `check_turn_faithful` with `status="unfaithful"`. A call whose session closed while it
    generated is answered 401 and not recorded (`close` returned the final trace).
  * Bridged rendering: a request that extends an earlier ok turn of the session (its messages
    plus the reply the agent got) starts with that turn's exact prompt + completion ids and
    renders only its new messages (`ChatLayer.plan_prompt`); the turn notes `bridged_from=N`.
    The text returned ends where a stop string begins (the ids keep every sampled token).
  * `usage` is truthful: prompt ids consumed and completion ids sampled by the engine.
  * Bad input gives 4xx (`RequestError`), engine failures 5xx; never `choices: []`.
  * The turn is built once, here, when it is recorded, and is protocol-neutral (`types.Turn`):
    `request` is the chat body the chat layer parsed, `reply` the parsed assistant reply
    (content, tool calls, reasoning). Nothing rewrites a recorded turn.

How a protocol adapter produces a neutral turn (`responses.py`, `anthropic.py`; any new
dialect does the same, through the glue in `native.py`):
  1. Convert the protocol's request body into a chat-completions body (`stream: false`;
     messages with roles system/user/assistant/tool, function tools, `max_tokens`, ...), or
     raise `RequestError` naming the field (`native.record_rejected` records that call as an
     error turn with `request={}` and `raw_request` = the body).
  2. Describe the call as an `Origin`: the protocol's name (`Turn.protocol`), its body as
     received (`Turn.raw_request`), its extra headers, what the conversion dropped
     (`Turn.notes`), and `render`: the chat.completion body -> the protocol's own response body.
  3. Call `prepare_chat(..., origin=origin)` then `generate_chat`. Capture renders, samples,
     parses and calls `render` once, before the turn is recorded: the turn gets `request` =
     the converted body, `reply` = the parse, `raw_response` = `render`'s body, and
     `ChatOutcome.protocol_body` is that same body for the adapter to send (unary) or to
     stream as events. An error turn has no `reply` and no `raw_response`; the adapter answers
     with its protocol's error form from `ChatOutcome.body` (an OpenAI error body).

What this module deliberately does not do: HTTP framing, SSE, keys (see `app.py`, `sse.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from harnessrl.engine.base import CALL_PROGRESS, CallProgress, Engine
from harnessrl.chat.layer import ChatLayer, ParsedAssistant
from harnessrl.errors import ContextLengthError, EngineError, RequestError
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.sessions import Session
from harnessrl.proxy.wire import ChatRequest, error_body, limits_of, parse_chat_request, recorded_body
from harnessrl.types import (Completion, Reply, ReplyToolCall, Sampling, Turn, check_turn_faithful,
                             effective_temperature)

log = logging.getLogger(__name__)

RECORDED_HEADERS = ("x-session-id", "x-session-affinity", "x-stainless-retry-count", "session-id",
                    "x-codex-turn-metadata", "user-agent")
"""Headers copied into `Turn.headers` (looked up lower-case)."""
RECORDED_HEADER_CHARS = 2048
"""A recorded header value longer than this is cut (`recorded_headers`): headers are outside
`max_body_bytes` and the session's byte budget, and every turn keeps its own."""
OFFLOAD_RENDER_CHARS = 16_384
"""New (uncached) prompt text above which tokenisation runs in a worker thread."""
BRIDGE_POINTS_KEPT = 8
"""Finished turns per session a later request may bridge on (bridged rendering, `chat.py`);
the newest are kept (an agent extends its last turn; a sub-agent or retry one shortly before)."""
REJECTED_BODY_CHARS = 4096
"""An error turn keeps at most this many characters of the request's JSON (`summarize_body`):
a call that failed is never trained, and a flood of large bad calls must not fill memory."""


@dataclass(frozen=True, slots=True)
class CaptureDeps:
    engine: Engine
    chat: ChatLayer
    config: ProxyConfig


@dataclass(frozen=True, slots=True)
class Origin:
    """A call that arrived in another protocol (see the module docstring): what its turn records
    besides the neutral form."""

    protocol: str
    """`Turn.protocol`: `responses`, `messages`, ..."""
    body: dict[str, Any]
    """The protocol's request body as received (`Turn.raw_request`; bounded on error turns)."""
    headers: dict[str, str]
    """Protocol-specific headers of interest, added to `Turn.headers`."""
    notes: tuple[str, ...] = ()
    """What the conversion dropped that the request shows, first in `Turn.notes`."""
    render: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """The chat.completion body -> the protocol's response body (`Turn.raw_response`); called
    once per ok generation, before the turn is recorded. None: no raw response is kept."""


@dataclass(slots=True)
class ChatOutcome:
    """Result of one call: the status and body the agent gets, and the recorded turn. (Not
    frozen, like `PreparedChat`: one is built per call, and a frozen dataclass's `__init__`
    costs ~6x a plain one's; nothing assigns to it after.)"""

    status_code: int
    body: dict[str, Any]
    """The unary chat.completion body (200) or an OpenAI-style error body."""
    turn: Turn
    stream: bool
    """The agent asked for SSE (`sse.py` synthesises it from `body`)."""
    include_usage: bool
    protocol_body: dict[str, Any] | None = None
    """The origin's rendering of `body` (200 from a call with an `Origin.render` only); the
    same object as `turn.raw_response`."""


@dataclass(slots=True)
class PreparedChat:
    """A validated, rendered call ready for the engine (not frozen: see `ChatOutcome`)."""

    session: Session
    request: ChatRequest
    body: dict[str, Any]
    headers: dict[str, str]
    prompt_ids: list[int]
    sampling: Sampling
    turn_index: int
    started_at: float
    started_perf_s: float
    bridged_from: int | None = None
    """The earlier turn whose exact ids start the prompt (bridged rendering), if any."""
    origin: Origin | None = None
    """The protocol the call arrived in, when not chat completions."""
    final_stop: str | None = None
    """Why this call gets a final stop instead of the engine (`ProxyConfig.max_model_calls`):
    `generate_chat` answers it without sampling (`_final_stop`)."""


async def complete_chat(deps: CaptureDeps, session: Session, body: dict[str, Any],
                        headers: Mapping[str, str]) -> ChatOutcome:
    """Serve one chat-completions call for `session` and record it as a turn.

    Args:
        body: the decoded request body (kept as `Turn.request`).
        headers: request headers; a case-insensitive mapping, or a dict with lower-case keys.

    Returns:
        The outcome; `status_code` 200 with a chat.completion body, 4xx for bad input, 5xx
        when the engine failed. Never raises for the agent's input or engine faults.
    """
    prepared = await prepare_chat(deps, session, body, headers)
    if isinstance(prepared, ChatOutcome):
        return prepared
    return await generate_chat(deps, prepared)


async def prepare_chat(deps: CaptureDeps, session: Session, body: dict[str, Any],
                       headers: Mapping[str, str], origin: Origin | None = None) -> PreparedChat | ChatOutcome:
    """Validate and render; returns a recorded 4xx outcome when the input is bad.

    `body` is a chat-completions body (`Turn.request`); `origin` describes the protocol it was
    converted from, if any (module docstring).

    The template renders inline (well under a millisecond even for 60 KB). Tokenisation runs
    in a worker thread when more than `OFFLOAD_RENDER_CHARS` characters are new to the chat
    layer's per-message cache (tokenising 60 KB takes tens of ms and would stall the loop);
    otherwise inline, where a thread hop would cost more than the work.
    """
    started_at, started_perf_s = time.time(), time.perf_counter()
    turn_index = session.reserve_turn_index()
    kept = recorded_headers(headers, RECORDED_HEADERS)
    request: ChatRequest | None = None
    budget = deps.config.max_model_calls
    try:
        request = parse_chat_request(body, limits_of(deps.config))
        # neither the fields the proxy ignores nor message keys the template never renders are kept
        body = recorded_body(body, unrendered=deps.chat.unrendered_message_keys)
        if budget and turn_index >= budget:
            return PreparedChat(session, request, body, kept, [], Sampling(max_tokens=1), turn_index, started_at,
                                started_perf_s, None, origin, final_stop=f"max_model_calls={budget} reached")
        plan = deps.chat.plan_prompt(request.messages, request.tools, session.bridge_points)
        if len(plan.text) > OFFLOAD_RENDER_CHARS:  # far past the context: refused untokenised
            floor = len(plan.head_ids) + deps.chat.min_tokens(plan.text)
            if floor >= deps.engine.max_context_tokens:
                raise RequestError(
                    f"the prompt has at least {floor} tokens ({len(plan.text)} characters) and the context limit "
                    f"is {deps.engine.max_context_tokens} tokens (max_context_tokens), which leaves no room for "
                    f"a completion", param="messages", code="context_length_exceeded")
        prompt_ids = deps.chat.encode_within(plan.text, OFFLOAD_RENDER_CHARS)
        if prompt_ids is None:
            prompt_ids = await asyncio.to_thread(deps.chat.encode, plan.text)
        if plan.head_ids:
            prompt_ids = plan.head_ids + prompt_ids
        sampling = resolve_sampling(deps.config, request, len(prompt_ids), deps.engine.max_context_tokens)
    except RequestError as exc:
        if request is not None:  # refused after rendering: the render of a refused call is not kept
            deps.chat.discard_render(request.messages, request.tools)
        if budget and request is not None and exc.code == "context_length_exceeded":
            return PreparedChat(session, request, body, kept, [], Sampling(max_tokens=1), turn_index, started_at,
                                started_perf_s, None, origin, final_stop=f"context exhausted: {exc}")
        turn = _error_turn(session, turn_index, body, kept, started_at, started_perf_s, str(exc), origin)
        return ChatOutcome(exc.status_code, error_body(exc.message, param=exc.param, code=exc.code), turn,
                           stream=body.get("stream") is True, include_usage=False)
    except Exception as exc:  # noqa: BLE001 - a proxy bug is still one recorded turn and a JSON answer
        log.exception("proxy failed preparing session %s turn %d", session.session_id, turn_index)
        msg = f"internal proxy error: {type(exc).__name__}: {exc}"
        turn = _error_turn(session, turn_index, body, kept, started_at, started_perf_s, msg, origin)
        return ChatOutcome(500, error_body(msg, type_="server_error", code="internal_error"), turn,
                           stream=body.get("stream") is True, include_usage=False)
    return PreparedChat(session, request, body, kept, prompt_ids, sampling, turn_index, started_at, started_perf_s,
                        plan.bridged_from, origin)


async def generate_chat(deps: CaptureDeps, p: PreparedChat) -> ChatOutcome:
    """Run the engine on a prepared call, parse, record, and build the response."""
    if p.final_stop is not None:
        return _final_stop(deps, p.session, p.turn_index, p.body, p.request, p.headers, p.started_at,
                           p.started_perf_s, p.origin, p.final_stop)
    progress = CallProgress(len(p.prompt_ids), p.started_perf_s)
    p.session.engine_calls[p.turn_index] = progress  # what a close meanwhile reports (`Trace.in_flight`)
    current = CALL_PROGRESS.set(progress)
    try:
        completion = await deps.engine.generate(p.prompt_ids, p.sampling, affinity=p.session.session_id,
                                                cache_scope=p.session.cache_scope)
    except asyncio.CancelledError:  # the client went away mid-stream (`app._stream`): recorded, not trained
        p.session.cut_off_call(p.turn_index)
        _failed(p, 499, error_body("cancelled", code="cancelled"),
                "the call was cancelled while it generated (its client went away); its generation was stopped")
        raise
    except ContextLengthError as exc:
        if deps.config.max_model_calls:
            return _final_stop(deps, p.session, p.turn_index, p.body, p.request, p.headers, p.started_at,
                               p.started_perf_s, p.origin, f"context exhausted: {exc}", p.prompt_ids, p.sampling)
        return _failed(p, 400, error_body(str(exc), param="messages", code="context_length_exceeded"), str(exc))
    except EngineError as exc:
        msg = f"engine error: {exc}"
        return _failed(p, 503, error_body(msg, type_="server_error", code="engine_error"), msg)
    except Exception as exc:  # noqa: BLE001 - any engine fault is recorded and answered, never dropped
        log.exception("engine failed on session %s turn %d", p.session.session_id, p.turn_index)
        msg = f"engine failed: {type(exc).__name__}: {exc}"
        return _failed(p, 500, error_body(msg, type_="server_error", code="engine_error"), msg)
    finally:
        CALL_PROGRESS.reset(current)
        p.session.engine_calls.pop(p.turn_index, None)
    try:
        parsed = deps.chat.parse(completion.completion_ids, bool(p.request.tools),
                                 call_id_seed=f"{p.session.session_id}:{p.turn_index}", stop=p.sampling.stop)
        response = build_response(deps, p.request, completion, parsed)
        origin = p.origin
        protocol_body = origin.render(response) if origin is not None and origin.render is not None else None
    except Exception as exc:  # noqa: BLE001 - a proxy bug is still one recorded turn and a JSON answer
        log.exception("proxy failed building the reply of session %s turn %d", p.session.session_id, p.turn_index)
        msg = f"internal proxy error: {type(exc).__name__}: {exc}"
        return _failed(p, 500, error_body(msg, type_="server_error", code="internal_error"), msg)
    notes = [] if p.bridged_from is None else [f"bridged_from={p.bridged_from}"]
    if completion.straddled:
        notes.append(f"straddled_update: sent under policy_version={completion.policy_version}")
    turn = Turn.model_construct(
        turn_index=p.turn_index, protocol="chat.completions" if origin is None else origin.protocol,
        request=p.body, reply=reply_of(parsed),
        raw_request=None if origin is None else origin.body, raw_response=protocol_body,
        prompt_ids=list(completion.prompt_ids), completion_ids=list(completion.completion_ids),
        completion_logprobs=list(completion.completion_logprobs), sampling=p.sampling,
        policy_version=completion.policy_version, finish_reason=response["choices"][0]["finish_reason"],
        status="ok", error=None, started_at=p.started_at, latency_s=time.perf_counter() - p.started_perf_s,
        headers=p.headers if origin is None else {**p.headers, **origin.headers},
        request_kind=request_kind(p.headers), usage=response["usage"],
        notes=notes if origin is None else [*origin.notes, *notes],
    )
    reason = check_turn_faithful(turn)
    if reason is not None:
        turn.status, turn.error = "unfaithful", reason
    if not p.session.record(turn):
        return _closed_meanwhile(p, turn)
    if turn.status == "ok":
        points = p.session.bridge_points
        points.append(deps.chat.bridge_point(p.turn_index, p.request.messages, p.request.tools, parsed,
                                             completion.prompt_ids, completion.completion_ids))
        del points[:-BRIDGE_POINTS_KEPT]
    return ChatOutcome(200, response, turn, stream=p.request.stream, include_usage=p.request.include_usage,
                       protocol_body=protocol_body)


def resolve_sampling(config: ProxyConfig, request: ChatRequest, prompt_tokens: int,
                     max_context_tokens: int) -> Sampling:
    """The sampling actually used: the run's values when `enforce_sampling`, and
    `max_tokens = min(sampling.max_tokens, agent's max_tokens, context left)`. A positive
    temperature below `types.MIN_TEMPERATURE` is raised to it (and recorded so).

    Raises:
        RequestError: the prompt leaves no room for a completion (code
            `context_length_exceeded`, the message gives both numbers).
    """
    left = max_context_tokens - prompt_tokens
    if left < 1:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens and the context limit is {max_context_tokens} tokens "
            f"(max_context_tokens), which leaves no room for a completion",
            param="messages", code="context_length_exceeded")
    run = config.sampling
    max_tokens = min(run.max_tokens, left, request.max_tokens or run.max_tokens)
    if config.enforce_sampling:
        return _sampling(effective_temperature(run.temperature), run.top_p, run.top_k, max_tokens, request.stop, None)
    return _sampling(
        effective_temperature(run.temperature if request.temperature is None else request.temperature),
        run.top_p if request.top_p is None or request.top_p == 0.0 else request.top_p,
        run.top_k if request.top_k is None else request.top_k,
        max_tokens, request.stop, request.seed,
    )


@functools.lru_cache(maxsize=4096, typed=True)
def _sampling(temperature: float, top_p: float, top_k: int, max_tokens: int, stop: tuple[str, ...],
              seed: int | None) -> Sampling:
    """The validated `Sampling` of these values, one shared instance per distinct set (it is
    frozen, so turns may share it; an agent's calls mostly differ only in the context left)."""
    return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, stop=stop, seed=seed)


def build_response(deps: CaptureDeps, request: ChatRequest, completion: Completion,
                   parsed: ParsedAssistant) -> dict[str, Any]:
    """The unary OpenAI chat.completion body. `finish_reason`: `length` when truncated (even
    with parsed tool calls), `tool_calls` when calls were parsed, else `stop`; when one of the
    request's stop strings ended the text (and the reply was not truncated), the choice also
    carries `stop_reason` = that string, as vLLM's server does (the Messages route reports it
    as `stop_sequence`)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if completion.finish_reason == "length":
        finish = "length"
    else:
        finish = "tool_calls" if parsed.tool_calls else "stop"
    n_prompt, n_completion = len(completion.prompt_ids), len(completion.completion_ids)
    choice = {"index": 0, "message": message, "finish_reason": finish,
              "logprobs": _logprobs(deps.chat, completion) if request.logprobs else None}
    if parsed.stop_sequence is not None and finish != "length":
        choice["stop_reason"] = parsed.stop_sequence
    return {
        "id": completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or deps.config.model_name,
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                  "total_tokens": n_prompt + n_completion},
    }


def completion_id() -> str:
    """`chatcmpl-` + 24 random hex digits."""
    return "chatcmpl-" + secrets.token_hex(12)


def reply_of(parsed: ParsedAssistant) -> Reply:
    """The neutral `Turn.reply` of a parse (the same values the chat.completion body carries)."""
    return Reply.model_construct(
        content=parsed.content, reasoning=parsed.reasoning,
        tool_calls=[ReplyToolCall.model_construct(id=c.id, name=c.name, arguments=c.arguments)
                    for c in parsed.tool_calls])


def _logprobs(chat: ChatLayer, completion: Completion) -> dict[str, Any]:
    """OpenAI-format logprobs: one entry per sampled id, with its token string and bytes."""
    strings = chat.token_strings(completion.completion_ids)
    return {"content": [
        {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
        for s, lp in zip(strings, completion.completion_logprobs, strict=True)
    ]}


def recorded_headers(headers: Mapping[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """The headers of `names` a turn records, each value cut to `RECORDED_HEADER_CHARS`
    characters (then ending `…[N chars]`, N its length)."""
    kept: dict[str, str] = {}
    for name in names:
        value = headers.get(name)
        if value is not None:
            kept[name] = value if len(value) <= RECORDED_HEADER_CHARS else \
                f"{value[:RECORDED_HEADER_CHARS]}…[{len(value)} chars]"
    return kept


def request_kind(headers: Mapping[str, str]) -> str | None:
    """What the agent's headers say the call is: `request_kind` of `x-codex-turn-metadata`."""
    meta = headers.get("x-codex-turn-metadata")
    if meta is None:
        return None
    try:
        kind = orjson.loads(meta).get("request_kind")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def summarize_body(body: dict[str, Any], limit: int = REJECTED_BODY_CHARS) -> dict[str, Any]:
    """What an error turn keeps of a request body: the body itself when its JSON has at most
    `limit` characters, else `{"truncated_body": <its first limit characters>, "body_bytes": N}`."""
    try:
        raw = orjson.dumps(body, default=repr)
    except TypeError as exc:  # nested past orjson's limit (a caller that skipped `wire.loads`)
        return {"truncated_body": f"<not serialisable: {exc}>", "body_bytes": -1}
    if len(raw) <= limit:
        return body
    return {"truncated_body": raw[:limit].decode("utf-8", "ignore"), "body_bytes": len(raw)}


def _failed(p: PreparedChat, status: int, body: dict[str, Any], error: str) -> ChatOutcome:
    turn = _error_turn(p.session, p.turn_index, p.body, p.headers, p.started_at, p.started_perf_s, error,
                       p.origin, prompt_ids=p.prompt_ids, sampling=p.sampling)
    if p.session.revoked:
        return _closed_meanwhile(p, turn)
    return ChatOutcome(status, body, turn, stream=p.request.stream, include_usage=p.request.include_usage)


def _final_stop(deps: CaptureDeps, session: Session, turn_index: int, body: dict[str, Any], request: ChatRequest,
                headers: dict[str, str], started_at: float, started_perf_s: float, origin: Origin | None, why: str,
                prompt_ids: list[int] | None = None, sampling: Sampling | None = None) -> ChatOutcome:
    """The reply that ends an agent's loop once its call budget or its context is spent
    (`ProxyConfig.max_model_calls`): a 200 assistant message with empty text, no tool call and
    finish_reason `stop`, in the call's own protocol (the origin renders it) and as a stream
    when one was asked for. Recorded as an `error` turn with no sampled ids (never trained),
    noted `final_stop: <why>`."""
    response = {
        "id": completion_id(), "object": "chat.completion", "created": int(time.time()),
        "model": request.model or deps.config.model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop",
                     "logprobs": None}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
    protocol_body = origin.render(response) if origin is not None and origin.render is not None else None
    turn = _error_turn(session, turn_index, body, headers, started_at, started_perf_s, f"final stop sent: {why}",
                       origin, prompt_ids=prompt_ids, sampling=sampling)
    turn.notes.append(f"final_stop: {why}")
    turn.raw_response = protocol_body
    return ChatOutcome(200, response, turn, stream=request.stream, include_usage=request.include_usage,
                       protocol_body=protocol_body)


def _closed_meanwhile(p: PreparedChat, turn: Turn) -> ChatOutcome:
    """The session closed while its call generated: the turn is not on the (final) trace."""
    msg = "the session was closed while this call was in flight; its result was dropped"
    return ChatOutcome(401, error_body(msg, code="invalid_api_key"), turn, stream=p.request.stream,
                       include_usage=p.request.include_usage)


def _error_turn(session: Session, turn_index: int, body: dict[str, Any], headers: dict[str, str],
                started_at: float, started_perf_s: float, error: str, origin: Origin | None,
                prompt_ids: list[int] | None = None, sampling: Sampling | None = None) -> Turn:
    if origin is not None:
        headers = {**headers, **origin.headers}
    turn = Turn.model_construct(
        turn_index=turn_index, protocol="chat.completions" if origin is None else origin.protocol,
        request=summarize_body(body), reply=None,
        raw_request=None if origin is None else summarize_body(origin.body), raw_response=None,
        prompt_ids=list(prompt_ids or ()), completion_ids=[], completion_logprobs=[], sampling=sampling,
        policy_version=-1, finish_reason=None, status="error", error=error, started_at=started_at,
        latency_s=time.perf_counter() - started_perf_s, headers=headers, request_kind=request_kind(headers),
        usage={}, notes=[] if origin is None else list(origin.notes))
    session.record(turn)
    return turn

"""`make_app(deps)`: the proxy's Starlette app (one server, one port, all rollouts).

Routes:
  * `GET /healthz`.
  * Admin, loopback clients only (others get 403): `POST /admin/sessions` (optional body
    `{"rollout_id": ...}`) -> `{session_id, key, base_url, keyed_base_url}`;
    `GET /admin/sessions/{id}/trace`; `DELETE /admin/sessions/{id}` (revokes the key,
    returns the final trace).
  * Protocol routes, each served at `/v1/<sub>` (key in `Authorization: Bearer <key>` or
    `x-api-key`) and at `/r/<key>/v1/<sub>` (key in the path): `chat/completions` (POST),
    `models` (GET), plus any handler passed in `protocols` (how `/v1/responses` and
    `/v1/messages` plug in: a `ProtocolHandler` gets the request, the session its key
    addresses, and the deps; `read_json` and `json_response` are the shared helpers).

Invariants: an unknown or revoked key gets 401 with an OpenAI-style body, and a revoked
key's call is counted on its trace; bodies above `max_body_bytes` get 413; malformed bodies
400 naming the problem (these two are answered before a turn exists and are not recorded);
every error body is `{"error": {message, type, param, code}}`, including 404/405. The
proxy's own code never answers 5xx to bad input.

What this module deliberately does not do: validate fields, render or record (see
`capture.py`), or run a server (`server.py`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from harnessrl.errors import RequestError
from harnessrl.proxy import sse
from harnessrl.proxy.capture import CaptureDeps, ChatOutcome, PreparedChat, generate_chat, prepare_chat
from harnessrl.proxy.sessions import Session, SessionStore
from harnessrl.proxy.wire import dumps, error_body, loads

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True, slots=True)
class ProxyDeps:
    capture: CaptureDeps
    store: SessionStore


ProtocolHandler = Callable[[Request, Session, ProxyDeps], Awaitable[Response]]
"""Serves one protocol route for an authenticated session; may raise `RequestError`."""

_inflight: set[asyncio.Task[ChatOutcome]] = set()
"""Streamed generations run as tasks so a client disconnect never loses the turn."""


def make_app(deps: ProxyDeps, protocols: Mapping[str, ProtocolHandler] | None = None) -> Starlette:
    """Build the app. `protocols` maps extra POST sub-paths under `/v1/` to handlers."""
    routes = [
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/admin/sessions", _admin(deps, _open_session), methods=["POST"]),
        Route("/admin/sessions/{session_id}/trace", _admin(deps, _get_trace), methods=["GET"]),
        Route("/admin/sessions/{session_id}", _admin(deps, _close_session), methods=["DELETE"]),
    ]
    handlers: list[tuple[str, ProtocolHandler, str]] = [("chat/completions", chat_completions, "POST"),
                                                        ("models", list_models, "GET")]
    handlers += [(sub, h, "POST") for sub, h in (protocols or {}).items()]
    for sub, handler, method in handlers:
        endpoint = _keyed(deps, handler)
        routes.append(Route(f"/v1/{sub}", endpoint, methods=[method]))
        routes.append(Route(f"/r/{{key}}/v1/{sub}", endpoint, methods=[method]))
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


def json_response(status_code: int, body: object) -> Response:
    return Response(content=dumps(body), status_code=status_code, media_type="application/json")


async def read_json(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """Read and decode a JSON object body.

    Raises:
        RequestError: 413 when the body exceeds `max_body_bytes`, 400 when it is not a JSON
            object or the client went away.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(int(declared), max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise _too_large(size, max_body_bytes)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise RequestError("client disconnected while sending the body") from exc
    return loads(b"".join(chunks))


def session_key(request: Request) -> str | None:
    """The session key: path `/r/<key>/...`, else `Authorization: Bearer`, else `x-api-key`."""
    key = request.path_params.get("key")
    if key:
        return key
    auth = request.headers.get("authorization")
    if auth is not None and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


async def chat_completions(request: Request, session: Session, deps: ProxyDeps) -> Response:
    """`POST /v1/chat/completions`: unary JSON, or SSE synthesised from the complete result."""
    body = await read_json(request, deps.capture.config.max_body_bytes)
    prepared = await prepare_chat(deps.capture, session, body, request.headers)
    if isinstance(prepared, ChatOutcome):
        return json_response(prepared.status_code, prepared.body)
    if not prepared.request.stream:
        outcome = await generate_chat(deps.capture, prepared)
        return json_response(outcome.status_code, outcome.body)
    return StreamingResponse(_stream(deps, prepared), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


async def _stream(deps: ProxyDeps, prepared: PreparedChat) -> AsyncIterator[bytes]:
    response_id = "chatcmpl-" + secrets.token_hex(12)
    yield sse.role_chunk(response_id, int(time.time()), prepared.request.model or deps.capture.config.model_name)
    task = asyncio.ensure_future(generate_chat(deps.capture, prepared))
    _inflight.add(task)
    task.add_done_callback(_inflight.discard)
    while not task.done():
        await asyncio.wait({task}, timeout=deps.capture.config.stream_keepalive_s)
        if not task.done():
            yield sse.KEEPALIVE
    outcome = task.result()
    if outcome.status_code == 200:
        chunks = sse.body_chunks(response_id, outcome.body, outcome.include_usage)
    else:
        chunks = sse.error_events(outcome.body)
    for chunk in chunks:
        yield chunk


async def list_models(request: Request, session: Session, deps: ProxyDeps) -> Response:
    """`GET /v1/models`: the one model this proxy serves."""
    model = {"id": deps.capture.config.model_name, "object": "model", "created": 0, "owned_by": "harnessrl"}
    return json_response(200, {"object": "list", "data": [model]})


def _keyed(deps: ProxyDeps, handler: ProtocolHandler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        key = session_key(request)
        session = deps.store.lookup(key) if key else None
        if session is None:
            return json_response(401, error_body("unknown or revoked API key", param=None, code="invalid_api_key"))
        try:
            return await handler(request, session, deps)
        except RequestError as exc:
            return json_response(exc.status_code, error_body(exc.message, param=exc.param, code=exc.code))
    return endpoint


def _admin(deps: ProxyDeps, handler: Callable[[Request, ProxyDeps], Awaitable[Response]]
           ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        host = request.client.host if request.client is not None else None
        if host not in _LOOPBACK:
            return json_response(403, error_body(f"admin routes are loopback-only (client {host})",
                                                 code="forbidden"))
        try:
            return await handler(request, deps)
        except RequestError as exc:
            return json_response(exc.status_code, error_body(exc.message, param=exc.param, code=exc.code))
    return endpoint


async def _open_session(request: Request, deps: ProxyDeps) -> Response:
    raw = await request.body()
    body = loads(raw) if raw.strip() else {}
    rollout_id = body.get("rollout_id")
    if rollout_id is not None and not isinstance(rollout_id, str):
        raise RequestError("'rollout_id' must be a string", param="rollout_id")
    session = deps.store.open(rollout_id)
    root = f"{request.url.scheme}://{request.url.netloc}"
    return json_response(200, {"session_id": session.session_id, "key": session.key, "base_url": root + "/v1",
                               "keyed_base_url": f"{root}/r/{session.key}/v1"})


def _find(deps: ProxyDeps, request: Request) -> Session:
    session_id = request.path_params["session_id"]
    session = deps.store.get(session_id)
    if session is None:
        raise RequestError(f"no session {session_id!r}", param="session_id", code="not_found", status_code=404)
    return session


async def _get_trace(request: Request, deps: ProxyDeps) -> Response:
    session = _find(deps, request)
    return Response(session.trace.model_dump_json(), media_type="application/json")


async def _close_session(request: Request, deps: ProxyDeps) -> Response:
    trace = deps.store.close(_find(deps, request).session_id)
    return Response(trace.model_dump_json(), media_type="application/json")


async def _healthz(request: Request) -> Response:
    return json_response(200, {"ok": True})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException), f"unexpected {type(exc).__name__}"
    return json_response(exc.status_code, error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                                     code=str(exc.status_code)))


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(f"request body of {size} bytes exceeds max_body_bytes={limit}",
                        code="request_too_large", status_code=413)

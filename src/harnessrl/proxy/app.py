"""`make_app(deps)`: the proxy's Starlette app (one server, one port, all rollouts).

Routes:
  * `GET /healthz`.
  * Admin, in a separate app (`make_admin_app`) that the server puts on its own listener,
    never on the agents' port; every call needs `Authorization: Bearer <admin token>` (401
    otherwise) and bodies above `ADMIN_MAX_BODY_BYTES` get 413: `POST /admin/sessions`
    (optional body `{"rollout_id": ...}`) -> `{session_id, key, base_url, keyed_base_url}`;
    `GET /admin/sessions/{id}/trace`; `DELETE /admin/sessions/{id}` (revokes the key,
    returns the final trace).
  * Protocol routes, each served at `/v1/<sub>` (key in `Authorization: Bearer <key>` or
    `x-api-key`) and at `/r/<key>/v1/<sub>` (key in the path): `chat/completions` (POST),
    `models` (GET), plus any handler passed in `protocols` (how `/v1/responses`,
    `/v1/messages` and Google's `/v1beta/models/{target}` plug in; a sub-path with a leading
    `/` is served at that path instead of under `/v1`: a `ProtocolHandler` gets the request, the session its key
    addresses, and the deps; `read_session_json` (the body, charged to the session) and
    `json_response` are the shared helpers).
  * The hot path: a server hands agents' POSTs to an exact path (no `/r/<key>` prefix) to
    `serve_post`, which runs the route's endpoint without Starlette's middleware and router
    (the same endpoint, so the same bytes and turns).

Invariants: an unknown or revoked key gets 401 with an OpenAI-style body, and a revoked
key's call is counted on its trace; bodies above `max_body_bytes` get 413; malformed bodies
and bodies nested deeper than `max_json_depth` 400 naming the problem (these are answered
before a turn exists and are not recorded); every error body is `{"error": {message, type,
param, code}}`, including 404/405. The proxy's own code never answers 5xx to bad input; a
bug in it is logged and answered with a JSON 500 (`code: internal_error`), never a bare one.
A closed session's trace is served from the trace file (`SessionStore.trace_json`).

What this module deliberately does not do: validate fields, render or record (see
`capture.py`), or run a server (`server.py`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from harnessrl.errors import RequestError
from harnessrl.proxy import sse
from harnessrl.proxy.capture import (CaptureDeps, ChatOutcome, PreparedChat, completion_id, generate_chat,
                                     prepare_chat)
from harnessrl.proxy.sessions import Session, SessionStore, trace_json
from harnessrl.proxy.wire import MAX_JSON_DEPTH, dumps, error_body, loads

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProxyDeps:
    capture: CaptureDeps
    store: SessionStore


ProtocolHandler = Callable[[Request, Session, ProxyDeps], Awaitable[Response]]
"""Serves one protocol route for an authenticated session; may raise `RequestError`."""

_inflight: set[asyncio.Task[ChatOutcome]] = set()
"""Streamed generations run as tasks (held here while they run). A client that goes away
mid-stream cancels its generation: the engine stops decoding for it and the call is recorded
as an error turn (`capture.generate_chat`)."""


ADMIN_MAX_BODY_BYTES = 64 * 1024
"""Admin request bodies above this get 413."""


def make_app(deps: ProxyDeps, protocols: Mapping[str, ProtocolHandler] | None = None) -> Starlette:
    """Build the agents' app (no admin routes). `protocols` maps extra POST sub-paths under
    `/v1/` to handlers."""
    routes = [Route("/healthz", _healthz, methods=["GET"])]
    handlers: list[tuple[str, ProtocolHandler, str]] = [("chat/completions", chat_completions, "POST"),
                                                        ("models", list_models, "GET")]
    handlers += [(sub, h, "POST") for sub, h in (protocols or {}).items()]
    post_endpoints: dict[str, AsgiEndpoint] = {}
    for sub, handler, method in handlers:
        endpoint = _keyed(deps, handler)
        path = sub if sub.startswith("/") else f"/v1/{sub}"  # a leading "/": a path of its own (Google's /v1beta)
        routes.append(Route(path, endpoint, methods=[method]))
        routes.append(Route(f"/r/{{key}}{path}", endpoint, methods=[method]))
        if method == "POST" and "{" not in path:
            post_endpoints[path] = _asgi(endpoint)
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.post_endpoints = post_endpoints
    """Exact POST paths -> their ASGI endpoint, for a server's hot path (`serve_post`)."""
    return app


AsgiEndpoint = ASGIApp
"""An ASGI callable `(scope, receive, send)` that answers one request."""


async def serve_post(app: Starlette, scope: dict[str, Any], receive: Any, send: Any) -> bool:
    """Serve an agents' POST to one of `app`'s exact paths without Starlette's middleware and
    router (the endpoint answers every error as JSON itself); False when `scope` is not one."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return False
    endpoint = app.state.post_endpoints.get(scope["path"])
    if endpoint is None:
        return False
    await endpoint(scope, receive, send)
    return True


def _asgi(endpoint: Callable[[Request], Awaitable[Response]]) -> AsgiEndpoint:
    """A Starlette endpoint as an ASGI callable (what its route runs, without the router)."""
    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        response = await endpoint(Request(scope, receive))
        await response(scope, receive, send)
    return asgi


def make_admin_app(deps: ProxyDeps, token: str, agent_root: Callable[[], str],
                   max_body_bytes: int = ADMIN_MAX_BODY_BYTES) -> Starlette:
    """Build the admin app: session open / trace / close, each requiring
    `Authorization: Bearer <token>` (401 otherwise), bodies above `max_body_bytes` 413.

    `agent_root()` is the agents' `http://host:port` (what a new session's `base_url` names).
    Raises ValueError for a token shorter than 16 characters.
    """
    if len(token) < 16:
        raise ValueError(f"admin token must be at least 16 characters, got {len(token)}")
    routes = [
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/admin/sessions", _admin(deps, token, _open_session(agent_root, max_body_bytes)), methods=["POST"]),
        Route("/admin/sessions/{session_id}/trace", _admin(deps, token, _get_trace), methods=["GET"]),
        Route("/admin/sessions/{session_id}", _admin(deps, token, _close_session), methods=["DELETE"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


def json_response(status_code: int, body: object) -> Response:
    """`body` encoded as JSON (`wire.dumps`) in an `application/json` response."""
    return Response(dumps(body), status_code, media_type="application/json")


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body, read in chunks and refused past `max_body_bytes` (declared or sent).

    Raises:
        RequestError: 413 when the body exceeds `max_body_bytes`, 400 when the client went away.
    """
    declared = request_headers(request).get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(int(declared), max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()  # the ASGI messages themselves (what `request.stream()` reads)
        kind = message["type"]
        if kind == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_body_bytes:
                raise _too_large(size, max_body_bytes)
            if not message.get("more_body", False):
                return chunk if not chunks else b"".join((*chunks, chunk))
            chunks.append(chunk)
        elif kind == "http.disconnect":
            raise RequestError("client disconnected while sending the body")


async def read_json(request: Request, max_body_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """Read and decode a JSON object body.

    Raises:
        RequestError: 413 when the body exceeds `max_body_bytes`, 400 when it is not a JSON
            object, nests deeper than `max_depth`, or the client went away.
    """
    return loads(await read_body(request, max_body_bytes), max_depth)


async def read_session_json(request: Request, session: Session, deps: ProxyDeps) -> dict[str, Any]:
    """`read_json` with the config's bounds, the body's bytes charged to `session`
    (`Session.charge_body`) before it is decoded.

    Raises:
        RequestError: as `read_json`, and 413 (`session_body_budget`) past the session's budget.
    """
    config = deps.capture.config
    raw = await read_body(request, config.max_body_bytes)
    session.charge_body(len(raw))
    return loads(raw, config.max_json_depth)


def request_headers(request: Request) -> dict[str, str]:
    """The request's headers as a dict with lower-case names (ASGI sends them lower-case; a
    repeated header gives its first value, as `request.headers.get` does), built once per
    request."""
    scope = request.scope
    headers = scope.get("harnessrl.headers")
    if headers is None:
        headers = scope["harnessrl.headers"] = {k.decode("latin-1"): v.decode("latin-1")
                                                for k, v in reversed(scope["headers"])}
    return headers


def session_key(request: Request) -> str | None:
    """The session key: path `/r/<key>/...`, else `Authorization: Bearer`, else `x-api-key`,
    else `x-goog-api-key`, else the `key` query parameter (Google's forms)."""
    key = request.path_params.get("key")
    if key:
        return key
    headers = request_headers(request)
    auth = headers.get("authorization")
    if auth is not None and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (headers.get("x-api-key") or headers.get("x-goog-api-key")
            or request.query_params.get("key"))


async def chat_completions(request: Request, session: Session, deps: ProxyDeps) -> Response:
    """`POST /v1/chat/completions`: unary JSON, or SSE synthesised from the complete result."""
    body = await read_session_json(request, session, deps)
    prepared = await prepare_chat(deps.capture, session, body, request_headers(request))
    if isinstance(prepared, ChatOutcome):
        return json_response(prepared.status_code, prepared.body)
    if not prepared.request.stream:
        outcome = await generate_chat(deps.capture, prepared)
        return json_response(outcome.status_code, outcome.body)
    return _sse_response(deps, prepared)


def _sse_response(deps: ProxyDeps, prepared: PreparedChat) -> StreamingResponse:
    return StreamingResponse(_stream(deps, prepared), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


_UNKNOWN_KEY = error_body("unknown or revoked API key", param=None, code="invalid_api_key")


async def _stream(deps: ProxyDeps, prepared: PreparedChat) -> AsyncIterator[bytes]:
    response_id = completion_id()
    yield sse.role_chunk(response_id, int(time.time()), prepared.request.model or deps.capture.config.model_name)
    task = asyncio.ensure_future(generate_chat(deps.capture, prepared))
    _inflight.add(task)
    task.add_done_callback(_inflight.discard)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=deps.capture.config.stream_keepalive_s)
            if not task.done():
                yield sse.KEEPALIVE
    finally:
        if not task.done():  # the client went away: nothing is generated for nobody
            task.cancel()
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
            return json_response(401, _UNKNOWN_KEY)
        try:
            session.begin_call()
        except RequestError as exc:
            return json_response(exc.status_code, error_body(exc.message, param=exc.param, code=exc.code))
        try:
            response = await handler(request, session, deps)
        except RequestError as exc:
            response = json_response(exc.status_code, error_body(exc.message, param=exc.param, code=exc.code))
        except Exception as exc:  # noqa: BLE001 - a proxy bug answers JSON and is logged, never a bare 500
            log.exception("proxy failed on %s for session %s", request.url.path, session.session_id)
            response = json_response(500, error_body(f"internal proxy error: {type(exc).__name__}",
                                                     type_="server_error", code="internal_error"))
        except BaseException:  # cancelled: the call is over
            session.end_call()
            raise
        return _CallEnd(response, session)
    return endpoint


class _CallEnd(Response):
    """`response`, after which the session's call ends (`Session.end_call`): sent, failed or
    dropped, a stream at its last event."""

    def __init__(self, response: Response, session: Session) -> None:
        self.response = response
        self.session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self.response, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.session.end_call()


def _admin(deps: ProxyDeps, token: str, handler: Callable[[Request, ProxyDeps], Awaitable[Response]]
           ) -> Callable[[Request], Awaitable[Response]]:
    expected = f"Bearer {token}".encode()

    async def endpoint(request: Request) -> Response:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return json_response(401, error_body("admin routes need 'Authorization: Bearer <admin token>'",
                                                 code="invalid_admin_token"))
        try:
            return await handler(request, deps)
        except RequestError as exc:
            return json_response(exc.status_code, error_body(exc.message, param=exc.param, code=exc.code))
    return endpoint


def _open_session(agent_root: Callable[[], str], max_body_bytes: int
                  ) -> Callable[[Request, ProxyDeps], Awaitable[Response]]:
    async def handler(request: Request, deps: ProxyDeps) -> Response:
        body = await _admin_body(request, max_body_bytes)
        rollout_id = body.get("rollout_id")
        if rollout_id is not None and not isinstance(rollout_id, str):
            raise RequestError("'rollout_id' must be a string", param="rollout_id")
        group = body.get("group")
        if group is not None and not isinstance(group, str):
            raise RequestError("'group' must be a string", param="group")
        session = deps.store.open(rollout_id, group)
        root = agent_root()
        return json_response(200, {"session_id": session.session_id, "key": session.key,
                                   "base_url": root + "/v1", "keyed_base_url": f"{root}/r/{session.key}/v1"})
    return handler


async def _admin_body(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The admin request's JSON object body, `{}` when empty; 413 above `max_body_bytes`."""
    raw = await read_body(request, max_body_bytes)
    return loads(raw) if raw.strip() else {}


def _find(deps: ProxyDeps, request: Request) -> str:
    """The session id of the path, live or closed (a closed one is served from the trace file)."""
    session_id = request.path_params["session_id"]
    if not deps.store.known(session_id):
        raise RequestError(f"no session {session_id!r}", param="session_id", code="not_found", status_code=404)
    return session_id


def _not_kept(session_id: str) -> RequestError:
    return RequestError(f"session {session_id!r} is closed and its trace is no longer kept in memory "
                        f"(set proxy.trace_path to keep every trace)", param="session_id", code="not_found",
                        status_code=404)


async def _get_trace(request: Request, deps: ProxyDeps) -> Response:
    session_id = _find(deps, request)
    body = deps.store.trace_json(session_id)
    if body is None:
        raise _not_kept(session_id)
    return Response(body, media_type="application/json")


async def _close_session(request: Request, deps: ProxyDeps) -> Response:
    session_id = _find(deps, request)
    try:
        trace = deps.store.close(session_id)
    except KeyError:
        raise _not_kept(session_id) from None
    return Response(trace_json(trace), media_type="application/json")


async def _healthz(request: Request) -> Response:
    return json_response(200, {"ok": True})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException), f"unexpected {type(exc).__name__}"
    return json_response(exc.status_code, error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                                     code=str(exc.status_code)))


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(f"request body of {size} bytes exceeds max_body_bytes={limit}",
                        code="request_too_large", status_code=413)

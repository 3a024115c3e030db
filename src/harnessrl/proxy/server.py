"""`ProxyServer`: the proxy app served by uvicorn inside the caller's event loop.

Listeners (one uvicorn server; each connection is routed by the socket it arrived on):
  * agents, TCP `config.host:config.port`: the protocol routes (`make_app`), for agents that
    run without bubblewrap and for external clients;
  * agents, Unix socket `agent_socket_path` (mode 0600 in a fresh 0700 directory): the same
    routes; bubblewrap sandboxes get this socket bound in and reach it through their own
    forwarder on `127.0.0.1:<port>` (`sandbox/forward.py`), their only way out;
  * admin, TCP `127.0.0.1:admin_port` (always loopback, its own port): the session routes
    (`make_admin_app`), each needing `Authorization: Bearer <admin_token>`. The token is
    generated per server unless given. Sandboxes cannot reach this port (their network
    namespace has none of the host's); an agent without bubblewrap can, but lacks the token.

The server binds its own sockets (port 0 allowed) and hands them to uvicorn
(`Server.serve(sockets=[...])`), so there is no window in which another process can take
a port (DESIGN.md §9, free-port races). Use it as an async context manager; leaving it
closes every live session (traces are written when a trace path is set) and stops uvicorn
within `shutdown_timeout_s`.

What this module deliberately does not do: create the engine (the caller owns it and
closes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import logging
import os
import resource
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

from harnessrl.engine.base import Engine
from harnessrl.chat.layer import ChatLayer
from harnessrl.errors import ConfigError
from harnessrl.proxy import anthropic, google, responses
from harnessrl.proxy.app import ProtocolHandler, ProxyDeps, make_admin_app, make_app, serve_post
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.httpguard import ConnectionLimits, guarded_httptools
from harnessrl.proxy.sessions import SessionStore
from harnessrl.types import Endpoint, Trace

T = TypeVar("T")
log = logging.getLogger(__name__)


SERVING_GC_THRESHOLD0 = 20_000
"""Young-generation GC threshold of a serving process (CPython's default is 700)."""


_serving = False
"""True while `run_loop` runs `main` (the process serves: `ProxyServer.start` freezes its heap)."""


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` for a process that serves the proxy: on a uvloop event loop when
    uvloop is installed, else on the default loop; with the young-generation GC threshold
    raised to `SERVING_GC_THRESHOLD0`, since every call allocates thousands of objects
    (parsed bodies, messages) and each recorded turn stays alive in its trace, so the default
    threshold runs a collection several times per call. A
    `ProxyServer` started inside it freezes the process's startup heap (`freeze_startup_heap`).
    """
    global _serving
    threshold0, *rest = gc.get_threshold()
    gc.set_threshold(max(threshold0, SERVING_GC_THRESHOLD0), *rest)
    _serving = True
    try:
        try:
            import uvloop  # lazy: uvloop, heavy; not needed at import
        except ImportError:
            return asyncio.run(main)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    finally:
        _serving = False


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now into the GC's permanent generation
    (`gc.freeze`), so later full collections no longer traverse the startup heap (imported
    modules, tokenizer, config: a full collection of it stalls serving). Objects allocated later
    are collected as before. Returns the frozen count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def native_protocols() -> dict[str, ProtocolHandler]:
    """The protocol routes served besides chat completions: Responses API, Anthropic Messages
    and Google's generateContent / streamGenerateContent."""
    return {"responses": responses.handle, "messages": anthropic.handle,
            "messages/count_tokens": anthropic.count_tokens, google.ROUTE: google.handle,
            google.V1_ROUTE: google.handle}


class _Uvicorn(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM handlers: the process that runs the proxy owns its
    signals (a run stops as a whole, `harnessrl.signals`; `harnessrl serve` has its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ProxyServer:
    """`async with ProxyServer(engine, chat, config) as proxy: proxy.base_url ...`"""

    def __init__(self, engine: Engine, chat: ChatLayer, config: ProxyConfig | None = None,
                 shutdown_timeout_s: float = 5.0, admin_port: int = 0, admin_token: str | None = None) -> None:
        self.config = config or ProxyConfig()
        self.store = SessionStore(self.config.trace_path, max_closed_traces=self.config.max_closed_traces,
                                  max_revoked_keys=self.config.max_revoked_keys,
                                  max_turns_per_session=self.config.max_turns_per_session,
                                  max_session_body_bytes=self.config.max_session_body_bytes,
                                  max_concurrent_calls=self.config.max_concurrent_calls_per_session)
        self.deps = ProxyDeps(CaptureDeps(engine, chat, self.config), self.store)
        self.app = make_app(self.deps, protocols=native_protocols())
        self.admin_token = admin_token or secrets.token_urlsafe(32)
        """Bearer token of the admin listener (generated per server unless given)."""
        self.admin_app = make_admin_app(self.deps, self.admin_token, lambda: self.base_url.removesuffix("/v1"))
        self.shutdown_timeout_s = shutdown_timeout_s
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._socks: list[socket.socket] = []
        self._socket_dir: Path | None = None
        self._admin_name: tuple[str, int] | None = None
        self._requested_admin_port = admin_port
        self.port = 0
        self.admin_port = 0
        self.connection_limits = connection_limits(self.config)
        """Bounds on the agents' connections (set again at `start`, with the admin listener exempt)."""

    @property
    def agent_socket_path(self) -> Path:
        """The agents' Unix socket of the running server (what sandboxes get bound in).

        Raises RuntimeError before `start()`."""
        if self._socket_dir is None:
            raise RuntimeError("the proxy is not started")
        return self._socket_dir / "agent.sock"

    @property
    def admin_url(self) -> str:
        """`http://127.0.0.1:ADMIN_PORT` of the running server's admin listener."""
        return f"http://127.0.0.1:{self.admin_port}"

    async def _route(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """ASGI entry: connections on the admin socket get the admin app, all others the agents'."""
        server = scope.get("server")
        if server is not None and tuple(server) == self._admin_name:
            await self.admin_app(scope, receive, send)
        elif not await serve_post(self.app, scope, receive, send):  # the agents' calls: the hot path
            await self.app(scope, receive, send)

    @property
    def base_url(self) -> str:
        """`http://HOST:PORT/v1` of the running server."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        """Bind, start uvicorn in this loop, and wait until it accepts connections; inside
        `run_loop`, then freeze the process's heap (`freeze_startup_heap`).

        Raises:
            ConfigError: the host/port cannot be bound or uvicorn failed to start.
        """
        sock = _bind_tcp(self.config.host, self.config.port, "proxy")
        self.port = sock.getsockname()[1]
        admin = _bind_tcp("127.0.0.1", self._requested_admin_port, "proxy admin listener", sock)
        self.admin_port = admin.getsockname()[1]
        self._admin_name = ("127.0.0.1", self.admin_port)
        self._socket_dir = Path(tempfile.mkdtemp(prefix="harnessrl-proxy-"))
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.bind(str(self.agent_socket_path))
            os.chmod(self.agent_socket_path, 0o600)
        except OSError as exc:
            for s in (sock, admin, unix):
                s.close()
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            raise ConfigError(f"proxy cannot bind its agent socket {self.agent_socket_path}: {exc}") from exc
        unix.listen(2048)
        self._socks = [sock, admin, unix]
        # httptools parser, no access log, no X-Forwarded-For rewriting (a middleware hop
        # per call saved; the peer address is never trusted for anything).
        # The httptools protocol with a read deadline (`httpguard`); idle keep-alive bounded too.
        self.connection_limits = connection_limits(
            self.config, lambda name: isinstance(name, tuple) and name[:2] == self._admin_name)
        http = guarded_httptools(self.config.read_timeout_s, self.connection_limits, self.config.max_header_bytes)
        uv_config = uvicorn.Config(self._route, http=http, log_level="warning",
                                   access_log=False, timeout_keep_alive=math.ceil(self.config.keepalive_timeout_s),
                                   proxy_headers=False, server_header=False, lifespan="off", interface="asgi3",
                                   timeout_graceful_shutdown=math.ceil(self.shutdown_timeout_s), backlog=2048)
        self._server = _Uvicorn(uv_config)
        self._task = asyncio.create_task(self._server.serve(sockets=self._socks))
        while not self._server.started:
            if self._task.done():
                await self.aclose()
                raise ConfigError(f"uvicorn failed to start on {self.config.host}:{self.port}")
            await asyncio.sleep(0.01)
        if _serving:  # a serving process (`run_loop`): what it loaded so far lives as long as it
            freeze_startup_heap()

    @property
    def open_connections(self) -> dict[str, int]:
        """The agents' listeners' connections now: `total`, `peers` holding one, `refused`
        since start (`ConnectionLimits.snapshot`)."""
        return self.connection_limits.snapshot()

    def open_session(self, rollout_id: str | None = None, group: str | None = None) -> tuple[str, str]:
        """Open a session; returns `(session_id, key)`. Its calls reuse the engine's prefix cache
        only with sessions of the same `group` (None: with none, `Session.cache_scope`)."""
        session = self.store.open(rollout_id, group)
        return session.session_id, session.key

    def endpoint(self, key: str) -> Endpoint:
        """The `Endpoint` an agent gets for a session key."""
        root = self.base_url.removesuffix("/v1")
        return Endpoint(base_url=self.base_url, api_key=key, model=self.config.model_name,
                        keyed_base_url=f"{root}/r/{key}/v1")

    def close_session(self, session_id: str) -> Trace:
        """Revoke the session's key and return its final trace (written if a path is set); the
        engine cancels the session's calls still generating (`Engine.forget`: nothing more is
        generated for a turn that is never recorded) and drops its routing key."""
        trace = self.store.close(session_id)
        self.deps.capture.engine.forget(session_id)
        return trace

    async def aclose(self) -> None:
        """Close live sessions and stop uvicorn; idempotent, shielded from cancellation."""
        self.store.close_all()
        server, task, socks, socket_dir = self._server, self._task, self._socks, self._socket_dir
        self._server = self._task = None
        self._socks = []
        if server is not None and task is not None:
            server.should_exit = True
            try:
                await asyncio.shield(asyncio.wait_for(asyncio.shield(task), self.shutdown_timeout_s + 1.0))
            except TimeoutError:
                server.force_exit = True
                await asyncio.wait({task}, timeout=1.0)
        for sock in socks:
            sock.close()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


DESCRIPTORS_KEPT_FREE = 0.5
"""Share of the process's descriptor limit (RLIMIT_NOFILE, soft) that the agents'
connections never take: the trainer keeps descriptors for its files, sandboxes and engine."""


def connection_limits(config: ProxyConfig, exempt: Callable[[Any], bool] = lambda name: False) -> ConnectionLimits:
    """`ConnectionLimits` of `config`: `max_connections` in all, lowered (and logged) to
    `DESCRIPTORS_KEPT_FREE` of the soft descriptor limit below it, and
    `max_connections_per_peer` per Unix-socket peer."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    total = config.max_connections
    if soft != resource.RLIM_INFINITY and total > soft * (1 - DESCRIPTORS_KEPT_FREE):
        total = max(1, int(soft * (1 - DESCRIPTORS_KEPT_FREE)))
        log.info("proxy: max_connections=%d lowered to %d, half the process's descriptor limit (%d)",
                 config.max_connections, total, soft)
    return ConnectionLimits(total, config.max_connections_per_peer, exempt)


def _bind_tcp(host: str, port: int, what: str, *opened: socket.socket) -> socket.socket:
    """A listening TCP socket on `host:port`; raises ConfigError (closing `opened`) when it
    cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        for s in (sock, *opened):
            s.close()
        raise ConfigError(f"{what} cannot bind {host}:{port}: {exc}") from exc
    sock.listen(2048)
    return sock

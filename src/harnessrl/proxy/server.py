"""`ProxyServer`: the proxy app served by uvicorn inside the caller's event loop.

The server binds its own socket (port 0 allowed) and hands it to uvicorn
(`Server.serve(sockets=[sock])`), so there is no window in which another process can take
the port (DESIGN.md §9, free-port races). Use it as an async context manager; leaving it
closes every live session (traces are written when a trace path is set) and stops uvicorn
within `shutdown_timeout_s`.

What this module deliberately does not do: create the engine (the caller owns it and
closes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

from harnessrl.engine.base import Engine
from harnessrl.engine.chat import ChatLayer
from harnessrl.errors import ConfigError
from harnessrl.proxy import anthropic, responses
from harnessrl.proxy.app import ProtocolHandler, ProxyDeps, make_app
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.sessions import SessionStore
from harnessrl.types import Endpoint, Trace

T = TypeVar("T")


SERVING_GC_THRESHOLD0 = 20_000
"""Young-generation GC threshold of a serving process (CPython's default is 700)."""


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` for a process that serves the proxy: on a uvloop event loop when
    uvloop is installed, else on the default loop; with the young-generation GC threshold
    raised to `SERVING_GC_THRESHOLD0`, since every call allocates thousands of objects
    (parsed bodies, messages) and each recorded turn stays alive in its trace, so the default
    threshold runs a collection several times per call (measured: +15-20% calls/s).
    """
    threshold0, *rest = gc.get_threshold()
    gc.set_threshold(max(threshold0, SERVING_GC_THRESHOLD0), *rest)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def native_protocols() -> dict[str, ProtocolHandler]:
    """The protocol routes served besides chat completions: Responses API and Anthropic Messages."""
    return {"responses": responses.handle, "messages": anthropic.handle,
            "messages/count_tokens": anthropic.count_tokens}


class _Uvicorn(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM handlers: the process that runs the proxy owns its
    signals (a run stops as a whole, `harnessrl.signals`; `harnessrl serve` has its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ProxyServer:
    """`async with ProxyServer(engine, chat, config) as proxy: proxy.base_url ...`"""

    def __init__(self, engine: Engine, chat: ChatLayer, config: ProxyConfig | None = None,
                 shutdown_timeout_s: float = 5.0) -> None:
        self.config = config or ProxyConfig()
        self.store = SessionStore(self.config.trace_path)
        self.deps = ProxyDeps(CaptureDeps(engine, chat, self.config), self.store)
        self.app = make_app(self.deps, protocols=native_protocols())
        self.shutdown_timeout_s = shutdown_timeout_s
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        """`http://HOST:PORT/v1` of the running server."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        """Bind, start uvicorn in this loop, and wait until it accepts connections.

        Raises:
            ConfigError: the host/port cannot be bound or uvicorn failed to start.
        """
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"proxy cannot bind {self.config.host}:{self.config.port}: {exc}") from exc
        sock.listen(2048)
        self._sock, self.port = sock, sock.getsockname()[1]
        # httptools parser, no access log, no X-Forwarded-For rewriting (the admin routes'
        # loopback check must see the real peer; it also saves a middleware hop per call).
        uv_config = uvicorn.Config(self.app, http="httptools", log_level="warning", access_log=False,
                                   proxy_headers=False, lifespan="off",
                                   timeout_graceful_shutdown=self.shutdown_timeout_s, backlog=2048)
        self._server = _Uvicorn(uv_config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self.aclose()
                raise ConfigError(f"uvicorn failed to start on {self.config.host}:{self.port}")
            await asyncio.sleep(0.01)

    def open_session(self, rollout_id: str | None = None) -> tuple[str, str]:
        """Open a session; returns `(session_id, key)`."""
        session = self.store.open(rollout_id)
        return session.session_id, session.key

    def endpoint(self, key: str) -> Endpoint:
        """The `Endpoint` an agent gets for a session key."""
        root = self.base_url.removesuffix("/v1")
        return Endpoint(base_url=self.base_url, api_key=key, model=self.config.model_name,
                        keyed_base_url=f"{root}/r/{key}/v1")

    def close_session(self, session_id: str) -> Trace:
        """Revoke the session's key and return its final trace (written if a path is set)."""
        return self.store.close(session_id)

    async def aclose(self) -> None:
        """Close live sessions and stop uvicorn; idempotent, shielded from cancellation."""
        self.store.close_all()
        server, task, sock = self._server, self._task, self._sock
        self._server = self._task = self._sock = None
        if server is not None and task is not None:
            server.should_exit = True
            try:
                await asyncio.shield(asyncio.wait_for(asyncio.shield(task), self.shutdown_timeout_s + 1.0))
            except TimeoutError:
                server.force_exit = True
                await asyncio.wait({task}, timeout=1.0)
        if sock is not None:
            sock.close()

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

"""`HttpPool`: keep-alive HTTP/1.1 connections to one vLLM server, for `VllmEngine`'s
`POST /v1/completions` (`engine/vllm/client.py`).

Why not aiohttp's client: every call of a rollout goes through here, and aiohttp's request
machinery (request and response objects, payload registry, timers, stream readers) cost
~0.13 ms of CPU per small call and ~0.2 ms per agent-sized one in the proxy's process
(measured against the same stub server, `bench/proxy_upstream.py`); a request here is one
socket write of the head and body, and the answer is read by httptools' parser (the one the
proxy's own listener uses) into one bytes object.

Behaviour:
  * One pool per base URL and event loop (`VllmEngine` keeps one per loop). At most
    `max_connections` requests in flight; an idle connection is reused newest first and
    closed when it idled `keepalive_s` or more (below the server's own keep-alive, so a
    connection the server already closed is not written to) or when the server said
    `Connection: close`.
  * Every request has one deadline, `timeout_s` from when it is sent, covering the connect,
    the write and the whole answer (`asyncio.TimeoutError` past it). A connection keeps its
    requests' deadlines on one timer, moved on when it finds a later request's deadline (as
    the proxy's listener does, `proxy/httpguard.py`): no timer is started and cancelled per
    request (`asyncio.timeout_at` per request cost ~3.5 us of the proxy's CPU a call).
  * A reused connection that the server closed before a byte of the answer arrived is retried
    once on a fresh connection (the server closed it idle; the request was never read).
  * A cancelled or failed request closes its connection (its state is unknown).

Raises (from `post`): `asyncio.TimeoutError`, `ResponseCutShort` (the connection closed in the
middle of an answer, or the answer is not HTTP), `OSError` (connect or write failed).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = ["HttpPool", "ResponseCutShort"]


class ResponseCutShort(Exception):
    """The server closed the connection before its answer was complete (or sent no HTTP)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time (`request`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.deadline = 0.0
        """Loop time by which the request in flight must be answered."""
        self.timer: asyncio.TimerHandle | None = None
        """Fires at or before `deadline` while a request is in flight (`_check_deadline`)."""
        self.chunks: list[bytes] = []
        self.got_bytes = False
        self.keep_alive = True
        self.closed = False
        self.idle_since = 0.0

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport (TCP or TLS)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ResponseCutShort(f"the answer is not HTTP: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.keep_alive = False
        self._cancel_timer()
        if self.waiter is not None and not self.waiter.done():
            why = "after part of its answer" if self.got_bytes else "before answering"
            self._fail(ResponseCutShort(f"the connection was closed {why}" + (f" ({exc})" if exc else "")))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        status = self.parser.get_status_code()
        chunks, self.chunks = self.chunks, []
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((status, chunks[0] if len(chunks) == 1 else b"".join(chunks)))

    # -- use -----------------------------------------------------------------------------------

    def request(self, data: bytes, deadline: float) -> asyncio.Future[tuple[int, bytes]]:
        """Send `data` (a whole request); the future gets (status, body), or `TimeoutError`
        when no whole answer came by loop time `deadline` (the connection is then closed)."""
        assert self.transport is not None and self.waiter is None
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.got_bytes = False
        self.deadline = deadline
        if self.timer is None:
            self.timer = loop.call_at(deadline, self._check_deadline)
        self.transport.write(data)
        return self.waiter

    def _check_deadline(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():  # idle: the next request arms the timer again
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self.deadline:  # a later request's deadline
            self.timer = loop.call_at(self.deadline, self._check_deadline)
            return
        self._fail(TimeoutError())
        self.close()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        self.keep_alive = False
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()


class HttpPool:
    """Keep-alive connections to `base_url` (`http://host:port[/prefix]` or https) on the
    running event loop; `post(path, body)` -> (status, body bytes). See the module docstring."""

    def __init__(self, base_url: str, *, max_connections: int, timeout_s: float, keepalive_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.rsplit("@", 1)[-1].encode("idna")
        self._timeout_s = timeout_s
        self._keepalive_s = keepalive_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._heads: dict[str, bytes] = {}
        self.closed = False

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """POST `payload` (JSON) to `path` under the base URL; (status, body). Raises as the
        module docstring says."""
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = (f"POST {self._prefix}{path} HTTP/1.1\r\n".encode()
                                        + b"Host: " + self._host_header + b"\r\n"
                                          b"Content-Type: application/json\r\n"
                                          b"Content-Length: ")
        data = b"%b%d\r\n\r\n%b" % (head, len(payload), payload)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        async with self._slots:
            conn = self._take()
            if conn is not None:
                try:
                    return await self._exchange(conn, data, deadline)
                except ResponseCutShort:
                    if conn.got_bytes:
                        raise
                    # closed idle by the server as the request went out: once more, fresh
            return await self._exchange(None, data, deadline)

    async def _exchange(self, conn: _Connection | None, data: bytes, deadline: float) -> tuple[int, bytes]:
        try:
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    _, conn = await asyncio.get_running_loop().create_connection(
                        _Connection, self._host, self._port, ssl=self._ssl)
            self._busy.add(conn)
            status, body = await conn.request(data, deadline)
        except BaseException:
            if conn is not None:
                self._busy.discard(conn)
                conn.close()
            raise
        self._busy.discard(conn)
        if conn.keep_alive and not conn.closed and not self.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return status, body

    def _take(self) -> _Connection | None:
        """The newest idle connection still open and idle under `keepalive_s` (the ones popped
        before it are closed)."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and time.monotonic() - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        return None

    def close(self) -> None:
        """Close every connection (call on the pool's loop); requests in flight fail."""
        self.closed = True
        for conn in (*self._idle, *self._busy):
            conn.close()
        self._idle.clear()

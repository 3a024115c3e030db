"""`HttpPool`: keep-alive HTTP/1.1 connections to one vLLM server, for `VllmEngine`'s
`POST /v1/completions` (`engine/vllm/client.py`), on `httpx.AsyncClient` (the client the rest
of harnessrl uses).

Behaviour:
  * One pool per base URL and event loop (`VllmEngine` keeps one per loop). At most
    `max_connections` requests in flight; an idle connection is closed when it idled
    `keepalive_s` (below the server's own keep-alive, so a connection the server already
    closed is not written to) or when the server said `Connection: close`. Proxy settings of
    the environment are ignored (vLLM is reached directly).
  * Every request has one deadline, `timeout_s` from when it is asked for, covering the wait
    for a connection, the connect, the write and the whole answer (`TimeoutError` past it).
  * A request whose connection the server closed before a byte of the answer arrived is sent
    once more (a reused connection that the server closed idle; the request was never read).
  * A cancelled or failed request closes its connection (its state is unknown); vLLM aborts a
    request whose client went away.

Raises (from `post`): `TimeoutError`, `ResponseCutShort` (the connection closed in the middle
of an answer, or the answer is not HTTP), `OSError` (connect or write failed).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx

__all__ = ["HttpPool", "ResponseCutShort"]

_HEADERS = {"content-type": "application/json"}
_NO_ANSWER = "without sending a response"
"""What httpx's error says when the connection closed before a byte of the answer."""
_closing: set[asyncio.Task[None]] = set()
"""Pools' `aclose` tasks started by `close` (held until done)."""


class ResponseCutShort(Exception):
    """The server closed the connection before its answer was complete (or sent no HTTP)."""


class HttpPool:
    """Keep-alive connections to `base_url` (`http://host:port[/prefix]` or https) on the
    running event loop; `post(path, body)` -> (status, body bytes). See the module docstring.

    Raises ValueError for a URL that is not http(s)."""

    def __init__(self, base_url: str, *, max_connections: int, timeout_s: float, keepalive_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._base = base_url.rstrip("/")
        self._timeout_s = timeout_s
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                              keepalive_expiry=keepalive_s)
        # no httpx timeouts: the one deadline is `timeout_s` around the whole request (`post`)
        self._client = httpx.AsyncClient(limits=limits, timeout=None, trust_env=False)
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the pool's connections live on (its first request's)."""

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """POST `payload` (JSON) to `path` under the base URL; (status, body). Raises as the
        module docstring says."""
        url = self._base + path
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._timeout_s):
            for retry in (False, True):
                try:
                    response = await self._client.post(url, content=payload, headers=_HEADERS)
                    return response.status_code, response.content
                except httpx.RemoteProtocolError as exc:
                    if not retry and _NO_ANSWER in str(exc):
                        continue
                    raise ResponseCutShort(f"the connection was closed or the answer is not HTTP: {exc}") from None
                except (httpx.ConnectError, httpx.WriteError) as exc:
                    raise OSError(f"{type(exc).__name__}: {exc}") from None
                except httpx.ReadError as exc:
                    raise ResponseCutShort(f"the connection failed while reading the answer: {exc}") from None
        raise AssertionError("unreachable")  # the loop returns or raises

    async def aclose(self) -> None:
        """Close every connection; requests in flight fail."""
        self.closed = True
        await self._client.aclose()

    def close(self) -> None:
        """`aclose` from synchronous code: as a task when the pool's loop runs (call on that
        loop), run to completion when it is stopped."""
        self.closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if loop.is_running():
            task = loop.create_task(self._client.aclose())
            _closing.add(task)
            task.add_done_callback(_closing.discard)
        else:
            loop.run_until_complete(self._client.aclose())

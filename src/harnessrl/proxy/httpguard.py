"""A read deadline for the proxy's HTTP connections (uvicorn's httptools protocol, guarded).

uvicorn bounds only the idle time between two requests of a keep-alive connection
(`timeout_keep_alive`). A connection that never sends, sends its headers a byte at a time, or
stops halfway through its body would hold its socket (and the handler awaiting the body)
forever; an agent could exhaust the process's file descriptors that way.

`guarded_httptools(read_timeout_s)` returns a protocol class for `uvicorn.Config(http=...)`
that arms one deadline when a connection opens and again when a new request starts on it,
and disarms it once that request's body is complete. When it fires, the connection is
closed: with `408 Request Timeout` when no request is being answered, silently when a
handler is already reading the body (it sees a client disconnect).

Invariant: generation time is never limited here; the deadline covers only reading a request.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

def _timeout_body(read_timeout_s: float) -> bytes:
    message = f"request not received within read_timeout_s={read_timeout_s:g}".encode()
    return (b'{"error": {"message": "' + message + b'", "type": "invalid_request_error", "param": null, '
            b'"code": "request_timeout"}}')


def guarded_httptools(read_timeout_s: float) -> type[asyncio.Protocol]:
    """The httptools protocol with a per-request read deadline of `read_timeout_s` seconds.

    Raises:
        ValueError: `read_timeout_s` is not positive.
    """
    if not read_timeout_s > 0:
        raise ValueError(f"read_timeout_s={read_timeout_s!r} must be > 0")
    body = _timeout_body(read_timeout_s)
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._read_deadline is None:
                self._arm()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            if self.transport.is_closing():
                return
            answering = self.cycle is not None and not self.cycle.response_complete
            log.info("closing a connection from %s: request not read within %gs", self.client, read_timeout_s)
            if not answering:
                self.transport.write(head + body)
            self.transport.close()

    return GuardedHttpToolsProtocol

"""A read deadline for the proxy's HTTP connections (uvicorn's httptools protocol, guarded).

uvicorn bounds only the idle time between two requests of a keep-alive connection
(`timeout_keep_alive`). A connection that never sends, sends its headers a byte at a time, or
stops halfway through its body would hold its socket (and the handler awaiting the body)
forever; an agent could exhaust the process's file descriptors that way.

`guarded_httptools(read_timeout_s)` returns a protocol class for `uvicorn.Config(http=...)`
that sets one deadline when a connection opens and again when a new request starts on it,
and clears it once that request's body is complete. When it passes, the connection is
closed: with `408 Request Timeout` when no request is being answered, silently when a
handler is already reading the body (it sees a client disconnect). One timer per connection
checks it (moved on when it finds a later deadline).

Invariant: generation time is never limited here; the deadline covers only reading a request.

A request's header section (URL and headers) is bounded by `max_header_bytes`: counted per
header as the parser completes it, and by whole chunks while a section is still open (the
parser buffers a header until it is complete, so an endless one is cut off too); past it the
connection gets 431 and is closed.

Connections are bounded in number too (`ConnectionLimits`): the agents' listeners hold at most
`max_total` connections in all and `max_per_peer` per peer, where a peer is the PID namespace
of the process that connected to the Unix socket. A connecting uid other than the proxy's own is
a sandbox's owner (each sandbox has a host uid of its own when harnessrl runs as root), and the
uid is the peer: read from `SO_PEERCRED` itself, it holds for every process of the sandbox,
exited ones included. Otherwise the peer is the connecting pid's PID namespace
(`/proc/<pid>/ns/pid`): each sandboxed command runs in a PID namespace of its own, its forwarder
and every process it starts included, so one flooding agent uses up its own share only. A
connection whose namespace cannot be read (the connecting process exited before it was
accepted, while another process holds the socket) cannot be attributed and is refused: counted
under a fallback key, children that connect and exit would give an agent a second share. TCP connections
count in all only (agents reach TCP only without a sandbox, or through a Ray node's relay,
which carries many rollouts). A connection past a bound is closed at once, before a byte is
read; the admin listener is not counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop reading a header section past its bound."""


_PEERCRED = struct.Struct("3i")


def unix_peer(sock: Any) -> str | None:
    """Who connected to a Unix socket (module docstring): `uid:<uid>` for a uid other than this
    process's effective uid (a sandbox's own owner), else `pidns:<namespace>` of the connecting
    process, else None: the peer cannot be attributed (no credentials, or the connecting
    process exited before the connection was accepted)."""
    try:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except (OSError, AttributeError, struct.error):
        return None
    if uid != os.geteuid():
        return f"uid:{uid}"
    try:
        return "pidns:" + os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


class ConnectionLimits:
    """The agents' open connections, in all and per Unix-socket peer (module docstring).

    Args:
        max_total: connections held at most in all (>= 1).
        max_per_peer: connections one Unix-socket peer holds at most (>= 1).
        exempt: True for a listener address (`sockname`) whose connections are not counted
            (the admin listener).

    Raises ValueError for a bound below 1.
    """

    def __init__(self, max_total: int, max_per_peer: int, exempt: Callable[[Any], bool] = lambda name: False) -> None:
        if max_total < 1 or max_per_peer < 1:
            raise ValueError(f"max_total={max_total} and max_per_peer={max_per_peer} must be >= 1")
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self.exempt = exempt
        self.total = 0
        self.refused = 0
        """Connections closed at once for being past a bound, since start."""
        self.peers: dict[str, int] = {}

    def admit(self, transport: asyncio.BaseTransport) -> tuple[bool, str | None]:
        """Count a new connection: `(True, peer)` when it may stay (`peer` None: counted in all
        only, "" for an exempt one), `(False, None)` when it must be closed."""
        if self.exempt(transport.get_extra_info("sockname")):
            return True, ""
        sock = transport.get_extra_info("socket")
        unix = sock is not None and sock.family == socket.AF_UNIX
        peer = unix_peer(sock) if unix else None
        if (self.total >= self.max_total or (unix and peer is None)
                or (peer is not None and self.peers.get(peer, 0) >= self.max_per_peer)):
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                who = peer or ("an unattributable peer" if unix else "tcp")
                log.warning("closed a new connection from %s: %d open in all (max_connections=%d), %d from "
                            "this peer (max_connections_per_peer=%d); %d refused so far", who,
                            self.total, self.max_total, self.peers.get(peer, 0) if peer else 0, self.max_per_peer,
                            self.refused)
            return False, None
        self.total += 1
        if peer is not None:
            self.peers[peer] = self.peers.get(peer, 0) + 1
        return True, peer

    def release(self, peer: str | None) -> None:
        """A connection admitted with `peer` closed."""
        if peer == "":
            return
        self.total -= 1
        if peer is not None:
            left = self.peers[peer] - 1
            if left:
                self.peers[peer] = left
            else:
                del self.peers[peer]

    def snapshot(self) -> dict[str, int]:
        """`total`, `peers` (how many hold a connection), `refused` (since start)."""
        return {"total": self.total, "peers": len(self.peers), "refused": self.refused}


def _timeout_body(read_timeout_s: float) -> bytes:
    message = f"request not received within read_timeout_s={read_timeout_s:g}".encode()
    return (b'{"error": {"message": "' + message + b'", "type": "invalid_request_error", "param": null, '
            b'"code": "request_timeout"}}')


def guarded_httptools(read_timeout_s: float, limits: ConnectionLimits | None = None,
                      max_header_bytes: int = 64 * 1024) -> type[asyncio.Protocol]:
    """The httptools protocol with a per-request read deadline of `read_timeout_s` seconds,
    each new connection counted by
    `limits` (closed at once past a bound), and a request whose header section grows past
    `max_header_bytes` answered 431 and closed (module docstring).

    Raises:
        ValueError: `read_timeout_s` is not positive.
    """
    if not read_timeout_s > 0:
        raise ValueError(f"read_timeout_s={read_timeout_s!r} must be > 0")
    body = _timeout_body(read_timeout_s)
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
    big_body = (b'{"error": {"message": "request header section exceeds max_header_bytes=%d", '
                b'"type": "invalid_request_error", "param": null, "code": "headers_too_large"}}' % max_header_bytes)
    big_head = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: " + str(len(big_body)).encode() + b"\r\n\r\n")

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _read_by: float | None = None
        """Loop time by which the request being read must be complete; None: none is."""
        _read_timer: asyncio.TimerHandle | None = None
        """Fires at or before `_read_by` (armed once, moved on when it finds a later deadline:
        no timer is started and cancelled per request)."""
        _head_bytes: int = 0
        """Bytes of the request line's URL and the headers read so far (names, values, 4 per
        header for its separators)."""
        _head_too_big: bool = False
        _head_open: bool = False
        """A request's header section is being read (from its first byte to its end)."""
        _head_chunks: int = 0
        """Bytes of the chunks that ended while `_head_open` (a bound on the bytes the parser
        holds for the header section)."""
        _counted: bool = False
        """Admitted by `limits` (released when the connection is lost)."""
        _peer: str | None = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_open and not self._head_too_big:
                # the chunk ended inside a header section, which the parser buffers until each
                # header is whole: counted by chunks, so one endless header is cut off too
                self._head_chunks += len(data)
                if self._head_chunks > max_header_bytes:
                    self._head_too_big = True
                    self.send_400_response("")

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count_head(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > max_header_bytes:
                self._head_too_big = True
                raise _HeadTooLarge  # the parser stops; uvicorn answers through `send_400_response`

        def send_400_response(self, msg: str) -> None:
            if not self._head_too_big:
                super().send_400_response(msg)
                return
            log.info("closing a connection from %s: header section past max_header_bytes=%d", self.client,
                     max_header_bytes)
            if not self.transport.is_closing():
                self.transport.write(big_head + big_body)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if limits is not None:
                admitted, self._peer = limits.admit(transport)
                if not admitted:
                    transport.close()  # nothing read or written: the peer sees EOF
                    return
                self._counted = True
            self._read_by = self.loop.time() + read_timeout_s
            self._read_timer = self.loop.call_at(self._read_by, self._read_check)

        def on_headers_complete(self) -> None:
            self._head_open, self._head_chunks = False, 0
            super().on_headers_complete()

        def on_message_begin(self) -> None:
            self._head_bytes, self._head_open = 0, True
            super().on_message_begin()
            if self._read_by is None:
                self._read_by = self.loop.time() + read_timeout_s
                if self._read_timer is None:
                    self._read_timer = self.loop.call_at(self._read_by, self._read_check)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._read_by = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._counted and limits is not None:
                self._counted = False
                limits.release(self._peer)
            self._read_by = None
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            super().connection_lost(exc)

        def _read_check(self) -> None:
            self._read_timer = None
            read_by = self._read_by
            if read_by is None:  # nothing being read; the next request arms the timer again
                return
            if self.loop.time() < read_by:  # a later request's deadline
                self._read_timer = self.loop.call_at(read_by, self._read_check)
                return
            self._read_by = None
            self._read_timed_out()

        def _read_timed_out(self) -> None:
            if self.transport.is_closing():
                return
            answering = self.cycle is not None and not self.cycle.response_complete
            log.info("closing a connection from %s: request not read within %gs", self.client, read_timeout_s)
            if not answering:
                self.transport.write(head + body)
            self.transport.close()

    return GuardedHttpToolsProtocol

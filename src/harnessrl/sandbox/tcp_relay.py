"""A node's Unix-socket relay to the proxy's agents listener over TCP.

Responsibility: on a machine other than the proxy's (a Ray node), stand in for the proxy's agent
Unix socket. Bubblewrap sandboxes there get this socket bound in, exactly as they get the
proxy's own socket on the proxy's machine, and their in-namespace forwarder
(`sandbox/forward.py`) relays to it; every connection accepted here is relayed, byte for byte,
to `host:port` (the agents listener, never the admin listener). The sandboxes' network
namespace stays without any route: this relay, outside it, is their only way out.

The socket is created mode 0600 in a fresh 0700 directory (like the proxy's own), removed by
`aclose()`.

What it deliberately does not do: inspect, buffer beyond one chunk, or limit the bytes (the
proxy does that), or reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

_CHUNK = 1 << 16


class TcpRelay:
    """`await TcpRelay.start(host, port)`: a Unix socket at `.socket_path` relaying to `host:port`."""

    def __init__(self, host: str, port: int, directory: Path, server: asyncio.base_events.Server) -> None:
        self.host = host
        self.port = port
        self._dir = directory
        self._server = server
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def socket_path(self) -> Path:
        return self._dir / "agent.sock"

    @classmethod
    async def start(cls, host: str, port: int) -> TcpRelay:
        """Listen on a new Unix socket; raises OSError when it cannot be created, ValueError for
        a port outside 1-65535."""
        if not 0 < port < 65536:
            raise ValueError(f"relay upstream port {port} is not in 1-65535")
        directory = Path(tempfile.mkdtemp(prefix="harnessrl-relay-"))
        relay: TcpRelay | None = None

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert relay is not None
            task = asyncio.current_task()
            assert task is not None
            relay._conns.add(task)
            try:
                await relay._relay(reader, writer)
            finally:
                relay._conns.discard(task)

        try:
            server = await asyncio.start_unix_server(on_client, path=str(directory / "agent.sock"), backlog=512)
            os.chmod(directory / "agent.sock", 0o600)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        relay = cls(host, port, directory, server)
        return relay

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    async def aclose(self) -> None:
        """Stop accepting, cut the open connections, remove the socket; idempotent."""
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)
        shutil.rmtree(self._dir, ignore_errors=True)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    with contextlib.suppress(OSError):
        if dst.can_write_eof():
            dst.write_eof()

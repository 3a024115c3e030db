"""`engine/vllm/http.py`'s keep-alive pool and `validate.loads_reply`'s echo check, against raw
asyncio servers on loopback: a connection is reused across calls; a server that closes its
connections (after an answer, idle, or with `Connection: close`) costs nothing but a fresh
connection; a chunked answer is read whole; an answer cut short, a non-HTTP answer and a
deadline are errors. An echo of exactly the prompt sent is checked byte for byte and not
decoded; any other echo is decoded and compared as before."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson
import pytest

from harnessrl.engine.vllm.http import HttpPool, ResponseCutShort
from harnessrl.engine.vllm.validate import loads_reply, parse_completion
from harnessrl.errors import EngineError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server running `handler` per connection; (server, base URL, connection counter)."""
    connections = [0]

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def _answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b" % (
        len(body), extra, body)


def _echo(requests: int | None = None, extra: bytes = b"") -> Handler:
    """Answers each request with its own body, `requests` per connection (None: until EOF)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while requests is None or served < requests:
            try:
                body = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if body is None:
                return
            writer.write(_answer(body, extra))
            await writer.drain()
            served += 1
    return handler


def _pool(url: str, timeout_s: float = 5.0) -> HttpPool:
    return HttpPool(url, max_connections=8, timeout_s=timeout_s, keepalive_s=3.0)


async def test_sequential_calls_share_one_connection() -> None:
    server, url, connections = await _serve(_echo())
    pool = _pool(url)
    for i in range(5):
        assert await pool.post("/v1/completions", b'{"n":%d}' % i) == (200, b'{"n":%d}' % i)
    assert connections[0] == 1
    pool.close()
    server.close()


@pytest.mark.parametrize("extra", [b"", b"connection: close\r\n"])
async def test_a_server_closing_after_each_answer_costs_a_fresh_connection(extra: bytes) -> None:
    server, url, connections = await _serve(_echo(requests=1, extra=extra))
    pool = _pool(url)
    for i in range(4):
        assert await pool.post("/v1/completions", b"[%d]" % i) == (200, b"[%d]" % i)
        if i == 1:
            await asyncio.sleep(0.05)  # the close is seen before the next call
    assert connections[0] == 4
    pool.close()
    server.close()


async def test_an_idle_connection_past_keepalive_is_not_reused() -> None:
    server, url, connections = await _serve(_echo())
    pool = HttpPool(url, max_connections=8, timeout_s=5.0, keepalive_s=0.05)
    await pool.post("/v1/completions", b"1")
    await asyncio.sleep(0.1)
    await pool.post("/v1/completions", b"2")
    assert connections[0] == 2
    pool.close()
    server.close()


async def test_a_chunked_answer_is_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server, url, _ = await _serve(handler)
    pool = _pool(url)
    assert await pool.post("/v1/completions", b"{}") == (200, b'{"a":1}')
    pool.close()
    server.close()


async def test_an_answer_cut_short_not_http_or_late_is_an_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"choices\":")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"<html>not http</html>\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    for handler, error in ((cut, ResponseCutShort), (garbage, ResponseCutShort), (silent, TimeoutError)):
        server, url, _ = await _serve(handler)
        pool = _pool(url, timeout_s=0.3)
        with pytest.raises(error):
            await pool.post("/v1/completions", b"{}")
        pool.close()
        server.close()


async def test_a_refused_connection_is_an_oserror() -> None:
    server, url, _ = await _serve(_echo())
    server.close()
    await server.wait_closed()
    with pytest.raises(OSError):
        await _pool(url).post("/v1/completions", b"{}")


def _reply(echo: bytes) -> bytes:
    return (b'{"choices":[{"index":0,"text":"x","token_ids":[7,8],"prompt_token_ids":' + echo +
            b',"logprobs":{"token_logprobs":[-0.5,-0.25],"tokens":["token_id:7","token_id:8"]},'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}')


def test_an_echo_of_the_prompt_sent_is_checked_without_decoding_it() -> None:
    prompt = [1, 2, 3]
    sent = orjson.dumps(prompt)
    body = loads_reply("u", _reply(b"[1,2,3]"), sent)
    assert "prompt_token_ids" not in body["choices"][0]
    assert parse_completion(body, prompt, 4) == ([7, 8], [-0.5, -0.25], "stop")
    # other forms are decoded and compared as before: spaces pass, other ids fail
    spaced = loads_reply("u", _reply(b"[1, 2, 3]"), sent)
    assert spaced["choices"][0]["prompt_token_ids"] == prompt and parse_completion(spaced, prompt, 4)[0] == [7, 8]
    for wrong in (b"[1,2]", b"[1,2,3,4]", b"[1,2,4]"):
        with pytest.raises(EngineError, match="prompt_token_ids differ"):
            parse_completion(loads_reply("u", _reply(wrong), sent), prompt, 4)
    # the prompt's bytes under a key of another object are not taken for the echo
    elsewhere = _reply(b"[9]").replace(b'"usage":{', b'"usage":{"a\\"prompt_token_ids":[1,2,3],')
    with pytest.raises(EngineError, match="prompt_token_ids differ"):
        parse_completion(loads_reply("u", elsewhere, sent), prompt, 4)


async def test_each_request_on_a_kept_connection_has_its_own_deadline() -> None:
    """A request on a kept connection is held to its own deadline, not an earlier request's,
    and a request the server leaves unanswered past its own deadline times out and drops the
    connection."""
    delays = iter([0.15, 0.2, 10.0, 0.0])

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await _read_request(reader)) is not None:
            await asyncio.sleep(next(delays))
            writer.write(_answer(body))
            await writer.drain()

    server, url, connections = await _serve(slow)
    pool = _pool(url, timeout_s=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await pool.post("/v1/completions", b"1") == (200, b"1")  # deadline t0 + 0.3, answered at ~0.15
    # sent at ~0.15, answered at ~0.35: past the first request's deadline, within its own
    assert await pool.post("/v1/completions", b"2") == (200, b"2")
    assert loop.time() - t0 > 0.3 and connections[0] == 1
    t1 = loop.time()
    with pytest.raises(TimeoutError):
        await pool.post("/v1/completions", b"3")
    assert 0.25 < loop.time() - t1 < 2.0
    assert await pool.post("/v1/completions", b"4") == (200, b"4")  # the timed-out connection is not reused
    assert connections[0] == 2
    pool.close()
    server.close()

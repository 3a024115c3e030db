"""The proxy's bounds on what one agent may make it hold or compute, on the real server over
real HTTP (loopback TCP or its Unix socket) with the real chat layer and SmolLM2 tokenizer:
stop lists and the other list fields a call's CPU grows with, the fields the proxy ignores
(never recorded), request bytes per session, memory left by refused calls, and connections
per peer, per session and in all."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.server import ProxyServer

USER = [{"role": "user", "content": "hi"}]


@contextlib.asynccontextmanager
async def served(tokenizer, engine: FakeEngine | None = None, **config: object
                 ) -> AsyncIterator[tuple[ProxyServer, httpx.AsyncClient]]:
    async with ProxyServer(engine or FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0, **config)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url.removesuffix("/v1"), timeout=60) as http:
            yield proxy, http


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- stop lists and list fields


def _stop_body(path: str, stop: object) -> dict:
    if path == "/v1/messages":
        return {"model": "m", "max_tokens": 5, "messages": USER, "stop_sequences": stop}
    if path.startswith("/v1beta"):
        return {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"stopSequences": stop}}
    return {"model": "m", "messages": USER, "stop": stop}


ROUTES = [("/v1/chat/completions", "stop"), ("/v1/messages", "stop_sequences"),
          ("/v1beta/models/m:generateContent", "generationConfig.stopSequences")]


@pytest.mark.parametrize(("path", "field"), ROUTES)
async def test_stop_lists_are_capped_naming_the_field(tokenizer, path, field):
    engine = FakeEngine()
    async with served(tokenizer, engine) as (proxy, http):
        _, key = proxy.open_session("stop")
        headers = auth(key) | {"x-goog-api-key": key}
        fits = await http.post(path, json=_stop_body(path, [f"s{i:03d}" + "x" * 252 for i in range(16)]),
                               headers=headers)
        many = await http.post(path, json=_stop_body(path, [f"stop {i}" for i in range(500_000)]), headers=headers)
        long = await http.post(path, json=_stop_body(path, ["é" * 129]), headers=headers)  # 258 bytes
    assert fits.status_code == 200, fits.text
    assert many.status_code == long.status_code == 400
    assert field in many.text and "500000 strings" in many.text and "max_stop_strings" in many.text
    assert field in long.text and "258 bytes" in long.text and "max_stop_bytes" in long.text
    assert len(engine.calls) == 1  # neither refused list reached the engine
    assert len(engine.calls[0][1].stop) == 16


async def test_stop_limits_are_knobs(tokenizer):
    async with served(tokenizer, max_stop_strings=2, max_stop_bytes=4) as (proxy, http):
        _, key = proxy.open_session("stop")
        codes = [(await http.post("/v1/chat/completions", json={"messages": USER, "stop": stop},
                                  headers=auth(key))).status_code
                 for stop in (["a", "b"], ["a", "b", "c"], ["abcd"], ["abcde"])]
    assert codes == [200, 400, 200, 400]


def _call(i: int) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}


def _tool(name: str, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("body", "param", "knob"), [
    ({"messages": USER * 9}, "messages", "max_messages"),
    ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [_call(i) for i in range(5)]}]},
     "messages[1].tool_calls", "max_tool_calls_per_message"),
    ({"messages": USER, "tools": [_tool(f"t{i}") for i in range(5)]}, "tools", "max_tools"),
    ({"messages": USER, "tools": [_tool("t", "d" * 3000)]}, "tools", "max_tools_bytes"),
])
async def test_list_fields_that_drive_cpu_are_bounded(tokenizer, body, param, knob):
    engine = FakeEngine()
    limits = {"max_messages": 8, "max_tool_calls_per_message": 4, "max_tools": 4, "max_tools_bytes": 2048}
    async with served(tokenizer, engine, **limits) as (proxy, http):
        session_id, key = proxy.open_session("lists")
        refused = await http.post("/v1/chat/completions", json=body, headers=auth(key))
        # at the bound itself the call is served
        at = json.loads(json.dumps(body))
        if knob == "max_messages":
            at["messages"] = USER * 8
        elif knob == "max_tool_calls_per_message":
            at["messages"][1]["tool_calls"] = at["messages"][1]["tool_calls"][:4]
        elif knob == "max_tools":
            at["tools"] = at["tools"][:4]
        else:
            at["tools"] = [_tool("t", "d" * 1000)]
        served_ok = await http.post("/v1/chat/completions", json=at, headers=auth(key))
        trace = proxy.close_session(session_id)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert knob in refused.json()["error"]["message"]
    assert served_ok.status_code == 200, served_ok.text
    assert [t.status for t in trace.turns] == ["error", "ok"] and len(engine.calls) == 1


# ---------------------------------------------------------------- what a turn keeps


async def test_fields_the_proxy_ignores_are_not_recorded(tokenizer, tmp_path: Path):
    big = "u" * (2 * 1024 * 1024)
    calls = [("/v1/chat/completions", {"model": "m", "messages": [
                 {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "refusal": big},
                 {"role": "user", "content": "more"}], "user": big, "metadata": {"x": big}}),
             ("/v1/responses", {"model": "m", "input": "hi", "user": big, "prompt_cache_key": big,
                                "metadata": {"x": big}}),  # metadata is echoed by the API: not here
             ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": USER, "metadata": {"user_id": big}}),
             ("/v1beta/models/m:generateContent", {"contents": [{"parts": [{"text": "hi"}]}], "labels": {"x": big}})]
    async with served(tokenizer, trace_path=tmp_path / "traces.jsonl") as (proxy, http):
        session_id, key = proxy.open_session("ignored")
        codes = [(await http.post(path, json=body, headers=auth(key) | {"x-goog-api-key": key})).status_code
                 for path, body in calls]
        trace = proxy.close_session(session_id)
    assert codes == [200, 200, 200, 200]
    line = (tmp_path / "traces.jsonl").read_bytes()
    assert len(line) < 100_000 and b"uuuuuuuu" not in line  # four calls of >= 2 MiB each, none of it kept
    chat, responses, messages, google = trace.turns
    assert [t.status for t in trace.turns] == ["ok"] * 4
    assert "user" not in chat.request and "metadata" not in chat.request
    assert chat.request["messages"][1] == {"role": "assistant", "content": "ok"}
    assert responses.raw_request == {"model": "m", "input": "hi"} and responses.raw_response["metadata"] == {}
    assert "metadata" not in messages.raw_request and messages.raw_request["max_tokens"] == 5
    assert "labels" not in google.raw_request


async def test_fields_the_template_never_renders_are_not_recorded(tokenizer, tmp_path: Path):
    """Attack: 6 MiB of `reasoning_content` and a 1 MiB message `name` per call, fields SmolLM2's
    template never renders. They made every call's turn 7 MiB and one `rollouts.jsonl` line 74 MB;
    now the turn keeps the messages without them (the prompt ids are the same either way)."""
    huge, name = "r" * (6 * 1024 * 1024), "n" * (1024 * 1024)
    messages = [{"role": "user", "content": "hi", "name": name},
                {"role": "assistant", "content": "ok", "reasoning_content": huge},
                {"role": "user", "content": "more"}]
    chat = ChatLayer(tokenizer)
    assert {"reasoning_content", "reasoning", "name", "tool_call_id"} <= chat.unrendered_message_keys
    async with served(tokenizer, trace_path=tmp_path / "traces.jsonl") as (proxy, http):
        session_id, key = proxy.open_session("unrendered")
        replies = [await http.post("/v1/chat/completions", json={"model": "m", "messages": messages},
                                   headers=auth(key)) for _ in range(2)]
        plain = await http.post("/v1/chat/completions", headers=auth(key), json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]})
        trace = proxy.close_session(session_id)
    assert [r.status_code for r in replies] == [200, 200] and plain.status_code == 200
    line = (tmp_path / "traces.jsonl").read_bytes()
    assert len(line) < 100_000 and b"rrrrrrrr" not in line and b"nnnnnnnn" not in line
    first, _, third = trace.turns
    assert first.request["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                                         {"role": "user", "content": "more"}]
    assert first.prompt_ids == third.prompt_ids  # what was dropped was never in the prompt


def test_keys_a_template_renders_are_recorded() -> None:
    from harnessrl.chat.layer import unrendered_message_keys

    native = "{% for message in messages %}{{ message['name'] }}{{ message.tool_call_id }}{% endfor %}{{ tools }}"
    assert unrendered_message_keys(native, has_tools=True, has_reasoning=True) == frozenset()
    assert unrendered_message_keys(native, has_tools=False, has_reasoning=False) == frozenset(
        {"reasoning_content", "reasoning", "name", "tool_call_id"})
    tool_name_only = "{% for message in messages %}{{ tool_call.function.name }}{% endfor %}{{ tools }}"
    assert "name" in unrendered_message_keys(tool_name_only, has_tools=True, has_reasoning=True)


async def test_headers_are_bounded_and_recorded_cut(tokenizer):
    """Headers are outside max_body_bytes: a header section past max_header_bytes gets 431, and a
    recorded header value is cut to RECORDED_HEADER_CHARS."""
    from harnessrl.proxy.capture import RECORDED_HEADER_CHARS

    async with served(tokenizer) as (proxy, http):
        session_id, key = proxy.open_session("headers")
        ok = await http.post("/v1/chat/completions", json={"messages": USER},
                             headers=auth(key) | {"user-agent": "u" * 20_000, "x-session-id": "s" * 100})
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + key.encode()
                     + b"\r\nuser-agent: " + b"u" * 80_000 + b"\r\ncontent-length: 2\r\n\r\n{}")
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        # one header that never ends: cut off by the bytes buffered, not by the read timeout
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nuser-agent: ")
        try:  # 1 MiB of one header value: the proxy answers 431 and closes (reset under our writes)
            for _ in range(64):
                writer.write(b"u" * 16_384)
                await writer.drain()
                await asyncio.sleep(0.01)
            endless = await asyncio.wait_for(reader.read(), 20)
        except ConnectionError:
            endless = b"HTTP/1.1 431 (reset while sending)"
        writer.close()
        trace = proxy.close_session(session_id)
    assert ok.status_code == 200
    assert answer.startswith(b"HTTP/1.1 431 ") and b"max_header_bytes=65536" in answer
    assert endless.startswith(b"HTTP/1.1 431 ")
    assert len(trace.turns) == 1, [t.error for t in trace.turns]  # the refused request never became a turn
    turn = trace.turns[0]
    assert turn.headers["x-session-id"] == "s" * 100
    assert turn.headers["user-agent"] == "u" * RECORDED_HEADER_CHARS + "…[20000 chars]"


async def test_a_session_has_a_request_byte_budget(tokenizer):
    content = "word " * 4_000
    async with served(tokenizer, max_session_body_bytes=64 * 1024) as (proxy, http):
        (flood_id, flood), (other_id, other) = proxy.open_session("flood"), proxy.open_session("other")
        codes = [(await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]},
                                  headers=auth(flood))).status_code for _ in range(5)]
        sibling = await http.post("/v1/chat/completions", json={"messages": USER}, headers=auth(other))
        refused = await http.post("/v1/messages", json={"max_tokens": 5, "messages": [
            {"role": "user", "content": content}]}, headers=auth(flood))
        flood_trace, other_trace = proxy.close_session(flood_id), proxy.close_session(other_id)
    assert codes == [200, 200, 200, 413, 413]
    assert refused.status_code == 413 and "max_session_body_bytes=65536" in refused.text
    assert sibling.status_code == 200
    assert len(flood_trace.turns) == 3 and flood_trace.refused_calls == 3
    assert len(other_trace.turns) == 1 and other_trace.refused_calls == 0


async def test_refused_calls_leave_no_memory_behind(tokenizer):
    """Calls replaying a 1 MiB tool call, each refused (its prompt exceeds the context): what
    they leave allocated once answered (tracemalloc, after a collection) is a small fraction of
    what they sent."""
    engine = FakeEngine(max_context_tokens=4096)
    # no call budget: a prompt past the context is refused (400), not answered with a final stop
    async with served(tokenizer, engine, max_model_calls=0) as (proxy, http):
        session_id, key = proxy.open_session("rejected")

        async def call(i: int, size: int) -> int:
            args = json.dumps({"cmd": f"{i:06d}" + "a" * size})
            body = {"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
            return (await http.post("/v1/chat/completions", json=body, headers=auth(key))).status_code

        assert await call(0, 10) == 200  # warm: the template, the tokenizer's own caches
        assert await call(1, 1024 * 1024) == 400
        tracemalloc.start()
        try:
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            codes = [await call(i, 1024 * 1024) for i in range(2, 8)]
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        proxy.close_session(session_id)
    assert codes == [400] * 6
    assert kept < 1024 * 1024, f"{kept} bytes kept after 6 refused calls of 1 MiB each"


# ---------------------------------------------------------------- connections


FLOOD = textwrap.dedent("""
    import socket, sys, time
    path, n, kept = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.setblocking(False)
        held.append(s)
    closed, settled = set(), False
    deadline = time.monotonic() + 30
    while True:  # the proxy closes the ones past the cap: they read EOF
        for i, s in enumerate(held):
            if i not in closed:
                try:
                    if s.recv(1) == b"":
                        closed.add(i)
                except BlockingIOError:
                    pass
        if len(closed) >= n - kept and settled or time.monotonic() > deadline:
            break
        settled = len(closed) >= n - kept
        time.sleep(0.5)
    print(len(closed), flush=True)
    sys.stdin.read()  # hold the connections until the test is done
""")


def _unix_call(path: Path, key: str) -> tuple[int, bytes]:
    body = json.dumps({"messages": USER}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + key.encode() + b"\r\nconnection: close\r\ncontent-length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return (int(data.split(b" ", 2)[1]) if data else 0), data


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED and PID namespaces are Linux's")
async def test_a_flooding_peer_is_refused_and_its_siblings_are_served(tokenizer):
    """A process in a PID namespace of its own (as a sandboxed agent is) opens 300 connections
    to the proxy's Unix socket; past `max_connections_per_peer` they are closed, and a call from
    another peer on the same socket is answered."""
    unshare = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "true"],
                             capture_output=True)
    if unshare.returncode != 0:
        pytest.skip(f"unshare cannot make a PID namespace here: {unshare.stderr.decode()[:200]}")
    async with served(tokenizer, max_connections_per_peer=32, max_connections=200) as (proxy, http):
        session_id, key = proxy.open_session("sibling")
        flood = await asyncio.create_subprocess_exec(
            "unshare", "--user", "--map-root-user", "--pid", "--fork", sys.executable, "-c", FLOOD,
            str(proxy.agent_socket_path), "300", "32", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        try:
            assert flood.stdout is not None
            closed = int(await asyncio.wait_for(flood.stdout.readline(), 60))
            status, reply = await asyncio.to_thread(_unix_call, proxy.agent_socket_path, key)
            open_now = proxy.open_connections
        finally:
            assert flood.stdin is not None
            flood.stdin.close()
            await flood.wait()
        trace = proxy.close_session(session_id)
    assert closed == 300 - 32  # the peer keeps its cap, no more
    assert status == 200, reply[-300:]
    assert [t.status for t in trace.turns] == ["ok"]
    assert open_now["total"] <= 33 and open_now["refused"] >= 300 - 32


async def test_connections_in_all_stay_below_the_descriptor_limit(tokenizer):
    """The global cap is kept below the process's descriptor limit, and past it a new
    connection is closed at once (the proxy, the loop and the sibling listeners keep working)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with served(tokenizer, max_connections=10**6) as (proxy, http):
        assert proxy.connection_limits.max_total < soft
    async with served(tokenizer, max_connections=20, max_connections_per_peer=1000) as (proxy, http):
        _, key = proxy.open_session("tcp")
        held = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(40)]
        reads = [asyncio.ensure_future(reader.read(1)) for reader, _ in held]
        for _ in range(100):  # until the proxy closed the 20 past the cap (EOF), then a little more
            await asyncio.sleep(0.1)
            if sum(r.done() for r in reads) >= 20:
                break
        await asyncio.sleep(0.5)
        eof = sum(r.done() and r.result() == b"" for r in reads)
        for (_, writer), read in zip(held, reads, strict=True):
            if not read.done():
                writer.close()
                read.cancel()
        await asyncio.sleep(0.3)
        ok = await http.post("/v1/chat/completions", json={"messages": USER}, headers=auth(key))
        for _, writer in held:
            writer.close()
    assert eof == 20
    assert ok.status_code == 200


async def test_a_session_holds_a_bounded_number_of_calls_at_once(tokenizer):
    engine = FakeEngine(delay_s=1.0)
    async with served(tokenizer, engine, max_concurrent_calls_per_session=3) as (proxy, http):
        (flood_id, flood), (_, other) = proxy.open_session("flood"), proxy.open_session("other")
        async with httpx.AsyncClient(base_url=proxy.base_url.removesuffix("/v1"), timeout=60) as many:
            calls = [many.post("/v1/chat/completions", json={"messages": USER}, headers=auth(flood))
                     for _ in range(6)]
            calls.append(many.post("/v1/chat/completions", json={"messages": USER}, headers=auth(other)))
            replies = await asyncio.gather(*calls)
        trace = proxy.close_session(flood_id)
    codes = [r.status_code for r in replies]
    assert sorted(codes[:6]) == [200, 200, 200, 429, 429, 429]
    assert "max_concurrent_calls_per_session=3" in next(r.text for r in replies if r.status_code == 429)
    assert codes[6] == 200
    assert len(trace.turns) == 3 and trace.refused_calls == 3


class _Transport:
    """The two extras `ConnectionLimits.admit` reads of an accepted connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> object:
        return {"socket": self.sock, "sockname": self.sock.getsockname()}[name]


def _accept_from(tmp_path: Path, code: str) -> list[socket.socket]:
    """Connections to a fresh Unix socket made by a child Python running `code` (with `path`
    bound), accepted only after that child has exited."""
    path = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    child = subprocess.run([sys.executable, "-c", f"import os, socket, sys, time\npath = {path!r}\n" + code],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    listener.setblocking(False)
    accepted = []
    with contextlib.suppress(BlockingIOError):
        while True:
            accepted.append(listener.accept()[0])
    listener.close()
    return accepted


# Children that connect and exit while their parent keeps the sockets: every connection's
# credentials name a process that is gone by the time the proxy accepts it.
_CONNECT_AND_EXIT = textwrap.dedent("""
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(6)]
    for s in socks:
        pid = os.fork()
        if pid == 0:
            s.connect(path)
            os._exit(0)
        os.waitpid(pid, 0)
    fds = [s.detach() for s in socks]
    sys.stdout.write(str(len(fds)))
""")


def test_connections_of_exited_children_get_no_second_share(tmp_path: Path) -> None:
    """Children that connect to the socket and exit, their parent keeping the sockets, cannot be
    attributed to a peer once gone: they are refused, never counted under a fallback key
    (before: under `uid:<uid>`, a second bucket of `max_per_peer`, 128 held against 64)."""
    from harnessrl.proxy.httpguard import ConnectionLimits, unix_peer

    accepted = _accept_from(tmp_path, _CONNECT_AND_EXIT)
    assert len(accepted) == 6
    limits = ConnectionLimits(max_total=100, max_per_peer=4)
    try:
        assert [unix_peer(s) for s in accepted] == [None] * 6
        assert [limits.admit(_Transport(s)) for s in accepted] == [(False, None)] * 6
        assert limits.snapshot() == {"total": 0, "peers": 0, "refused": 6}
    finally:
        for s in accepted:
            s.close()


def test_a_live_peer_is_counted_by_its_pid_namespace_up_to_its_share(tmp_path: Path) -> None:
    """A live process of this uid is counted under its PID namespace, and past `max_per_peer`
    its further connections are refused."""
    from harnessrl.proxy.httpguard import ConnectionLimits, unix_peer

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(8)
    clients, accepted = [], []
    try:
        for _ in range(6):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(tmp_path / "s"))
            clients.append(c)
            accepted.append(listener.accept()[0])
        peer = unix_peer(accepted[0])
        assert peer is not None and peer.startswith("pidns:")
        limits = ConnectionLimits(max_total=100, max_per_peer=4)
        assert [limits.admit(_Transport(s))[0] for s in accepted] == [True] * 4 + [False] * 2
        assert limits.snapshot() == {"total": 4, "peers": 1, "refused": 2}
    finally:
        for s in clients + accepted:
            s.close()
        listener.close()

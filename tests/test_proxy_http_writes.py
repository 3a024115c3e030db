"""The proxy's guarded HTTP protocol puts the same bytes on the wire as uvicorn's own protocol;
the proxy's JSON answers and shared sampling give what the general code gives."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvicorn
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from harnessrl.proxy.httpguard import guarded_httptools

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class _Transport:
    """What a protocol writes, one entry per `write` call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _exchange(protocol_class: type, app: App, *requests: bytes) -> _Transport:
    """Feed each of `requests` to a fresh connection of `protocol_class` serving `app`, the next
    once the one before is answered; return its transport (the date header is off, so the bytes
    are comparable)."""
    config = uvicorn.Config(app, http=protocol_class, log_level="warning", access_log=False, lifespan="off",
                            server_header=False, date_header=False, interface="asgi3")
    config.load()
    state = ServerState()
    protocol = protocol_class(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)
    for request in requests:
        protocol.data_received(request)
        while protocol.tasks:  # a pipelined request's task starts once the one before it answered
            await asyncio.gather(*list(protocol.tasks))
    protocol.connection_lost(None)
    return transport


def _post(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + extra
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _unary(scope: dict[str, Any], receive: Any, send: Any) -> None:
    message = await receive()
    body = b'{"echo": ' + str(len(message["body"])).encode() + b"}"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def _streamed(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for part in (b"data: 1\n\n", b"data: 2\n\n"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _head_only(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()  # starts the response and returns without a body (uvicorn closes the connection)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})


@pytest.mark.parametrize("app,extra", [(_unary, b""), (_unary, b"expect: 100-continue\r\n"), (_streamed, b""),
                                       (_head_only, b"")], ids=["unary", "100-continue", "stream", "head-only"])
async def test_same_writes_as_uvicorn(app: App, extra: bytes) -> None:
    request = _post(b'{"messages": []}', extra)
    plain = await _exchange(HttpToolsProtocol, app, request)
    guarded = await _exchange(guarded_httptools(30.0), app, request)
    assert guarded.writes == plain.writes and guarded.closed == plain.closed
    assert b"".join(plain.writes).startswith(b"HTTP/1.1 100 Continue\r\n\r\n" if extra else b"HTTP/1.1 200 OK\r\n")
    if app is _unary:
        assert guarded.writes[-1] == b'{"echo": 16}'
    elif app is _streamed:  # the head, then each chunk
        assert len(guarded.writes) == 4 and guarded.writes[1] == b"9\r\ndata: 1\n\n\r\n"


async def test_a_head_request_gets_its_head() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # what Starlette does for HEAD
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"12")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    request = b"HEAD /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    plain = await _exchange(HttpToolsProtocol, app, request)
    guarded = await _exchange(guarded_httptools(30.0), app, request)
    assert guarded.writes == plain.writes and len(plain.writes) == 1  # no body on the wire, the head alone
    assert plain.writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and plain.writes[0].endswith(b"content-length: 12\r\n\r\n")


async def test_keep_alive_and_pipelined_requests_as_uvicorn_answers_them() -> None:
    body = b'{"messages": [1, 2, 3]}'
    plain = await _exchange(HttpToolsProtocol, _unary, _post(body), _post(body), _post(body))
    guarded = await _exchange(guarded_httptools(30.0), _unary, _post(body), _post(body), _post(body))
    assert guarded.writes == plain.writes and b"".join(guarded.writes).count(b'{"echo": 23}') == 3
    pipelined = _post(body) + _post(b'{"messages": []}')  # sent before the first was answered
    plain = await _exchange(HttpToolsProtocol, _unary, pipelined)
    guarded = await _exchange(guarded_httptools(30.0), _unary, pipelined)
    assert b"".join(guarded.writes) == b"".join(plain.writes)
    assert b"".join(plain.writes).count(b"HTTP/1.1 200 OK") == 2 and b"".join(plain.writes).endswith(b'{"echo": 16}')


@pytest.mark.parametrize("status", [200, 400, 401, 404, 413, 429, 500, 503])
def test_json_response_has_starlettes_headers(status: int) -> None:
    from harnessrl.proxy.app import json_response

    body = {"error": {"message": "x", "type": "invalid_request_error", "param": None, "code": None}}
    fast = json_response(status, body)
    slow = Response(content=fast.body, status_code=status, media_type="application/json")
    assert fast.status_code == slow.status_code == status
    assert fast.body == slow.body == b'{"error":{"message":"x","type":"invalid_request_error","param":null,"code":null}}'
    assert fast.raw_headers == slow.raw_headers and fast.headers == slow.headers and fast.background is None


def test_sampling_is_shared_per_distinct_values() -> None:
    from harnessrl.proxy.capture import resolve_sampling
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.wire import parse_chat_request

    enforced = ProxyConfig(sampling=SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, max_tokens=64))
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"], "seed": 3,
                                  "temperature": 0.2})
    a, b = resolve_sampling(enforced, request, 100, 1000), resolve_sampling(enforced, request, 100, 1000)
    assert a is b and (a.temperature, a.top_p, a.top_k, a.max_tokens, a.stop, a.seed) == (0.7, 0.9, 5, 64, ("x",), None)
    near_end = resolve_sampling(enforced, request, 990, 1000)  # the context left caps it: another instance
    assert near_end is not a and near_end.max_tokens == 10 and near_end.stop == ("x",)
    agent = resolve_sampling(ProxyConfig(enforce_sampling=False, sampling=SamplingConfig(max_tokens=1024)), request, 100, 1000)
    assert (agent.temperature, agent.seed, agent.max_tokens) == (0.2, 3, 900)
    with pytest.raises(Exception, match="frozen"):
        a.max_tokens = 1  # type: ignore[misc]  # shared instances cannot be changed by one turn


def test_serving_process_freezes_its_heap_once_listening(tokenizer) -> None:  # noqa: ANN001
    from fakes import FakeEngine
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer, run_loop

    chat = ChatLayer(tokenizer)

    async def start_and_count() -> int:
        async with ProxyServer(FakeEngine(completion_ids=[5]), chat, ProxyConfig(port=0)):
            return gc.get_freeze_count()

    gc.unfreeze()  # whatever an earlier test's serving loop froze
    try:
        assert asyncio.run(start_and_count()) == 0  # not a serving process: nothing frozen
        frozen = run_loop(start_and_count())
        assert frozen > 10_000  # modules, tokenizer, this test run's objects
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("prompt,completion,why", [
    ([1, 2, 3], [4, 5], None),
    ([1, -2, 3], [4, 5], "token id -2 at position 1 is negative"),
    ([1, 2], [4, -1], "token id -1 at position 3 is negative"),
    ([1, 2**70], [4, 5], None),  # too large for the array fast path: the exact loop decides
    ([1, 2], [True, 5], None),
])
def test_turn_faithfulness_of_ids(prompt: list[int], completion: list[int], why: str | None) -> None:
    from harnessrl.types import Turn, check_turn_faithful

    turn = Turn(turn_index=0, request={}, prompt_ids=[0], completion_ids=[0, 0], completion_logprobs=[-0.5, -0.25])
    turn.prompt_ids, turn.completion_ids = prompt, completion  # as an engine might have returned them
    assert check_turn_faithful(turn) == why
    turn.completion_logprobs = [-0.5, float("nan")]
    assert check_turn_faithful(turn) == "completion_logprobs[1]=nan is not a finite value in [-745.0, 0]"

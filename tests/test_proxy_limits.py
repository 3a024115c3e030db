"""The proxy's limits against hostile input: nesting depth, type checks, truncated error
bodies, bounded session memory, calls in flight at close, unserialisable and non-finite
turns, read timeouts (raw sockets on loopback), and the engine's temperature bounds."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import pytest

from fakes import FakeEngine, in_process
from harnessrl.engine.embedded import request as engine_request
from harnessrl.chat.layer import ChatLayer
from harnessrl.errors import ConfigError, EngineError
from harnessrl.proxy.capture import REJECTED_BODY_CHARS
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.proxy.sessions import SessionStore, read_traces
from harnessrl.types import Rollout, Sampling, Trace, Turn, check_turn_faithful

USER = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER, "metadata": {"x": nested(300)}}),
    ("/v1/responses", {"input": "hi", "metadata": {"x": nested(300)}}),
    ("/v1/messages", {"max_tokens": 5, "messages": USER, "metadata": {"x": nested(300)}}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "metadata": '
     + b"[" * 2000 + b"]" * 2000 + b"}"),  # past orjson's own limit (and any client encoder's)
])
async def test_deep_nesting_is_refused_at_parse_naming_the_limit(tokenizer, path, body):
    http, store = in_process(FakeEngine(), ChatLayer(tokenizer))
    session = store.open("r")
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await http.post(path, content=content, headers=auth(session.key) | {"content-type": "application/json"})
    assert r.status_code == 400
    assert "deeper than 64 levels" in r.text and "max_json_depth=64" in r.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {"x": nested(40)}}}
    ok = await http.post("/v1/chat/completions", json={"messages": USER, "tools": [tool]}, headers=auth(session.key))
    assert ok.status_code == 200
    trace = store.close(session.session_id)
    assert [t.status for t in trace.turns] == ["ok"]  # the refused body never became a turn
    reloaded = Trace.model_validate_json(trace.model_dump_json()).turns[0].request
    assert reloaded["tools"][0]["function"]["parameters"]["x"] == nested(40)


async def test_depth_limit_is_a_config_knob(tokenizer):
    http, store = in_process(FakeEngine(), ChatLayer(tokenizer), max_json_depth=8)
    session = store.open("r")
    r = await http.post("/v1/chat/completions", json={"messages": USER, "metadata": nested(8)},
                        headers=auth(session.key))
    assert r.status_code == 400 and "max_json_depth=8" in r.text
    r = await http.post("/v1/chat/completions", json={"messages": USER, "metadata": nested(6)},
                        headers=auth(session.key))
    assert r.status_code == 200


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": [{"role": [], "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": ["function"]}]}, "tools[0].type"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": []}]}, "tools[0].type"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": {"k": "function"}}]}, "tools[0].type"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": {"x": 1}, "text": "a"}]}]},
     "input[0].content[0].type"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "namespace", "tools": []}]}, "tools[0].name"),
    ("/v1/responses", {"input": [{"role": ["user"], "content": "a"}]}, "input[0].role"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": [], "content": "x"}]}, "messages[0].role"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": []}]}]},
     "messages[0].content[0].type"),
])
async def test_wrong_types_get_400_naming_the_field_and_are_recorded(tokenizer, path, body, field):
    http, store = in_process(FakeEngine(), ChatLayer(tokenizer))
    session = store.open("r")
    for _ in range(2):
        r = await http.post(path, json=body, headers=auth(session.key))
        assert r.status_code == 400, r.text
        assert field in r.text
    ok = await http.post("/v1/chat/completions", json={"messages": USER}, headers=auth(session.key))
    assert ok.status_code == 200
    trace = store.close(session.session_id)
    assert [t.turn_index for t in trace.turns] == [0, 1, 2]
    assert [t.status for t in trace.turns] == ["error", "error", "ok"]
    assert field in (trace.turns[0].error or "")


async def test_a_rejected_call_keeps_only_a_truncated_body(tokenizer):
    http, store = in_process(FakeEngine(), ChatLayer(tokenizer))
    session = store.open("r")
    big = "x" * 200_000
    for path, body in [("/v1/chat/completions", {"messages": USER, "bogus": big}),
                       ("/v1/responses", {"input": "hi", "bogus": big}),
                       ("/v1/messages", {"max_tokens": 5, "messages": USER, "bogus": big}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "n": 2})]:
        assert (await http.post(path, json=body, headers=auth(session.key))).status_code == 400
    small = {"messages": USER, "n": 3}
    assert (await http.post("/v1/chat/completions", json=small, headers=auth(session.key))).status_code == 400
    turns = store.close(session.session_id).turns
    assert len(turns) == 5 and all(t.status == "error" for t in turns)
    for t in turns[:4]:
        # the body as received: `request` for chat completions, `raw_request` for the other protocols
        # (whose conversion failed, so they have no neutral request)
        kept = t.request if t.protocol == "chat.completions" else t.raw_request
        assert t.protocol == "chat.completions" or t.request == {}
        assert set(kept) == {"truncated_body", "body_bytes"}
        assert len(kept["truncated_body"]) <= REJECTED_BODY_CHARS and kept["body_bytes"] > 200_000
    assert [t.protocol for t in turns[:3]] == ["chat.completions", "responses", "messages"]
    assert turns[4].request == small  # small bodies are kept whole


# ---------------------------------------------------------------- session memory and close


def _ok_turn(index: int) -> Turn:
    return Turn(turn_index=index, request={"messages": USER}, prompt_ids=[1, 2], completion_ids=[3],
                completion_logprobs=[-0.5])


def test_closed_sessions_leave_memory_and_are_served_from_the_trace_file(tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    store = SessionStore(path, max_revoked_keys=3)
    closed = []
    for i in range(5):
        s = store.open(f"r{i}")
        s.record(_ok_turn(0))
        closed.append((s, store.close(s.session_id)))
    assert store.live_sessions == 0 and store.closed_sessions == 3
    first, last = closed[0][0], closed[-1][0]
    assert store.lookup(first.key) is None and not store.known(first.session_id)  # forgotten: 401, uncounted
    for _ in range(2):
        assert store.lookup(last.key) is None
    served = store.trace(last.session_id)
    assert served is not None and served is not closed[-1][1]  # read back from the file, not held
    assert served.rejected_calls == 2 and served.turns[0].completion_ids == [3]
    assert store.close(last.session_id).rejected_calls == 2  # a second close answers the same trace
    assert [t.rollout_id for t in read_traces(path)] == ["r0", "r1", "r2", "r3", "r4"]


def test_without_a_trace_file_only_the_latest_closed_traces_stay(tmp_path: Path):
    store = SessionStore(None, max_closed_traces=2)
    ids = []
    for i in range(4):
        s = store.open(f"r{i}")
        ids.append(s.session_id)
        trace = store.close(s.session_id)
    assert store.trace(ids[0]) is None and store.trace(ids[1]) is None
    assert store.trace(ids[3]) is trace and store.known(ids[0])
    with pytest.raises(KeyError):
        store.close(ids[0])


async def test_a_call_in_flight_at_close_is_answered_401_and_never_appended(tokenizer):
    engine = FakeEngine(delay_s=0.6)
    async with ProxyServer(engine, ChatLayer(tokenizer), ProxyConfig(port=0)) as proxy:
        session_id, key = proxy.open_session("r")
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=10) as client:
            calls = [asyncio.create_task(client.post(path, json=body, headers=auth(key))) for path, body in [
                ("/chat/completions", {"messages": USER}),
                ("/chat/completions", {"messages": USER, "stream": True}),
                ("/responses", {"input": "hi"}),
                ("/messages", {"max_tokens": 5, "messages": USER})]]
            await asyncio.sleep(0.3)
            assert len(engine.calls) == 4
            trace = proxy.close_session(session_id)
            assert trace.turns == []
            answers = await asyncio.gather(*calls)
        assert [a.status_code for a in answers[::2]] == [401, 401]
        assert "closed while this call was in flight" in answers[1].text  # the stream ends in an error event
        assert answers[3].status_code == 401
        assert trace.turns == [] and proxy.store.trace(session_id).turns == []


def test_an_unserialisable_turn_becomes_an_error_turn_and_the_file_reloads(tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    store = SessionStore(path)
    s = store.open("r")
    s.record(Turn(turn_index=0, request={"metadata": nested(300)}, headers={"user-agent": "x"}))
    s.record(_ok_turn(1))
    trace = store.close(s.session_id)
    (back,) = read_traces(path)
    assert back.turns[0].status == "error" and "could not be serialised" in back.turns[0].error
    assert back.turns[0].request == {} and back.turns[0].headers == {"user-agent": "x"}
    assert back.turns[1].completion_ids == [3] and back.turns[1].status == "ok"
    assert Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status="ok",
                   trace=trace).model_dump_json()  # the returned trace serialises too


def test_without_a_trace_file_close_still_returns_a_serialisable_trace():
    store = SessionStore(None)
    s = store.open("r")
    s.record(Turn(turn_index=0, request={"metadata": nested(300)}))
    trace = store.close(s.session_id)
    assert trace.turns[0].status == "error" and trace.turns[0].request == {}
    rollout = Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status="ok", trace=trace)
    assert Rollout.model_validate_json(rollout.model_dump_json()).trace.turns[0].status == "error"


def test_a_torn_last_line_is_skipped_a_torn_middle_line_is_not(tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    store = SessionStore(path)
    for i in range(2):
        store.close(store.open(f"r{i}").session_id)
    whole = path.read_bytes()
    path.write_bytes(whole + whole[: len(whole) // 3])
    assert [t.rollout_id for t in read_traces(path)] == ["r0", "r1"]
    path.write_bytes(whole[: len(whole) // 3] + b"\n" + whole)
    with pytest.raises(ConfigError, match=":1: not a valid trace"):
        read_traces(path)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), -9999.0])
async def test_non_finite_and_sentinel_logprobs_are_flagged_and_every_file_reloads(tokenizer, tmp_path, bad):
    path = tmp_path / "traces.jsonl"
    http, store = in_process(FakeEngine(logprob=bad), ChatLayer(tokenizer))
    store.trace_path = path
    session = store.open("r")
    r = await http.post("/v1/chat/completions", json={"messages": USER, "logprobs": True}, headers=auth(session.key))
    assert r.status_code == 200
    trace = store.close(session.session_id)
    turn = trace.turns[0]
    assert turn.status == "unfaithful" and "completion_logprobs[0]" in turn.error
    (back,) = read_traces(path)
    lp = back.turns[0].completion_logprobs[0]
    assert (math.isnan(lp) if math.isnan(bad) else lp == bad) and back.turns[0].status == "unfaithful"
    rollout = Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status="ok", trace=trace,
                      reward=bad, reward_parts={"x": bad})
    again = Rollout.model_validate_json(rollout.model_dump_json())
    assert len(again.trace.turns[0].completion_logprobs) == 2
    assert check_turn_faithful(again.trace.turns[0]) is not None


def test_the_lowest_real_logprob_is_still_faithful():
    turn = Turn(turn_index=0, request={}, prompt_ids=[1], completion_ids=[2, 3], completion_logprobs=[-103.9, -0.0])
    assert check_turn_faithful(turn) is None


# ---------------------------------------------------------------- read timeouts (raw sockets)


async def _closed_within(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    data = await asyncio.wait_for(reader.read(), limit_s)
    return data, time.perf_counter() - t0


@pytest.fixture
async def slow_proxy(tokenizer):
    config = ProxyConfig(port=0, read_timeout_s=0.5, keepalive_timeout_s=0.5)
    async with ProxyServer(FakeEngine(delay_s=1.0), ChatLayer(tokenizer), config) as proxy:
        yield proxy


async def test_silent_connections_are_closed_with_408(slow_proxy):
    conns = [await asyncio.open_connection("127.0.0.1", slow_proxy.port) for _ in range(64)]
    for reader, writer in conns:
        data, elapsed = await _closed_within(reader, 5.0)
        assert data.startswith(b"HTTP/1.1 408") and b"read_timeout_s=0.5" in data
        writer.close()
    assert elapsed < 5.0


async def test_slow_headers_are_cut_off(slow_proxy):
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_proxy.port)
    line = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 1000
    t0 = time.perf_counter()
    for byte in line:
        if reader.at_eof():
            break
        writer.write(bytes([byte]))
        try:
            await writer.drain()
        except ConnectionError:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the server kept reading a slow header for %.1f s" % (time.perf_counter() - t0))
    assert time.perf_counter() - t0 < 3.0
    writer.close()


async def test_a_partial_body_is_cut_off_and_not_recorded(slow_proxy):
    session_id, key = slow_proxy.open_session("r")
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_proxy.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: 1000\r\n\r\n{\"messages\": [")
    await writer.drain()
    data, elapsed = await _closed_within(reader, 5.0)
    assert elapsed < 3.0 and not data.startswith(b"HTTP/1.1 200")
    writer.close()
    await asyncio.sleep(0.05)
    assert slow_proxy.close_session(session_id).turns == []


async def test_idle_keepalive_is_closed_and_slow_generation_is_not(slow_proxy):
    _, key = slow_proxy.open_session("r")
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_proxy.port)
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)  # generation takes 1.0 s > read timeout
    assert head.startswith(b"HTTP/1.1 200")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
    assert b'"chat.completion"' in await reader.readexactly(length)
    rest, elapsed = await _closed_within(reader, 5.0)
    assert rest == b"" and elapsed < 3.0
    writer.close()


async def test_keep_alive_counts_from_the_last_response(tokenizer):
    config = ProxyConfig(port=0, read_timeout_s=5.0, keepalive_timeout_s=0.4)
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), config) as proxy:
        _, key = proxy.open_session("r")
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                   + b"\r\n\r\n" + body)
        t0 = time.perf_counter()
        for _ in range(5):  # 5 x 0.25 s apart: 1.25 s > keep-alive, but never 0.4 s idle
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            assert head.startswith(b"HTTP/1.1 200") and b'"chat.completion"' in await reader.readexactly(length)
            await asyncio.sleep(0.25)
        assert time.perf_counter() - t0 > 1.2
        rest, elapsed = await _closed_within(reader, 5.0)  # now idle: closed 0.4 s after the last answer
        assert rest == b"" and elapsed < 2.0
        writer.close()


async def test_a_later_request_on_a_kept_alive_connection_gets_its_own_deadline(slow_proxy):
    _, key = slow_proxy.open_session("r")
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_proxy.port)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: ")
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    writer.write(head + str(len(body)).encode() + b"\r\n\r\n" + body)  # answered after 1.0 s (> read timeout)
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    length = int(next(h for h in first.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
    await reader.readexactly(length)
    await asyncio.sleep(0.2)  # well past the connection's first deadline, within keep-alive
    writer.write(head + b"1000\r\n\r\n{\"messages\": [")  # a second request that never completes
    await writer.drain()
    data, elapsed = await _closed_within(reader, 5.0)
    assert first.startswith(b"HTTP/1.1 200") and data == b""  # its handler was reading: closed without an answer
    assert 0.4 < elapsed < 2.0  # its own read_timeout_s=0.5 from when it started
    writer.close()


# ---------------------------------------------------------------- engine: temperature and sampling errors


async def test_a_denormal_temperature_neither_hangs_nor_breaks_the_engine(engine, chat):
    http, store = in_process(engine, chat, enforce_sampling=False, sampling=SamplingConfig(max_tokens=4))
    session = store.open("r")
    for temperature in (1e-45, 5e-324, 1e-4):
        body = {"messages": USER, "temperature": temperature}
        r = await asyncio.wait_for(http.post("/v1/chat/completions", json=body, headers=auth(session.key)), 60)
        assert r.status_code == 200, r.text
    after = await http.post("/v1/chat/completions", json={"messages": USER, "temperature": 0.7},
                            headers=auth(session.key))
    assert after.status_code == 200
    turns = store.close(session.session_id).turns
    assert [t.sampling.temperature for t in turns] == [1e-3, 1e-3, 1e-3, 0.7]  # the value used is recorded
    assert all(t.status == "ok" for t in turns)


async def test_a_sampling_error_fails_only_its_own_request(engine, monkeypatch):
    real = engine_request.sample_next

    def poisoned(logits, rows, generators):
        if any(r.temperature == 0.777 for r in rows):
            raise ValueError("poisoned row")
        return real(logits, rows, generators)

    monkeypatch.setattr(engine_request, "sample_next", poisoned)
    prompt = [1, 2, 3, 4]
    good = [asyncio.create_task(engine.generate(prompt, Sampling(temperature=0.5, max_tokens=6))) for _ in range(3)]
    await asyncio.sleep(0.05)
    bad = asyncio.create_task(engine.generate(prompt, Sampling(temperature=0.777, max_tokens=6)))
    with pytest.raises(EngineError, match="poisoned row"):
        await asyncio.wait_for(bad, 60)
    for task in good:
        assert len((await asyncio.wait_for(task, 60)).completion_ids) == 6
    later = await asyncio.wait_for(engine.generate(prompt, Sampling(temperature=0.5, max_tokens=2)), 60)
    assert len(later.completion_ids) == 2


async def test_eos_as_the_last_allowed_id_is_stop(engine, monkeypatch):
    eos = engine.eos_token_ids[0]
    calls = {"n": 0}

    def eos_second(logits, rows, generators):
        calls["n"] += 1
        return [eos if calls["n"] >= 2 else 5] * len(rows), [-0.1] * len(rows)

    monkeypatch.setattr(engine_request, "sample_next", eos_second)
    done = await asyncio.wait_for(engine.generate([1, 2, 3], Sampling(temperature=0.0, max_tokens=2)), 60)
    assert done.completion_ids == (5, eos) and done.finish_reason == "stop"
    calls["n"] = 0
    cut = await asyncio.wait_for(engine.generate([1, 2, 3], Sampling(temperature=0.0, max_tokens=1)), 60)
    assert cut.completion_ids == (5,) and cut.finish_reason == "length"


async def test_a_seed_outside_64_bits_is_refused_and_cannot_break_the_engine(engine, chat):
    http, store = in_process(engine, chat, enforce_sampling=False, sampling=SamplingConfig(max_tokens=2))
    session = store.open("r")
    r = await http.post("/v1/chat/completions", json={"messages": USER, "seed": 2**64}, headers=auth(session.key))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    with pytest.raises(EngineError, match="prefill failed"):
        await asyncio.wait_for(engine.generate([1, 2, 3], Sampling(seed=2**70, max_tokens=2)), 60)
    ok = await asyncio.wait_for(engine.generate([1, 2, 3], Sampling(seed=2**64 - 1, max_tokens=2)), 60)
    assert len(ok.completion_ids) == 2


async def test_a_proxy_bug_is_a_json_500_and_a_recorded_turn(tokenizer, monkeypatch):
    chat = ChatLayer(tokenizer)
    http, store = in_process(FakeEngine(), chat)
    session = store.open("r")

    def broken(*args, **kwargs):
        raise KeyError("bug")

    monkeypatch.setattr(chat, "parse", broken)
    r = await http.post("/v1/chat/completions", json={"messages": USER}, headers=auth(session.key))
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    monkeypatch.undo()
    ok = await http.post("/v1/chat/completions", json={"messages": USER}, headers=auth(session.key))
    assert ok.status_code == 200
    turns = store.close(session.session_id).turns
    assert [(t.turn_index, t.status) for t in turns] == [(0, "error"), (1, "ok")]
    assert "KeyError" in turns[0].error


async def test_a_session_past_max_turns_is_refused_429_and_counted(tokenizer):
    http, store = in_process(FakeEngine(), ChatLayer(tokenizer))
    store.max_turns_per_session = 3
    session = store.open("r")
    calls = [("/v1/chat/completions", {"messages": USER}), ("/v1/responses", {"input": "hi", "bogus": 1}),
             ("/v1/messages", {"max_tokens": 5, "messages": USER}), ("/v1/chat/completions", {"messages": USER}),
             ("/v1/responses", {"input": "hi"}), ("/v1/messages", {"max_tokens": 5, "messages": USER})]
    codes = [(await http.post(path, json=body, headers=auth(session.key))).status_code for path, body in calls]
    assert codes == [200, 400, 200, 429, 429, 429]
    trace = store.close(session.session_id)
    assert [t.turn_index for t in trace.turns] == [0, 1, 2] and trace.refused_calls == 3

"""Property-based fuzzing of the agent routes over real HTTP on loopback.

A real `ProxyServer` (uvicorn, httptools, the read guard) runs in its own thread with a fast
`FakeEngine` and the real chat layer. Hypothesis generates bodies for chat completions,
Responses, Anthropic Messages and count_tokens: plausible shapes with any JSON value in any
field, unknown keys, nesting from 1 to 1,200 levels, and raw garbage. Properties, per call:
the proxy answers below 500 and never with its internal-error body; a body that `wire.loads`
accepts is recorded as exactly one turn (count_tokens records none); one that it refuses is
answered 400/413 and not recorded. Per route, at the end: the server is still up, the turn
indices are exactly 0..n-1, and the closed trace reloads from the trace file.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer
from harnessrl.errors import RequestError
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.proxy.sessions import read_traces
from harnessrl.proxy.wire import loads

EXAMPLES_PER_ROUTE = 65
BATCH = 20
"""Each example is a batch of 20 bodies sent concurrently: 4 routes x 65 x 20 = 5,200 requests."""
DEEP = "\u0000deep:"


# ---------------------------------------------------------------- strategies

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
anyjson = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                       max_leaves=8)
deep = st.integers(1, 1200).map(lambda n: f"{DEEP}{n}")
"""A placeholder replaced by n nested arrays in the encoded body (no encoder goes that deep)."""


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(*[strategy] * 8, anyjson, deep)


text = st.text(max_size=24)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", ""])
parts = st.lists(st.fixed_dictionaries({"type": maybe(st.sampled_from(["text", "input_text", "output_text",
                                                                         "refusal", "image_url"])),
                                        "text": maybe(text)}), max_size=2)
content = maybe(text | parts)
tool_calls = st.lists(st.fixed_dictionaries({"id": maybe(text), "type": maybe(st.just("function")),
                                             "function": maybe(st.fixed_dictionaries({
                                                 "name": maybe(text), "arguments": maybe(text)}))}), max_size=2)
schema = maybe(st.just({"type": "object", "properties": {"x": {"type": "string"}}}))
chat_tools = st.lists(st.fixed_dictionaries({"type": maybe(st.sampled_from(["function", "custom"])),
                                             "function": maybe(st.fixed_dictionaries({
                                                 "name": maybe(text), "parameters": schema}))}), max_size=2)
extras = st.one_of(*[st.just({})] * 3, st.dictionaries(st.text(max_size=8), anyjson, max_size=2))
numbers = st.one_of(*[st.integers(1, 4000)] * 3, st.integers(-5, 0), st.floats(-1, 3))

chat_message = st.fixed_dictionaries(
    {"role": maybe(roles), "content": content},
    optional={"tool_calls": maybe(tool_calls), "tool_call_id": maybe(text), "name": maybe(text),
              "reasoning_content": maybe(text)})
chat_body = st.fixed_dictionaries(
    {"messages": maybe(st.lists(chat_message, min_size=1, max_size=4))},
    optional={"model": maybe(text), "tools": maybe(chat_tools), "tool_choice": maybe(st.sampled_from(["auto", "none",
                                                                                                     "required"])),
              "stream": maybe(st.booleans()), "stream_options": maybe(st.fixed_dictionaries({
                  "include_usage": maybe(st.booleans())})),
              "max_tokens": maybe(numbers), "max_completion_tokens": maybe(numbers), "temperature": maybe(numbers),
              "top_p": maybe(numbers), "top_k": maybe(numbers), "seed": maybe(st.integers(-(2**63), 2**64 - 1)),
              "stop": maybe(text | st.lists(text, max_size=2)), "logprobs": maybe(st.booleans()),
              "metadata": maybe(anyjson), "n": maybe(st.integers(0, 2)), "user": maybe(text),
              "response_format": maybe(st.just({"type": "text"}))})

responses_item = st.one_of(
    st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "system", "developer", "assistant"])),
                           "content": content}, optional={"type": maybe(st.just("message"))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": maybe(text), "name": maybe(text),
                           "arguments": maybe(text)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": maybe(text),
                           "output": maybe(text | parts)}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": maybe(st.lists(st.fixed_dictionaries({
        "type": st.just("summary_text"), "text": maybe(text)}), max_size=2))}, optional={"content": maybe(parts)}),
    anyjson)
responses_tool = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["function", "namespace", "web_search", "custom"]))},
    optional={"name": maybe(text), "parameters": schema, "description": maybe(text),
              "tools": maybe(st.lists(st.fixed_dictionaries({"type": maybe(st.just("function")),
                                                             "name": maybe(text)}), max_size=2))})
responses_body = st.fixed_dictionaries(
    {"input": maybe(text | st.lists(responses_item, min_size=1, max_size=4))},
    optional={"model": maybe(text), "instructions": maybe(text), "tools": maybe(st.lists(responses_tool, max_size=2)),
              "tool_choice": maybe(st.sampled_from(["auto", "none"])), "stream": maybe(st.booleans()),
              "max_output_tokens": maybe(numbers), "temperature": maybe(numbers), "top_p": maybe(numbers),
              "include": maybe(st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning"]), max_size=2)),
              "text": maybe(st.just({"format": {"type": "text"}})), "truncation": maybe(st.just("disabled")),
              "background": maybe(st.just(False)), "previous_response_id": maybe(st.none()),
              "store": maybe(st.booleans()), "metadata": maybe(anyjson), "reasoning": maybe(anyjson)})

block = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image"]))},
    optional={"text": maybe(text), "id": maybe(text), "name": maybe(text), "input": maybe(anyjson),
              "tool_use_id": maybe(text), "content": maybe(text | st.lists(st.fixed_dictionaries({
                  "type": st.just("text"), "text": maybe(text)}), max_size=2)), "thinking": maybe(text)})
anthropic_message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant", "system"])),
                                           "content": maybe(text | st.lists(block, max_size=3))})
messages_body = st.fixed_dictionaries(
    {"messages": maybe(st.lists(anthropic_message, min_size=1, max_size=4)), "max_tokens": maybe(numbers)},
    optional={"model": maybe(text), "system": maybe(text | st.lists(st.fixed_dictionaries({
        "type": maybe(st.just("text")), "text": maybe(text)}), max_size=2)),
        "tools": maybe(st.lists(st.fixed_dictionaries({"name": maybe(text), "input_schema": schema},
                                                      optional={"type": maybe(st.sampled_from(
                                                          ["custom", "web_search_20250305"]))}), max_size=2)),
        "tool_choice": maybe(st.fixed_dictionaries({"type": maybe(st.sampled_from(["auto", "any", "none", "tool"]))})),
        "temperature": maybe(numbers), "top_p": maybe(numbers), "top_k": maybe(numbers),
        "stop_sequences": maybe(st.lists(text, max_size=2)), "stream": maybe(st.booleans()),
        "metadata": maybe(anyjson), "thinking": maybe(anyjson), "output_config": maybe(anyjson)})

GARBAGE = [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe{}", b'{"messages": 1e999}', b"{\"a\": 1" + b"}" * 3,
           b'{"a": 123456789012345678901234567890}', b'{"a": "\\ud800"}', b'{"a": NaN}', b"[" * 5000,
           b'{"messages": [{"role": "user", "content": "hi"}]}' + b" " * 10]


def encode(body: object) -> bytes:
    """orjson bytes of `body` with each deep placeholder replaced by n nested empty arrays."""
    raw = orjson.dumps(body)
    while (start := raw.find(b'"\\u0000deep:')) >= 0:
        end = raw.index(b'"', start + 1)
        n = int(raw[start + len(b'"\\u0000deep:'):end])
        raw = raw[:start] + b"[" * n + b"]" * n + raw[end + 1:]
    return raw


def with_extras(bodies: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    built = st.builds(lambda b, e: encode(e | b), bodies, extras)
    return st.one_of(*[built] * 12, st.sampled_from(GARBAGE))


# ---------------------------------------------------------------- the live proxy


class LiveProxy:
    """A ProxyServer on its own event loop in a thread; calls into its store run on that loop."""

    def __init__(self, tokenizer: Any, trace_path: Path) -> None:
        tool = 'Sure.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
        plain = "<think>hmm</think>Hello there."
        ids = [tokenizer.encode(t, add_special_tokens=False) + [2] for t in (tool, plain)]
        engine = FakeEngine(completion_ids=lambda n: ids[n % 2])
        config = ProxyConfig(port=0, trace_path=trace_path, read_timeout_s=10.0, sampling=SamplingConfig(max_tokens=64))
        self.server = ProxyServer(engine, ChatLayer(tokenizer, eos_token_ids=(2,)), config)
        self.loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        started = threading.Event()

        async def main() -> None:
            async with self.server:
                started.set()
                await self._stop.wait()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(30), "proxy did not start"

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(15)


@pytest.fixture(scope="module")
def live(tokenizer, tmp_path_factory) -> Iterator[LiveProxy]:
    proxy = LiveProxy(tokenizer, tmp_path_factory.mktemp("fuzz") / "traces.jsonl")
    yield proxy
    proxy.close()


ROUTES = {"chat/completions": chat_body, "responses": responses_body, "messages": messages_body,
          "messages/count_tokens": messages_body}


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_input_breaks_the_proxy(live: LiveProxy, route: str):
    session_id, key = live.call(lambda: live.server.open_session(f"fuzz-{route}"))
    records = route != "messages/count_tokens"
    sent = {"calls": 0, "recorded": 0}
    statuses: Counter[int] = Counter()
    client = httpx.Client(base_url=live.server.base_url, timeout=60, limits=httpx.Limits(max_connections=BATCH),
                          headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    pool = ThreadPoolExecutor(BATCH)

    def post(raw: bytes) -> httpx.Response:
        return client.post(f"/{route}", content=raw)

    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies=st.lists(with_extras(ROUTES[route]), min_size=BATCH, max_size=BATCH))
    def one_batch(bodies: list[bytes]) -> None:
        for raw, r in zip(bodies, pool.map(post, bodies), strict=True):
            try:
                loads(raw)
                parses = True
            except RequestError:
                parses = False
            sent["calls"] += 1
            statuses[r.status_code] += 1
            assert r.status_code < 500, (r.status_code, r.text[:500], raw[:300])
            assert "internal proxy error" not in r.text, (r.text[:500], raw[:300])
            assert r.status_code != 401, r.text[:300]
            if not parses:
                assert r.status_code in (400, 413), (r.status_code, raw[:200])
            sent["recorded"] += records and parses
        turns = live.call(lambda: len(live.server.store.trace(session_id).turns))
        assert turns == sent["recorded"], (turns, sent)

    one_batch()
    pool.shutdown()
    client.close()
    assert sent["calls"] >= EXAMPLES_PER_ROUTE * BATCH
    print(f"{route}: {sent['calls']} calls, statuses {dict(sorted(statuses.items()))}")
    assert statuses[200] >= BATCH, statuses  # the generator reaches generation, not only refusals
    assert httpx.get(live.server.base_url.removesuffix("/v1") + "/healthz", timeout=5).status_code == 200
    trace = live.call(lambda: live.server.close_session(session_id))
    assert [t.turn_index for t in trace.turns] == list(range(sent["recorded"]))
    (back,) = [t for t in read_traces(live.server.config.trace_path) if t.session_id == session_id]
    assert len(back.turns) == sent["recorded"]

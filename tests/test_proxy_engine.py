"""Proxy invariants with the real EmbeddedEngine on the tiny model: token faithfulness, logprob
parity with a plain forward pass, SSE == unary, a real uvicorn socket, captured agent requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

import openai
import pytest
import torch
from fakes import CAPTURES_DIR, in_process

from harnessrl.engine.model_store import load_causal_lm
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.server import ProxyServer

CHAT_CAPTURES = sorted(CAPTURES_DIR.glob("*/chat-completions-*.json"))
USER = [{"role": "user", "content": "Write a haiku about tests."}]



async def test_real_socket_sdk_unary_equals_stream_with_same_seed(engine, chat):
    config = ProxyConfig(port=0, enforce_sampling=False, sampling=SamplingConfig(max_tokens=12, temperature=1.0))
    async with ProxyServer(engine, chat, config) as proxy:
        assert proxy.base_url.startswith("http://127.0.0.1:") and proxy.port > 0
        session_id, key = proxy.open_session("r1")
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        unary = await client.chat.completions.create(model="tiny", messages=USER, seed=7)
        # the SDK's stream helper refuses finish_reason=length, so accumulate chunks by hand
        stream = await client.chat.completions.create(model="tiny", messages=USER, seed=7, stream=True,
                                                      stream_options={"include_usage": True})
        content, finish, usage = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
        assert content == unary.choices[0].message.content and len(content) > 0
        assert finish == unary.choices[0].finish_reason
        assert usage.completion_tokens == unary.usage.completion_tokens
        trace = proxy.close_session(session_id)
        a, b = trace.turns
        assert a.completion_ids == b.completion_ids and a.prompt_ids == b.prompt_ids
        assert a.completion_logprobs == pytest.approx(b.completion_logprobs, abs=1e-6)
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="tiny", messages=USER)
        assert trace.rejected_calls == 1


async def test_recorded_ids_are_faithful_and_logprobs_match_a_forward_pass(engine, chat, tiny_model_dir):
    http, store = in_process(engine, chat, sampling=SamplingConfig(temperature=0.8, max_tokens=10))
    session = store.open("r")
    r = await http.post("/v1/chat/completions", json={"messages": USER},
                        headers={"authorization": f"Bearer {session.key}"})
    assert r.status_code == 200
    turn = session.trace.turns[0]
    assert turn.prompt_ids == chat.render(chat_messages(USER))  # what was rendered is what the engine consumed
    assert len(turn.completion_ids) == len(turn.completion_logprobs) == r.json()["usage"]["completion_tokens"]
    assert turn.status == "ok" and turn.sampling.temperature == 0.8
    model = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    n_prompt = len(turn.prompt_ids)
    logp = torch.log_softmax(logits[n_prompt - 1:-1] / 0.8, dim=-1)
    recomputed = logp.gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0].tolist()
    assert recomputed == pytest.approx(turn.completion_logprobs, abs=1e-4)


def chat_messages(raw):
    from harnessrl.chat.layer import normalize_messages

    return normalize_messages(raw)


@pytest.mark.parametrize("capture", CHAT_CAPTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
async def test_captured_agent_requests_get_200(engine, chat, capture: Path):
    http, store = in_process(engine, chat, sampling=SamplingConfig(max_tokens=4))
    session = store.open("cap")
    recorded = json.loads(capture.read_text())
    headers = {k: v for k, v in recorded["headers"].items()
               if k.lower() not in ("authorization", "content-length", "host", "accept-encoding")}
    headers["authorization"] = f"Bearer {session.key}"
    body = recorded["body"]
    r = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events = [e for e in r.text.split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1] if e.startswith("data: ")]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
        wants_usage = (body.get("stream_options") or {}).get("include_usage", False)
        assert ("usage" in chunks[-1]) == wants_usage
    else:
        out = r.json()
        assert out["choices"][0]["message"]["role"] == "assistant"
        assert out["usage"]["completion_tokens"] == len(session.trace.turns[0].completion_ids)
    turn = session.trace.turns[0]
    assert turn.status == "ok" and turn.sampling.max_tokens <= 4
    assert turn.headers.get("user-agent") == next(v for k, v in recorded["headers"].items() if k.lower() == "user-agent")


def test_captured_requests_are_present() -> None:
    # the replay tests above are parametrized over these files; an empty set would test nothing
    assert len(CHAT_CAPTURES) == 7
    assert len(list((CAPTURES_DIR / "codex").glob("responses-*.json"))) == 2


# -- issue 47: a closed session's generation, the prefix cache between groups ---------------------------


async def test_closing_a_session_stops_its_generation(engine, chat):
    """Attack: an agent asks for a long reply and exits; the runner closes its session. Before,
    the engine decoded the whole reply for a turn that is never recorded; now it decodes at most
    2 more ids, and the call gets 401."""
    config = ProxyConfig(port=0, sampling=SamplingConfig(max_tokens=3000, temperature=0.0))
    async with ProxyServer(engine, chat, config) as proxy:
        session_id, key = proxy.open_session("r-gone", group="g-gone")
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=120) as http:
            call = asyncio.create_task(http.post("/chat/completions", json={"messages": USER, "max_tokens": 3000},
                                                 headers={"authorization": f"Bearer {key}"}))
            start = engine.stats().generated_tokens
            while engine.stats().generated_tokens < start + 20:
                await asyncio.sleep(0.002)
            trace = proxy.close_session(session_id)
            at_close = engine.stats().generated_tokens
            reply = await call
        await asyncio.sleep(0.2)
        assert engine.stats().generated_tokens - at_close <= 2
        assert reply.status_code == 401 and trace.turns == []


async def test_a_session_of_another_group_gets_no_prefix_hit(engine, chat):
    """Attack: a session times a prompt to learn whether another session sent it (a cache hit
    comes back several times faster). A session of another group finds nothing in the prefix
    cache (the whole prompt is computed); one of the same group reuses it."""
    http, store = in_process(engine, chat, sampling=SamplingConfig(max_tokens=2))
    messages = [{"role": "user", "content": "the secret is 10110010, " * 8}]

    async def call(group: str) -> int:
        session = store.open(f"r-{group}", group)
        before = engine.stats().prefix_hit_tokens
        r = await http.post("/v1/chat/completions", json={"messages": messages},
                            headers={"authorization": f"Bearer {session.key}"})
        assert r.status_code == 200
        return engine.stats().prefix_hit_tokens - before

    assert await call("attacker") == 0
    assert await call("victim") == 0  # another group: computed afresh
    assert await call("attacker") > 0  # the attacker's own group reuses its prompt


async def _generation_stopped(engine, session, start: int) -> None:  # type: ignore[no-untyped-def]
    """The session's one turn is recorded as cancelled, far from its 3000 ids, and the engine
    decodes at most 2 ids for it afterwards."""
    for _ in range(2000):
        if session.trace.turns:
            break
        await asyncio.sleep(0.005)
    at_record = engine.stats().generated_tokens
    await asyncio.sleep(0.2)
    assert engine.stats().generated_tokens - at_record <= 2
    assert at_record - start < 1500
    (turn,) = session.trace.turns
    assert turn.status == "error" and "cancelled" in (turn.error or "")


async def test_a_client_leaving_mid_stream_stops_its_generation(engine, chat):
    """Attack: an agent opens a stream for a long reply and drops it after the first event.
    Before, the engine decoded the whole reply for nobody; now the generation is cancelled
    (at most 2 ids after the call is recorded as cancelled) and the call is an error turn."""
    config = ProxyConfig(port=0, stream_keepalive_s=0.05, sampling=SamplingConfig(max_tokens=3000, temperature=0.0))
    async with ProxyServer(engine, chat, config) as proxy:
        session_id, key = proxy.open_session("r-drop", group="g-drop")
        session = proxy.store.get(session_id)
        start = engine.stats().generated_tokens
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=120) as http:
            async with http.stream("POST", "/chat/completions", headers={"authorization": f"Bearer {key}"},
                                   json={"messages": USER, "max_tokens": 3000, "stream": True}) as stream:
                async for _ in stream.aiter_bytes():
                    if engine.stats().generated_tokens >= start + 20:
                        break  # leave with the reply far from done
        await _generation_stopped(engine, session, start)
        proxy.close_session(session_id)



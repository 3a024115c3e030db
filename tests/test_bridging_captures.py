"""Bridging on the replay formats of real agents: the turn-2 request bodies captured from
opencode, pi (plain and with a reasoning model) and mini-swe-agent (`tests/data/captures/`).

Turn 1 is the captured conversation before the agent's reply; a scripted engine samples that
reply the way a model writes it (reasoning in `<think>`, compact tool-call JSON, EOS); turn 2
is the captured body itself, which replays the reply in the agent's own form (content parts,
`developer` role, `reasoning_content`, re-serialised arguments). Through the real capture path
turn 2 is bridged and merges CLEAN; rendered without bridging it diverges inside turn 1's
completion (which the builder would fork)."""

from __future__ import annotations

import json

import pytest

from fakes import CAPTURES_DIR, FakeEngine
from harnessrl.chat.layer import ChatLayer
from harnessrl.proxy.capture import CaptureDeps, complete_chat
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.sessions import SessionStore
from harnessrl.train.samples import build_rows, common_prefix_len
from harnessrl.types import Rollout, Trace

CAPTURES = ["opencode/chat-completions-turn2-with-tool-result.json",
            "pi/chat-completions-turn2-with-tool-result.json",
            "pi/chat-completions-reasoning-model-turn2.json",
            "mini-swe-agent/chat-completions-turn2-with-tool-result.json"]


def sampled_reply(tokenizer, message: dict) -> list[int]:
    """The ids a model writes for `message`: `<think>` reasoning, text, compact hermes calls."""
    text = ""
    if message.get("reasoning_content"):
        text += "<think>\n" + message["reasoning_content"] + "\n</think>\n\n"
    text += message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        text += "\n<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])},
                                               separators=(",", ":")) + "\n</tool_call>"
    return tokenizer.encode(text, add_special_tokens=False) + [2]


@pytest.mark.parametrize("capture", CAPTURES)
async def test_captured_replay_is_bridged_and_clean(tokenizer, capture):
    body = json.loads((CAPTURES_DIR / capture).read_text())["body"]
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    last = max(i for i, m in enumerate(body["messages"]) if m["role"] == "assistant")
    reply = body["messages"][last]
    chat = ChatLayer(tokenizer)
    engine = FakeEngine(completion_ids=lambda k: sampled_reply(tokenizer, reply) if k == 0
                        else tokenizer.encode("Done.", add_special_tokens=False) + [2])
    deps = CaptureDeps(engine, chat, ProxyConfig(sampling=SamplingConfig(max_tokens=400)))  # type: ignore[arg-type]
    session = SessionStore().open("r")
    first = await complete_chat(deps, session, {**body, "messages": body["messages"][:last]}, {})
    assert first.status_code == 200, first.body
    got = first.body["choices"][0]["message"]
    assert [c["function"]["name"] for c in got.get("tool_calls", [])] == [c["function"]["name"] for c in reply["tool_calls"]]
    second = await complete_chat(deps, session, body, {})
    assert second.status_code == 200, second.body
    t0, t1 = session.trace.turns
    head = t0.prompt_ids + t0.completion_ids
    assert t1.notes[-1:] == ["bridged_from=0"] and t1.prompt_ids[:len(head)] == head
    _, stats = build_rows(Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status="ok", reward=1.0,
                                  trace=Trace(session_id="s", turns=[t0, t1])))
    assert (stats.num_clean, stats.num_fork, stats.untrained_sampled_tokens) == (1, 0, 0)
    # without bridging the re-rendered reply leaves the sampled ids inside the completion
    session.bridge_points.clear()
    plain = (await complete_chat(deps, session, body, {})).turn.prompt_ids
    assert len(t0.prompt_ids) <= common_prefix_len(plain, head) < len(head)

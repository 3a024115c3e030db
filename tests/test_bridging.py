"""Bridged rendering: a request that extends an earlier turn starts with that turn's exact ids.

Each scenario runs the real capture path (`proxy.capture.complete_chat`, a real session) on a
scripted engine, with an agent that replays each reply the way agents do (reasoning dropped,
tool-call arguments re-serialised, text stripped), then builds rows with the real samples
builder: every turn after the first merges CLEAN and no sampled token is left untrained. The
same conversations rendered without bridging diverge inside the earlier completion (shown per
case), so each test can fail. Templates: the real SmolLM2 one, and those in
`tests/data/templates/` attached to the same tokenizer.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer, normalize_messages, normalize_tools, same_replay
from harnessrl.proxy.capture import CaptureDeps, complete_chat
from harnessrl.proxy.config import ProxyConfig, SamplingConfig
from harnessrl.proxy.sessions import SessionStore
from harnessrl.train.samples import build_rows, common_prefix_len
from harnessrl.types import Rollout

TEMPLATES = Path(__file__).parent / "data" / "templates"
BASH = {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
SYSTEM = {"role": "system", "content": "You are a coding agent. You run commands in a sandbox, read files, "
                                       "edit them and run the tests until they pass."}
TASK = {"role": "user", "content": "Fix the failing test."}


def with_template(tokenizer, name: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (TEMPLATES / name).read_text()
    return tok


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def replay(message: dict) -> dict:
    """The assistant message as an agent sends it back: reasoning dropped, text stripped,
    arguments parsed and re-dumped compactly."""
    out = {"role": "assistant", "content": (message.get("content") or "").strip() or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"],
                "arguments": json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))}}
            for c in message["tool_calls"]]
    return out


async def converse(tokenizer, completions: list[list[int]], follow_ups: list[list[dict]], *,
                   tools: list | None = None, max_tokens: int = 200):
    """Run `len(completions)` calls: call k+1's messages are call k's + its replayed reply +
    `follow_ups[k]` (tool results get the reply's call ids). Returns (turns, chat)."""
    chat = ChatLayer(tokenizer)
    engine = FakeEngine(completion_ids=lambda k: completions[k])
    deps = CaptureDeps(engine, chat, ProxyConfig(sampling=SamplingConfig(max_tokens=max_tokens)))  # type: ignore[arg-type]
    session = SessionStore().open("r0")
    messages: list[dict] = [SYSTEM, TASK]
    for k in range(len(completions)):
        body = {"model": "m", "messages": messages} | ({"tools": tools} if tools else {})
        outcome = await complete_chat(deps, session, body, {})
        assert outcome.status_code == 200, outcome.body
        reply = outcome.body["choices"][0]["message"]
        follow = [dict(m) for m in (follow_ups[k] if k < len(follow_ups) else [])]
        for m in follow:
            if m["role"] == "tool":
                m["tool_call_id"] = reply["tool_calls"][0]["id"]
        messages = [*messages, replay(reply), *follow]
    return session.trace.turns, chat


def rows_of(turns):
    rollout = Rollout(rollout_id="ro", group_id=0, task_id="t", harness="h", status="ok", reward=1.0,
                      trace=session_trace(turns))
    return build_rows(rollout)


def session_trace(turns):
    from harnessrl.types import Trace

    return Trace(session_id="s", turns=list(turns))


def assert_all_clean(turns, n_turns: int) -> None:
    assert [t.status for t in turns] == ["ok"] * n_turns
    for i in range(1, n_turns):
        prev = turns[i - 1]
        assert turns[i].prompt_ids[:len(prev.prompt_ids) + len(prev.completion_ids)] == \
            prev.prompt_ids + prev.completion_ids
        assert turns[i].notes == [f"bridged_from={i - 1}"]
    rows, stats = rows_of(turns)
    assert len(rows) == 1
    assert (stats.num_clean, stats.num_realign, stats.num_fork) == (n_turns - 1, 0, 0)
    assert stats.untrained_sampled_tokens == 0
    assert stats.tokens_trained == sum(len(t.completion_ids) for t in turns) == stats.main_sampled_tokens


def unbridged_divergence(chat: ChatLayer, turns, tools=None) -> int:
    """Where the normal render of turn 1's request leaves turn 0's prompt + completion."""
    t0, t1 = turns[0], turns[1]
    plain = chat.render(normalize_messages(t1.request["messages"]), normalize_tools(tools))
    return common_prefix_len(plain, t0.prompt_ids + t0.completion_ids) - len(t0.prompt_ids)


async def test_smollm2_trailing_whitespace_and_non_canonical_ids_merge_clean(tokenizer):
    # sampled: "Looking" split in two ids, and trailing whitespace the agent strips on replay
    first = ids(tokenizer, "Look") + ids(tokenizer, "ing at the test.  \n") + [2]
    assert first[:-1] != ids(tokenizer, "Looking at the test.  \n")
    second = ids(tokenizer, "Done.") + [2]
    turns, chat = await converse(tokenizer, [first, second, ids(tokenizer, "Bye.") + [2]],
                                 [[{"role": "user", "content": "go on"}], [{"role": "user", "content": "end"}]])
    assert_all_clean(turns, 3)
    assert unbridged_divergence(chat, turns) < len(first)  # without bridging: REALIGN/FORK


async def test_smollm2_reserialised_tool_calls_merge_clean(tokenizer):
    # the model wrote compact JSON; the hermes re-render writes `{"name": "bash", ...}` spaced
    call = ids(tokenizer, 'Running it.\n<tool_call>\n{"name":"bash","arguments":{"command":"ls"}}\n</tool_call>') + [2]
    turns, chat = await converse(tokenizer, [call, call, ids(tokenizer, "Fixed.") + [2]],
                                 [[{"role": "tool", "content": "a.py"}], [{"role": "tool", "content": "b.py"}]],
                                 tools=[BASH])
    assert turns[0].reply.tool_calls[0].name == "bash"
    assert_all_clean(turns, 3)
    assert unbridged_divergence(chat, turns, [BASH]) < len(call) - 1


async def test_qwen3_thinking_template_keeps_the_sampled_reasoning(tokenizer):
    tok = with_template(tokenizer, "qwen3_thinking.jinja")
    # the generation prompt opened <think>; the reply closes it, then calls a tool
    first = ids(tok, 'The test imports x.\n</think>\n\nI will look.\n<tool_call>\n'
                     '{"name": "bash", "arguments": {"command": "cat x.py"}}\n</tool_call>') + [2]
    second = ids(tok, "Found it.\n</think>\n\nThe bug is in x.py.") + [2]
    turns, chat = await converse(tok, [first, second, ids(tok, "ok\n</think>\n\nDone.") + [2]],
                                 [[{"role": "tool", "content": "def x(): pass"}],
                                  [{"role": "user", "content": "fix it"}]], tools=[BASH])
    reply = turns[0].reply
    assert reply.reasoning == "The test imports x." and reply.content == "I will look."
    assert reply.tool_calls[0].arguments == '{"command": "cat x.py"}'
    assert_all_clean(turns, 3)
    # the template drops the reasoning of turns before the last user query: re-rendering loses it
    assert unbridged_divergence(chat, turns, [BASH]) <= 0
    text = tok.decode(turns[2].prompt_ids)
    assert text.count("The test imports x.") == 1  # kept as sampled, not re-rendered


async def test_reply_cut_at_max_tokens_gets_the_end_of_turn_framing(tokenizer):
    long_reply = ids(tokenizer, "one two three four five six seven eight nine ten") + [2]
    turns, _ = await converse(tokenizer, [long_reply, ids(tokenizer, "ok") + [2]],
                              [[{"role": "user", "content": "continue"}]], max_tokens=5)
    t0, t1 = turns
    assert t0.finish_reason == "length" and len(t0.completion_ids) == 5 and t0.completion_ids[-1] != 2
    head = t0.prompt_ids + t0.completion_ids
    assert t1.prompt_ids[:len(head)] == head
    # exactly the template's framing: end-of-turn, the new user message, the generation prompt
    assert t1.prompt_ids[len(head):] == [2] + ids(tokenizer, "\n<|im_start|>user\ncontinue<|im_end|>\n"
                                                             "<|im_start|>assistant\n")
    rows, stats = rows_of(turns)
    assert stats.num_clean == 1 and stats.untrained_sampled_tokens == 0
    assert rows[0].completion_mask[len(head)] == 0  # the added end-of-turn id is context


async def test_rewritten_history_renders_normally_and_forks(tokenizer):
    chat = ChatLayer(tokenizer)
    engine = FakeEngine(completion_ids=lambda k: ids(tokenizer, f"answer {k}") + [2])
    deps = CaptureDeps(engine, chat, ProxyConfig())  # type: ignore[arg-type]
    session = SessionStore().open("r0")
    first = await complete_chat(deps, session, {"messages": [SYSTEM, TASK]}, {})
    reply = replay(first.body["choices"][0]["message"])
    # compaction: the history is replaced by a summary, the reply is not replayed as sent
    compacted = [SYSTEM, {"role": "user", "content": "Summary: the test fails. Continue."}]
    second = await complete_chat(deps, session, {"messages": compacted}, {})
    edited = [SYSTEM, TASK, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "go"}]
    third = await complete_chat(deps, session, {"messages": edited}, {})
    for outcome, msgs in ((second, compacted), (third, edited)):
        assert outcome.turn.notes == []
        assert outcome.turn.prompt_ids == chat.render(normalize_messages(msgs))
    assert reply["content"] == "answer 0"
    _, stats = rows_of(session.trace.turns)
    assert stats.num_fork == 2 and stats.num_clean == 0 and stats.untrained_sampled_tokens == 0


def test_find_bridge_public_api(tokenizer):
    chat = ChatLayer(tokenizer)
    m1 = normalize_messages([SYSTEM, TASK])
    p1 = chat.render(m1)
    c1 = ids(tokenizer, "Sure.") + [2]
    point = chat.bridge_point(0, m1, None, chat.parse(c1, False), p1, c1)
    m2 = normalize_messages([SYSTEM, TASK, {"role": "assistant", "content": " Sure. "},
                             {"role": "user", "content": "next"}])
    assert chat.find_bridge(m2, None, [point]) is point
    assert chat.find_bridge(m2, [BASH], [point]) is None  # other tools: another system prompt
    assert chat.find_bridge(m2[:3], None, [point]) is None  # no new message
    bridged = chat.bridged_prompt_ids(m2, None, [point])
    assert bridged == p1 + c1 + ids(tokenizer, "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n")
    assert chat.render_bridged(m2, None, [(m1, p1, c1)]) == bridged
    assert same_replay(m2[2], point.reply) and not same_replay(m2[3], point.reply)


@pytest.mark.parametrize("template", ["qwen3_thinking.jinja", "args_json_string.jinja", "args_mapping.jinja"])
def test_bridge_suffix_is_the_templates_own_framing(tokenizer, template):
    """For every test template the bridged ids equal the full render's ids from the reply's
    end-of-turn on (the suffix comes from the template, not from a per-family rule)."""
    tok = with_template(tokenizer, template)
    chat = ChatLayer(tok)
    raw1 = [SYSTEM, TASK]
    m1 = normalize_messages(raw1)
    p1 = chat.render(m1, [BASH])
    reply_text = "Plain answer."
    thought = "Short thought.\n</think>\n\n" if chat.prompt_opens_reasoning else ""
    c1 = ids(tok, thought + reply_text) + [2]
    point = chat.bridge_point(0, m1, [BASH], chat.parse(c1, True), p1, c1)
    m2 = normalize_messages([*raw1, {"role": "assistant", "content": reply_text}, {"role": "user", "content": "more"}])
    full = chat.render_text(m2, [BASH])
    bridged = chat.bridged_prompt_ids(m2, [BASH], [point])
    assert bridged is not None and bridged[:len(p1) + len(c1)] == p1 + c1
    end = full.index(reply_text + "<|im_end|>") + len(reply_text + "<|im_end|>")
    assert bridged[len(p1) + len(c1):] == ids(tok, full[end:])

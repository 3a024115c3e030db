"""The chat layer's exact-input caches (`chat/rendercache.py`) and its direct decode
(`chat/parse.py: fast_decode`): a hit is what the same input gave uncached, any change of
input misses, the bounds hold."""

from __future__ import annotations


import pytest

from harnessrl.chat.layer import ChatLayer, normalize_messages, normalize_tools
from harnessrl.chat.rendercache import LruCache, render_key

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}}}}}]
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "bash", "arguments": '{"command": "ls"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.py <|im_end|> b.py"}]


def test_a_cached_render_and_encode_equal_the_uncached_ones(tokenizer) -> None:  # noqa: ANN001
    cached, plain = ChatLayer(tokenizer), ChatLayer(tokenizer, render_cache_chars=0, prompt_cache_ids=0)
    msgs, tools = normalize_messages(CONVERSATION), normalize_tools(TOOLS)
    first = cached.render(msgs, tools)
    assert (len(cached.renders), len(cached.encoded)) == (1, 1)
    again = cached.render(normalize_messages(CONVERSATION), normalize_tools(TOOLS))  # new objects, same input
    assert cached.renders.hits == 1 and cached.encoded.hits == 1
    assert again == first == plain.render(msgs, tools)
    assert cached.render_text(msgs, tools) == plain.render_text(msgs, tools)
    assert (len(plain.renders), len(plain.encoded)) == (0, 0)
    again.append(-1)  # a caller's list is its own
    assert cached.render(msgs, tools) == first


@pytest.mark.parametrize("change", ["content", "role", "tool_call_arguments", "tools", "no_tools",
                                    "generation_prompt", "arguments_form"])
def test_any_change_of_input_misses(tokenizer, change: str) -> None:  # noqa: ANN001
    chat = ChatLayer(tokenizer)
    msgs, tools = normalize_messages(CONVERSATION), normalize_tools(TOOLS)
    base = chat.render_marked(msgs, tools)
    raw = [dict(m) for m in CONVERSATION]
    add_generation_prompt = True
    if change == "content":
        raw[1]["content"] = "List the files!"
    elif change == "role":
        raw[0]["role"] = "user"
    elif change == "tool_call_arguments":
        raw[2] = {**raw[2], "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "bash", "arguments": '{"command": "ls -a"}'}}]}
    elif change == "tools":
        tools = normalize_tools([{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "run"}}])
    elif change == "no_tools":
        tools = None
    elif change == "generation_prompt":
        add_generation_prompt = False
    elif change == "arguments_form":
        chat.arguments_as_json_string = not chat.arguments_as_json_string
    text = chat.render_marked(normalize_messages(raw), tools, add_generation_prompt=add_generation_prompt)
    uncached = ChatLayer(tokenizer, render_cache_chars=0)
    uncached.arguments_as_json_string = chat.arguments_as_json_string
    assert chat.renders.hits == 0 and len(chat.renders) == 2
    # (marked texts hold each layer's own nonce: compared as text)
    assert chat.unescape(text) == uncached.unescape(
        uncached.render_marked(normalize_messages(raw), tools, add_generation_prompt=add_generation_prompt))
    if change not in ("arguments_form",):  # SmolLM2's template has no tools: the form changes nothing
        assert text != base


def test_tools_that_are_not_plain_json_are_rendered_uncached(tokenizer) -> None:  # noqa: ANN001
    assert render_key(normalize_messages(CONVERSATION), [{"x": 1 << 70}], True) is None
    assert render_key(normalize_messages(CONVERSATION), None, True) is not None


def test_lru_bounds_by_size_and_entries() -> None:
    cache: LruCache[str] = LruCache(10, len, max_entries=3)
    cache.put("a", "1234")
    cache.put("b", "1234")
    assert cache.get("a") == "1234"  # a is now the most recent
    cache.put("c", "1234")  # 12 > 10: b (least recent) goes
    assert (cache.get("b"), cache.get("a"), cache.get("c"), cache.size) == (None, "1234", "1234", 8)
    cache.put("big", "x" * 11)  # larger than the whole bound: not kept, nothing evicted
    assert cache.get("big") is None and len(cache) == 2
    for key in "def":
        cache.put(key, "1")
    assert len(cache) == 3 and cache.get("a") is None
    assert LruCache(0, len).max_size == 0
    with pytest.raises(ValueError, match="max_size=-1"):
        LruCache(-1, len)

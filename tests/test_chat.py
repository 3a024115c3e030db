"""Chat layer: rendering conventions, tool-call parsing, message validation (SmolLM2 tokenizer)."""

from __future__ import annotations

import json

import pytest

from harnessrl.chat.layer import ChatLayer, Message, ToolCall, normalize_messages, normalize_tools
from harnessrl.errors import RequestError

BASH = {"type": "function", "function": {"name": "bash", "description": "run", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


@pytest.fixture(scope="module")
def chat(tokenizer) -> ChatLayer:
    return ChatLayer(tokenizer)


def test_plain_render_matches_template_and_ends_with_generation_prompt(chat, tokenizer):
    ids = chat.render(normalize_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]))
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_content_parts_render_like_the_string(chat):
    as_parts = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}])
    as_string = normalize_messages([{"role": "user", "content": "a\nb"}])
    assert chat.render(as_parts) == chat.render(as_string)


def test_developer_role_renders_as_system(chat):
    dev = normalize_messages([{"role": "developer", "content": "S"}, {"role": "user", "content": "u"}])
    sys = normalize_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}])
    assert chat.render(dev) == chat.render(sys)


def test_tools_go_to_system_prompt_and_tool_results_to_user_blocks(chat):
    msgs = normalize_messages([
        {"role": "system", "content": "S"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "I'll run it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "b.txt"},
    ])
    text = chat.render_text(msgs, normalize_tools([BASH]))
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert json.dumps(BASH) in text
    assert ("<|im_start|>assistant\nI'll run it.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": "
            "{\"command\": \"ls\"}}\n</tool_call><|im_end|>") in text
    # consecutive tool results share one user message
    assert ("<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\nb.txt\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text


def test_empty_tool_calls_keep_assistant_text_and_reasoning_is_dropped(chat):
    with_empty = normalize_messages([{"role": "user", "content": "u"},
                                     {"role": "assistant", "content": "answer", "tool_calls": [],
                                      "reasoning_content": "secret thoughts"},
                                     {"role": "user", "content": "more"}])
    text = chat.render_text(with_empty)
    assert "<|im_start|>assistant\nanswer<|im_end|>" in text
    assert "secret thoughts" not in text  # SmolLM2's template defines no place for reasoning


def test_parse_tool_calls_and_text(chat, tokenizer):
    text = ('Running.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}\n</tool_call>')
    ids = tokenizer.encode(text, add_special_tokens=False) + [2]
    parsed = chat.parse(ids, has_tools=True, call_id_seed="s:0")
    assert parsed.content == "Running."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("bash", {"command": "ls -la"}), ("bash", {"command": "pwd"})]
    ids_a = [c.id for c in parsed.tool_calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids_a) and len(set(ids_a)) == 2
    assert [c.id for c in chat.parse(ids, True, call_id_seed="s:0").tool_calls] == ids_a  # deterministic
    assert [c.id for c in chat.parse(ids, True, call_id_seed="s:1").tool_calls] != ids_a  # unique per turn
    # without tools in the request the text stays text
    assert chat.parse(ids, has_tools=False).content == text
    assert chat.parse(ids, has_tools=False).tool_calls == []


def test_parse_keeps_broken_tool_call_as_text_and_only_calls_give_none_content(chat, tokenizer):
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert chat.parse(tokenizer.encode(broken, add_special_tokens=False), True).content == broken
    only = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parsed = chat.parse(tokenizer.encode(only, add_special_tokens=False) + [2], True)
    assert parsed.content is None and parsed.tool_calls[0].arguments == "{}"


def test_parse_think_block_becomes_reasoning(chat, tokenizer):
    ids = tokenizer.encode("<think>plan it</think>The answer is 4.", add_special_tokens=False)
    parsed = chat.parse(ids, has_tools=False)
    assert (parsed.reasoning, parsed.content) == ("plan it", "The answer is 4.")


def test_replayed_call_round_trips_through_parse(chat, tokenizer):
    call = ToolCall(id="x", name="write", arguments='{"path": "a.py", "content": "print(1)\\n"}')
    rendered = chat.render_text([Message(role="user", content="u"), Message(role="assistant", content="", tool_calls=(call,))])
    block = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = chat.parse(tokenizer.encode(block, add_special_tokens=False), True)
    assert json.loads(parsed.tool_calls[0].arguments) == json.loads(call.arguments)


@pytest.mark.parametrize(("raw", "param"), [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], "messages[1].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": "a", "audio": {}}], "messages[0].audio"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "user", "content": "a", "tool_calls": [{"function": {"name": "f"}}]}], "messages[0].tool_calls"),
])
def test_normalize_errors_name_the_field(raw, param):
    with pytest.raises(RequestError) as info:
        normalize_messages(raw)
    assert info.value.param == param
    assert param.split("[")[0] in str(info.value)


def test_normalize_tools_rejects_non_function_tools():
    with pytest.raises(RequestError) as info:
        normalize_tools([BASH, {"type": "web_search"}])
    assert info.value.param == "tools[1].type"


def test_a_call_whose_argument_holds_the_closing_tag_is_parsed_whole(chat, tokenizer):
    """An argument holding `</tool_call>` (a file about tool calls) is part of its call's JSON: the
    block ends after the JSON, not at the first closing tag (vLLM #45167), and a call after it
    still comes back second."""
    doc = "Call tools as <tool_call>{...}</tool_call> blocks.\n"
    first = json.dumps({"name": "write", "arguments": {"path": "README.md", "content": doc}})
    text = (f'Writing.\n<tool_call>\n{first}\n</tool_call>\n'
            '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')
    parsed = chat.parse(tokenizer.encode(text, add_special_tokens=False) + [2], True, call_id_seed="s:0")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("write", {"path": "README.md", "content": doc}), ("bash", {"command": "ls"})]
    assert parsed.content == "Writing."
    # a block whose JSON is not followed by its closing tag stays text; the next block still parses
    unclosed = '<tool_call>\n{"name": "f", "arguments": {}} trailing\n'
    parsed = chat.parse(tokenizer.encode(unclosed + text, add_special_tokens=False), True)
    assert [c.name for c in parsed.tool_calls] == ["write", "bash"]
    assert parsed.content == (unclosed + "Writing.").strip()

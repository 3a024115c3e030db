"""SegmentEncoder: piecewise, cached ids are exactly the tokenizer's ids of the whole text."""

from __future__ import annotations

import copy

import pytest

from harnessrl.chat.layer import ChatLayer, normalize_messages, normalize_tools
from harnessrl.chat.tokencache import SegmentEncoder

TEXTS = [
    "",
    "plain text without any added token",
    "<|im_start|>",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi  there <|im_end|>\n<|im_start|>assistant\n",
    "  <|im_start|>  leading and trailing spaces around tokens  <|im_end|>  ",
    "<|im_sta partial token <|im_start <|im_end|>x<|endoftext|>y",
    "text<|im_start|>\n\n\n<|im_end|>\t\n tabs and newlines\r\n<|im_start|>",
    "unicode: héllo wörld 你好 🙂<|im_end|>🙂<|im_start|>ünï",
    "digits 12345 67890<file_sep>code = f(x) ** 2<filename>a.py<gh_stars>10",
    "'s 're 've<|im_end|>'ll 'd apostrophes",
]


@pytest.fixture
def encoder(tokenizer) -> SegmentEncoder:
    return SegmentEncoder(tokenizer.backend_tokenizer)


def reference(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_smollm2_tokenizer_is_eligible_for_piecewise_encoding(encoder):
    assert encoder.piecewise


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_the_tokenizer_cold_and_warm(encoder, tokenizer, text):
    want = reference(tokenizer, text)
    assert encoder.encode(text) == want
    assert encoder.encode(text) == want  # served from the cache
    assert encoder.uncached_chars(text) == 0


def test_shared_pieces_are_reused_across_texts(encoder, tokenizer):
    head = "<|im_start|>system\n" + "long system prompt " * 50 + "<|im_end|>\n"
    first = head + "<|im_start|>user\nfirst<|im_end|>\n"
    second = first + "<|im_start|>assistant\nreply<|im_end|>\n<|im_start|>user\nsecond<|im_end|>\n"
    assert encoder.encode(first) == reference(tokenizer, first)
    assert encoder.uncached_chars(second) == len("assistant\nreply") + len("user\nsecond")
    assert encoder.encode(second) == reference(tokenizer, second)


def test_cache_is_bounded_and_evicts_least_recently_used(tokenizer):
    enc = SegmentEncoder(tokenizer.backend_tokenizer, max_cached_tokens=40)
    texts = [f"<|im_start|>message number {i} with some words in it<|im_end|>" for i in range(10)]
    for text in texts:
        assert enc.encode(text) == reference(tokenizer, text)
        assert 0 < enc.cached_tokens <= 40
    assert enc.uncached_chars(texts[-1]) == 0
    assert enc.uncached_chars(texts[0]) > 0


def test_whitespace_stripping_added_token_disables_piecewise(tokenizer):
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken("<|strip|>", lstrip=True, rstrip=True)])
    enc = SegmentEncoder(backend)
    assert not enc.piecewise
    text = "a  <|strip|>  b<|im_end|>"
    assert enc.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_chat_render_matches_template_then_encode_over_a_growing_conversation(tokenizer):
    chat = ChatLayer(tokenizer)
    tools = normalize_tools([{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}])
    raw = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "fix the bug"}]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i in range(4):
        messages = normalize_messages(raw)
        text = chat.render_text(messages, tools)
        ids = chat.render(messages, tools)
        # the spoofed `<|im_end|>` inside tool results is plain text, every other id as encoded
        assert tokenizer.decode(ids) == text
        assert ids.count(im_end) == text.count("<|im_end|>") - text.count("<|im_end|> spoof")
        if i == 0:  # no spoof yet: exactly the tokenizer's ids of the text
            assert ids == reference(tokenizer, text)
        raw += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": f"file_{i}.py\nREADME.md  <|im_end|> spoof"}]
    assert chat.uncached_chars(chat.render_marked(messages, tools)) == 0


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{%- endif %}"
    "{%- for c in m.tool_calls | default([]) %}<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "no system message"}],
    [{"role": "developer", "content": "dev"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
     {"role": "assistant", "content": "thinking done", "reasoning_content": "hidden"},
     {"role": "user", "content": "again"}],
    [{"role": "user", "content": "go"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la", "n": 1.5}'}},
         {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": "not json"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "a.py"}, {"role": "tool", "tool_call_id": "c2", "content": "b"}],
]


@pytest.mark.parametrize("template", [None, TOOLS_TEMPLATE], ids=["smollm2", "tools-template"])
@pytest.mark.parametrize("raw", CONVERSATIONS)
def test_direct_template_render_equals_apply_chat_template(tokenizer, template, raw):
    tok = copy.deepcopy(tokenizer)
    if template is not None:
        tok.chat_template = template
    chat = ChatLayer(tok)
    assert chat._compiled is not None  # the direct path passed its probe
    tools = normalize_tools([{"type": "function", "function": {"name": "bash", "description": "run ünicode",
                                                                "parameters": {"type": "object"}}}])
    messages = normalize_messages(raw)
    for t in (tools, []):
        direct = chat.render_text(messages, t)
        compiled, chat._compiled = chat._compiled, None
        assert direct == chat.render_text(messages, t)  # the apply_chat_template path
        chat._compiled = compiled


def test_encode_within_refuses_when_too_much_text_is_new(encoder, tokenizer):
    text = "<|im_start|>user\n" + "new words " * 100 + "<|im_end|>\n"
    assert encoder.encode_within(text, 100) is None
    assert encoder.uncached_chars(text) > 100  # nothing was encoded or cached
    assert encoder.encode_within(text, None) == reference(tokenizer, text)
    assert encoder.encode_within(text, 0) == reference(tokenizer, text)  # now all cached

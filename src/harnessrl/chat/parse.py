"""What a completion means: its end-of-sequence ids (`default_eos`) and in it reasoning, content
and hermes tool calls (`parse_text`).

Responsibility: split the decoded text of a completion (EOS stripped, special tokens dropped,
cut at the first stop string: `ChatLayer.parse` does that) into a `ParsedAssistant`; decode
ids the way `tokenizer.decode(ids, skip_special_tokens=True)` does, faster.

Rules. Reasoning: a text starting with `<think>` (after whitespace), or any text when the
prompt itself opened the block (`opened`, Qwen3-style templates), is reasoning up to
`</think>`; one that never closes it (cut at `max_tokens`) is all reasoning, with content ""
and no tool calls (a call written while reasoning is never executed). When the request had
tools, every `<tool_call>` block after the reasoning holding a JSON object with a string
`name` becomes a `ToolCall` (arguments, or `parameters`, re-serialised as a JSON string
unless already one); a block ends at the `</tool_call>` after its JSON object, so an argument
holding that text is kept whole; blocks that fail to parse stay in the text. Call ids are
`call_<24 hex>` from blake2b(`call_id_seed:index`).

What this module deliberately does not do: render prompts (`chat.py`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harnessrl.chat.messages import ToolCall

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedAssistant:
    content: str | None
    """Assistant text; None when the reply is only tool calls."""
    tool_calls: list[ToolCall]
    reasoning: str | None
    stop_sequence: str | None = None
    """The request's stop string at which the text was cut (`ChatLayer.parse`); None when none was
    found (the Messages API reports it as `stop_sequence`)."""


def parse_text(text: str, has_tools: bool, *, opened: bool, call_id_seed: str) -> ParsedAssistant:
    """The assistant reply in `text` (module docstring for the rules); `opened`: the prompt
    ended inside an open `<think>` block."""
    reasoning = None
    lead = len(text) - len(text.lstrip())
    if text.startswith("<think>", lead):
        opened, text = True, text[lead + len("<think>"):]
    if opened:
        end = text.find("</think>")
        if end < 0:  # cut off (or never closed) inside its reasoning: no answer, no calls
            return ParsedAssistant(content="", tool_calls=[], reasoning=text.strip() or None)
        reasoning, text = text[:end].strip(), text[end + len("</think>"):].lstrip()
    if not has_tools:
        return ParsedAssistant(content=text, tool_calls=[], reasoning=reasoning)
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = start = 0
    while (start := text.find(_OPEN, start)) >= 0:
        found = _hermes_block(text, start, _call_id(call_id_seed, len(calls)))
        if found is None:  # not a call: the block stays in the text, look past its opening tag
            start += len(_OPEN)
            continue
        call, end = found
        kept.append(text[pos:start])
        pos = start = end
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return ParsedAssistant(content=content or (None if calls else ""), tool_calls=calls, reasoning=reasoning)


def _hermes_block(text: str, start: int, call_id: str) -> tuple[ToolCall, int] | None:
    """The call in the block whose `<tool_call>` opens at `start`, and the index just past its
    `</tool_call>`; None when the block is not a call. The block ends where its JSON object
    ends (`JSONDecoder.raw_decode`), not at the first closing tag: a string argument may itself
    hold `</tool_call>` (an agent writing a file about tool calls), which a non-greedy
    `<tool_call>(.*?)</tool_call>` would cut, losing the call (vLLM #45167)."""
    body = _skip_space(text, start + len(_OPEN))
    try:
        obj, end = _DECODER.raw_decode(text, body)
    except ValueError:
        return None
    end = _skip_space(text, end)
    if not text.startswith(_CLOSE, end) or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _hermes_call(obj, call_id), end + len(_CLOSE)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _hermes_call(obj: dict[str, object], call_id: str) -> ToolCall:
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(id=call_id, name=str(obj["name"]),
                    arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _call_id(seed: str, index: int) -> str:
    return "call_" + hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=12).hexdigest()


def default_eos(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS id and `<|im_end|>` when the vocabulary
    has it."""
    eos: list[int] = []
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end >= 0 and im_end != tokenizer.unk_token_id and im_end not in eos:
        eos.append(im_end)
    return eos

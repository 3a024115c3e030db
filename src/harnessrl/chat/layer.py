"""The chat layer: the one place where messages + tools render to prompt ids and completion
ids parse back to an assistant message (DESIGN.md §2, "chat layer").

Rendering uses the model's own chat template (`tokenizer.apply_chat_template`, text mode,
`add_generation_prompt=True`), then tokenises the text once with `add_special_tokens=False`
(the template already writes every special token it wants). Conventions, all documented here
because they decide which tokens the model sees:

* Content may be a string, null, or a list of text parts `[{"type": "text", "text": ...}]`;
  text parts are joined with "\\n" (as vLLM does). Other part types are rejected.
* Role `developer` is rendered as `system`.
* Tool calls use the hermes convention: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`. When the template supports tools (its source mentions `tools`), tools and
  replayed tool calls are handed to the template. Otherwise (SmolLM2's template):
    - the tool list is described in the system prompt (`TOOL_SYSTEM_PROMPT`, the hermes /
      Qwen2.5 wording), appended to the first system message or inserted as one;
    - a replayed assistant message renders as its text, then "\\n", then one hermes block per
      call (`tool_calls: []` changes nothing: the text is kept);
    - `tool` messages render as a `user` message holding `<tool_response>\\n...\\n
      </tool_response>`; consecutive tool messages share one user message (Qwen2.5 form).
* `reasoning_content` replayed by an agent is passed to the template when the template
  mentions `reasoning_content`; otherwise it is dropped, as such templates define no place
  for it (the model never saw it as text).

* Tool-call `arguments` on replay go to a tools-aware template in the form it expects,
  detected once from the template (`arguments_as_json_string`): a probe call is rendered
  with a mapping and with a JSON string; a template that iterates the mapping or writes it
  with `tojson` gets the mapping, one that writes or concatenates the string gets the string.
* Nothing the agent wrote becomes control tokens: special-token text (`<|im_end|>`,
  `<|im_start|>`, ...) inside content, reasoning, tool-call arguments, names and ids, a
  message's `name` and `tool_call_id`, and every string of the tool definitions (names,
  descriptions, parameter names, enum values, ...: `escape_json`) is replaced by a marker
  holding a random nonce before the template runs (`render_marked`) and encoded as plain text
  (`SegmentEncoder`, special tokens not extracted), so a tool result cannot forge a system
  turn. Control tokens the template writes stay control tokens; ids the model sampled are
  reused as sampled through bridging. `render_text` returns the real text.

Parsing decodes the completion without its trailing EOS id and without special tokens and cuts
the text where the first of the request's stop strings begins; what the text means (reasoning,
tool calls, content) is `chat/parse.py`'s (`parse_text`, its docstring has the rules).

Exact-input caches (`chat/rendercache.py`): a render is cached by its messages, tools and
generation-prompt flag, and the ids of a rendered prompt text by that text (`render_cache_chars`,
`prompt_cache_ids`), so a prompt sent again costs a lookup; what is returned is what the same
input rendered or encoded before.

Bridged rendering (DESIGN.md §5) is `chat/bridging.py`'s (`BridgedRendering`, which `ChatLayer`
extends): a request that extends an earlier turn gets that turn's exact ids as its head.

What this module deliberately does not do: talk HTTP, sample, or build training rows. The
ids it renders are handed to the engine, which reports the ids it consumed; those are what
get recorded, never a re-render (DESIGN.md §9).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import orjson

from harnessrl.chat.bridging import BridgedRendering, BridgePoint, PromptPlan, json_or_str, same_replay
from harnessrl.chat.messages import Message, Role, ToolCall, normalize_messages, normalize_tools
from harnessrl.chat.parse import ParsedAssistant, default_eos, parse_text
from harnessrl.chat.rendercache import LruCache, render_key
from harnessrl.chat.tokencache import SegmentEncoder
from harnessrl.errors import RequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BridgePoint", "ChatLayer", "Message", "ParsedAssistant", "PromptPlan", "Role", "ToolCall",
           "hermes_tool_call", "normalize_messages", "normalize_tools", "same_replay"]
"""Message records and their validation live in `chat/messages.py`, the meaning of a completion's
text in `chat/parse.py`, bridging's records in `chat/bridging.py`; re-exported here."""

TOOL_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""Tool description added to the system prompt for templates without tool support."""
ENCODE_CACHE_MAX_CHARS = 65_536
"""Longest rendered text whose ids are cached whole (`ChatLayer.encoded`); longer prompts reuse
the per-piece cache of `tokencache.py` only."""

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""Keys `apply_chat_template` aliases to one another (such messages take its own path)."""

CACHED_CALL_CHARS = 4096
"""Longest tool call (name + arguments) whose hermes block is cached (`_hermes_block`); the
cache holds 8,192 entries, so it stays under ~70 MB whatever calls an agent replays."""
CACHED_TOOLS_BYTES = 65_536
"""Longest tool list (its JSON) whose system-prompt description is cached (256 entries)."""


def hermes_tool_call(call: ToolCall) -> str:
    """One call in the hermes convention; arguments as a JSON object when they parse."""
    return _hermes_block(call.name, call.arguments)


def unrendered_message_keys(template: str, has_tools: bool, has_reasoning: bool) -> frozenset[str]:
    """The accepted message keys whose values the prompt never shows (`_template_messages`):
    `reasoning_content` / `reasoning` unless the template mentions `reasoning_content`; `name`
    and `tool_call_id` unless the template renders tools natively and reads them (the hermes
    rendering writes neither). An agent can send megabytes in such a key; recording it would
    grow the trace, `rollouts.jsonl` and the trainer's memory for nothing the model saw."""
    keys = set()
    if not has_reasoning:
        keys |= {"reasoning_content", "reasoning"}
    if not has_tools or not re.search(r"message\s*(\.\s*name\b|\[\s*['\"]name['\"]\s*\])", template):
        keys.add("name")
    if not has_tools or "tool_call_id" not in template:
        keys.add("tool_call_id")
    return frozenset(keys)


def _hermes_block(name: str, arguments: str) -> str:
    # Cached: an agent re-sends every earlier call on each turn; a long call is not kept.
    if len(name) + len(arguments) <= CACHED_CALL_CHARS:
        return _cached_hermes_block(name, arguments)
    return _render_hermes_block(name, arguments)


@functools.lru_cache(maxsize=8192)
def _cached_hermes_block(name: str, arguments: str) -> str:
    return _render_hermes_block(name, arguments)


def _render_hermes_block(name: str, arguments: str) -> str:
    args = json_or_str(arguments)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


class ChatLayer(BridgedRendering):
    """Renders messages to prompt ids and parses completion ids, for one tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        eos_token_ids: ids that end a completion (stripped before parsing); defaults to the
            tokenizer's EOS id and `<|im_end|>` when the vocabulary has it.
        encode_cache_tokens: bound on the ids cached per message piece (`tokencache.py`):
            a re-sent history is not tokenised again; 0 disables the cache.
        render_cache_chars: bound on the characters of rendered prompts cached by their exact
            messages and tools (`rendercache.py`); 0 disables it.
        prompt_cache_ids: bound on the ids of rendered prompt texts (each of at most
            `ENCODE_CACHE_MAX_CHARS` characters) cached by their text; 0 disables it.

    Raises ValueError for a negative cache bound.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int] | None = None,
                 *, encode_cache_tokens: int = 2_000_000, render_cache_chars: int = 4_000_000,
                 prompt_cache_ids: int = 1_000_000) -> None:
        self.renders: LruCache[str] = LruCache(0, len)
        """Rendered prompts by their exact input (`render_key`); enabled once probing is done."""
        self.encoded: LruCache[tuple[int, ...]] = LruCache(0, len)
        """Ids of rendered prompt texts by the text; enabled once probing is done."""
        self.tokenizer = tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.template_has_tools = "tools" in template
        self.template_has_reasoning = "reasoning_content" in template
        self.unrendered_message_keys = unrendered_message_keys(template, self.template_has_tools,
                                                               self.template_has_reasoning)
        """Message keys whose values never reach the prompt under this template (not recorded on
        a turn, `wire.recorded_body`)."""
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else default_eos(tokenizer))
        self._init_escapes()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.segments = SegmentEncoder(backend, encode_cache_tokens, marker=self._marker,
                                       restore=self.unescape) if backend is not None else None
        """Piecewise encoder with a cache of message ids (None for slow tokenizers)."""
        self._max_token_chars: int | None = None
        """Most characters one id decodes to (`min_tokens`); computed at first need."""
        self._template_kwargs: dict[str, Any] = {}
        self._compiled: Any = None
        self.arguments_as_json_string = False
        """Replayed tool-call `arguments` go to the template as the JSON string (True) or as a
        mapping (False); detected from the template (`_detect_arguments_form`)."""
        if self.template_has_tools:
            self.arguments_as_json_string = self._detect_arguments_form()
        self._compiled = self._direct_template(template)
        self.prompt_opens_reasoning = self._detect_open_reasoning()
        """The generation prompt ends inside an open `<think>` block (Qwen3-style thinking
        templates): a completion is reasoning until its `</think>`."""
        self._init_bridging(tokenizer)
        # the probes above rendered uncached (one of them compares two render paths)
        self.renders = LruCache(render_cache_chars, len)
        self.encoded = LruCache(prompt_cache_ids, len, max_entries=1024 if prompt_cache_ids else 0)

    # -- special-token text in content --------------------------------------------------------

    def _init_escapes(self) -> None:
        """Markers for special-token text inside content (module docstring, "Content never
        becomes control tokens"). The marker holds a random nonce, so no content can forge one."""
        specials = sorted({str(t) for t in self.tokenizer.all_special_tokens} | {
            str(t.content) for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values()
            if getattr(t, "special", False)}, key=len, reverse=True)
        specials = [t for t in specials if t]
        self._marker = "\ue000" + secrets.token_hex(8) if specials else ""
        self._escape_to = {t: f"{self._marker}{i}\ue001" for i, t in enumerate(specials)}
        self._escape_from = {v: k for k, v in self._escape_to.items()}
        self._escape_re = re.compile("|".join(re.escape(t) for t in specials)) if specials else None
        self._unescape_re = re.compile(re.escape(self._marker) + r"\d+\ue001") if specials else None

    def escape(self, text: str) -> str:
        """`text` with each special-token string replaced by a marker (content only)."""
        if self._escape_re is None or not text:
            return text
        return self._escape_re.sub(lambda m: self._escape_to[m.group()], text)

    def escape_json(self, value: Any) -> Any:
        """`value` (decoded JSON: a tool definition) with `escape` applied to every string in it,
        keys included; `value` itself when no string in it holds special-token text."""
        if self._escape_re is None:
            return value
        try:
            if self._escape_re.search(orjson.dumps(value).decode()) is None:
                return value
        except TypeError:  # not plain JSON (ints past 64 bits): walked whole
            pass
        return self._escape_value(value)

    def _escape_value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape(k) if isinstance(k, str) else k: self._escape_value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escape_value(v) for v in value]
        return value

    def unescape(self, text: str) -> str:
        """Inverse of `escape` (markers back to the special-token strings)."""
        if self._unescape_re is None or self._marker not in text:
            return text
        return self._unescape_re.sub(lambda m: self._escape_from[m.group()], text)

    def _detect_arguments_form(self) -> bool:
        """Whether the template wants tool-call `arguments` as a JSON string (True) rather than
        a mapping: a probe call is rendered both ways; the mapping wins when it renders its key
        and value without Python's repr (`{'k': ...}`), else the string when it renders the JSON."""
        def probe(arguments: object) -> str | None:
            msgs = [{"role": "user", "content": "u"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"}]
            try:
                text = self.tokenizer.apply_chat_template(msgs, tools=[{"type": "function", "function": {
                    "name": "f", "parameters": {"type": "object"}}}], tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - a template that cannot take this form
                return None
            return text if isinstance(text, str) else None

        as_mapping = probe({"probe_key": "probe_value"})
        if as_mapping is not None and "probe_key" in as_mapping and "probe_value" in as_mapping \
                and "'probe_key'" not in as_mapping:
            return False
        as_string = probe('{"probe_key": "probe_value"}')
        return as_string is not None and '"probe_key": "probe_value"' in as_string

    def _detect_open_reasoning(self) -> bool:
        try:
            text = self.render_text([Message(role="user", content="u")])
        except RequestError:
            return False
        return text.rstrip().endswith("<think>")

    def _direct_template(self, template: str) -> Any:
        """The compiled template `apply_chat_template` renders with, called directly.

        `apply_chat_template` deep-copies every message (and the tools) into plain data on each
        call, about 60% of the render time of a 60 KB conversation; our message dicts are plain
        data already. Used only if it renders a probe conversation exactly as
        `apply_chat_template` does; None otherwise (and on any other transformers layout).
        """
        try:
            # lazy: transformers, heavy; not needed at import
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(template)
            self._template_kwargs = dict(self.tokenizer.special_tokens_map)
        except Exception:  # noqa: BLE001 - any failure keeps the public apply_chat_template path
            return None
        probe = normalize_messages([
            {"role": "system", "content": "S"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "user", "content": "v"}])
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        try:
            via_api = self.render_text(probe, tools)
            self._compiled = compiled
            direct = self.render_text(probe, tools)
        except RequestError:
            return None
        finally:
            self._compiled = None
        return compiled if direct == via_api else None

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Prompt ids for `messages` (+ `tools`), ending with the assistant generation prompt.

        Raises:
            RequestError: the chat template rejected the conversation (param `messages`).
        """
        return self.encode(self.render_marked(messages, tools))

    def render_text(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt text `render` tokenises, as text (module docstring for conventions)."""
        return self.unescape(self.render_marked(messages, tools))

    def render_marked(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None,
                      *, add_generation_prompt: bool = True) -> str:
        """The prompt text with special-token text inside content replaced by markers; `encode`
        turns the markers into plain-text ids. Raises `RequestError` like `render`. Cached by
        the exact input (`renders`)."""
        key = None
        if self.renders.max_size:  # keyed by every input of the render, the layer's settings too
            key = render_key(messages, tools, add_generation_prompt,
                             (self.arguments_as_json_string, self.template_has_tools, self.template_has_reasoning))
        if key is not None and (text := self.renders.get(key)) is not None:
            return text
        text = self._render_marked(messages, tools, add_generation_prompt)
        if key is not None:
            self.renders.put(key, text)
        return text

    def discard_render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> None:
        """Drop the cached render of this input (`renders`), e.g. of a call that was refused
        after rendering (its prompt too long for the context): a refused call keeps nothing."""
        if self.renders.max_size:
            key = render_key(messages, tools, True,
                             (self.arguments_as_json_string, self.template_has_tools, self.template_has_reasoning))
            if key is not None:
                self.renders.discard(key)

    def _render_marked(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
                       add_generation_prompt: bool) -> str:
        dicts = self._template_messages(messages, tools or [])
        template_tools = [self.escape_json(t) for t in tools] if tools and self.template_has_tools else None
        try:
            if self._compiled is not None and not any(k in d for d in dicts for k in _REASONING_KEYS):
                text = self._compiled.render(messages=dicts, tools=template_tools, documents=None,
                                             add_generation_prompt=add_generation_prompt, **self._template_kwargs)
            else:
                text = self.tokenizer.apply_chat_template(dicts, tools=template_tools, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja raises arbitrary types (TemplateError, TypeError)
            raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
        assert isinstance(text, str), f"apply_chat_template returned {type(text).__name__}"
        return text

    def encode(self, text: str) -> list[int]:
        """Ids of rendered prompt `text`: exactly `tokenizer.encode(text, add_special_tokens=False)`
        (tested), through the Rust backend and the per-message cache when there is one. Text from
        `render_marked` has its escaped content encoded as plain text (no control tokens). A text
        of at most `ENCODE_CACHE_MAX_CHARS` encoded before returns the same ids (`encoded`)."""
        cacheable = self.encoded.max_entries > 0 and len(text) <= ENCODE_CACHE_MAX_CHARS
        if cacheable and (ids := self.encoded.get(text)) is not None:
            return list(ids)
        out = self._encode(text)
        if cacheable:
            self.encoded.put(text, tuple(out))
        return out

    def _encode(self, text: str) -> list[int]:
        if self.segments is not None:
            return self.segments.encode(text)
        if self._marker and self._marker in text:
            return self._encode_marked_slow(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_marked_slow(self, text: str) -> list[int]:
        # Slow tokenizers: the pieces between markers as usual, each escaped run as plain text.
        out: list[int] = []
        pos = 0
        assert self._unescape_re is not None
        for m in self._unescape_re.finditer(text):
            out += self.tokenizer.encode(text[pos:m.start()], add_special_tokens=False)
            out += self.tokenizer.encode(self._escape_from[m.group()], add_special_tokens=False,
                                         split_special_tokens=True)
            pos = m.end()
        return out + list(self.tokenizer.encode(text[pos:], add_special_tokens=False))

    def encode_within(self, text: str, max_uncached_chars: int) -> list[int] | None:
        """`encode(text)` when at most `max_uncached_chars` characters of it are new to the
        cache, else None (the caller encodes in a worker thread instead)."""
        cacheable = self.encoded.max_entries > 0 and len(text) <= ENCODE_CACHE_MAX_CHARS
        if cacheable and (ids := self.encoded.get(text)) is not None:
            return list(ids)
        if self.segments is not None:
            out = self.segments.encode_within(text, max_uncached_chars)
        else:
            out = self._encode(text) if len(text) <= max_uncached_chars else None
        if cacheable and out is not None:
            self.encoded.put(text, tuple(out))
        return out

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` without encoding: the characters of `text` over
        the most characters one id can stand for (the longest entry of the vocabulary, added
        tokens included: a byte-level or sentencepiece token decodes to at most that many
        characters). 0 (no bound) for a tokenizer with a normalizer, which may drop characters,
        or without a Rust backend. So a prompt far past the context is refused before it is
        tokenised (seconds of CPU and memory the allocator keeps, for a 6 MiB prompt)."""
        if self._max_token_chars is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            chars = 0
            if backend is not None and backend.normalizer is None:
                try:
                    chars = max(map(len, backend.get_vocab(with_added_tokens=True)), default=0)
                except Exception:  # noqa: BLE001 - no bound rather than a wrong one
                    chars = 0
            self._max_token_chars = chars
        return len(text) // self._max_token_chars if self._max_token_chars else 0

    def uncached_chars(self, text: str) -> int:
        """Characters of `text` that `encode` would still have to tokenise."""
        return self.segments.uncached_chars(text) if self.segments is not None else len(text)

    def _template_messages(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if self.template_has_tools:
                out.append(self._native_message(m))
            elif m.role == "tool":
                block = "<tool_response>\n" + self.escape(m.content) + "\n</tool_response>"
                if out and out[-1].get("_tool_responses"):
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "_tool_responses": True})
            elif m.role == "assistant" and m.tool_calls:
                blocks = "\n".join(_hermes_block(self.escape(c.name), self.escape(c.arguments)) for c in m.tool_calls)
                out.append(self._with_reasoning({"role": "assistant",
                                                 "content": (self.escape(m.content) + "\n" if m.content else "")
                                                 + blocks}, m))
            else:
                out.append(self._with_reasoning({"role": m.role, "content": self.escape(m.content)}, m))
        for d in out:
            d.pop("_tool_responses", None)
        if tools and not self.template_has_tools:
            described = TOOL_SYSTEM_PROMPT.format(tools=self.escape(_tools_text(tools)))
            if out and out[0]["role"] == "system":
                out[0]["content"] = out[0]["content"] + "\n\n" + described
            else:
                out.insert(0, {"role": "system", "content": described})
        return out

    def _native_message(self, m: Message) -> dict[str, Any]:
        esc = self.escape
        d: dict[str, Any] = {"role": m.role, "content": esc(m.content)}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": esc(c.id), "type": "function", "function": {
                    "name": esc(c.name), "arguments": esc(c.arguments) if self.arguments_as_json_string
                    else json_or_str(esc(c.arguments))}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = esc(m.tool_call_id)
        if m.name is not None:
            d["name"] = esc(m.name)
        return self._with_reasoning(d, m)

    def _with_reasoning(self, d: dict[str, Any], m: Message) -> dict[str, Any]:
        if m.reasoning and self.template_has_reasoning:
            d["reasoning_content"] = self.escape(m.reasoning)
        return d

    def parse(self, completion_ids: Sequence[int], has_tools: bool, *, call_id_seed: str = "",
              stop: Sequence[str] = (), reasoning_open: bool | None = None) -> ParsedAssistant:
        """Parse sampled ids into assistant text, tool calls (when `has_tools`) and reasoning.

        Args:
            stop: the request's stop strings; the text ends where the first one found begins
                (the ids keep everything sampled), and that string is the parse's `stop_sequence`.
            reasoning_open: the prompt ended inside an open `<think>` block; defaults to
                `prompt_opens_reasoning`. Then the completion is reasoning up to `</think>`.

        A completion that starts with `<think>` (or whose prompt opened one) and never closes it
        is all reasoning: content "", no tool calls (a call written while reasoning is never
        executed). Tool calls are parsed from the text after the reasoning only.

        Tool call ids are `call_<24 hex>` from blake2b(`call_id_seed:index`); pass a seed
        unique per turn (the proxy uses `session_id:turn_index`). With no seed, the ids are
        derived from the completion ids.
        """
        ids = list(completion_ids)
        if ids and ids[-1] in self.eos_token_ids:
            ids.pop()
        text = cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one string
        matched = None
        cuts = [(i, n, s) for n, s in enumerate(stop) if s and (i := text.find(s)) >= 0]
        if cuts:
            at, _, matched = min(cuts)  # the earliest in the text; the first listed on a tie
            text = text[:at]
        opened = self.prompt_opens_reasoning if reasoning_open is None else reasoning_open
        seed = (call_id_seed or hashlib.blake2b(repr(completion_ids).encode(), digest_size=8).hexdigest()
                if has_tools else "")
        parsed = parse_text(text, has_tools, opened=opened, call_id_seed=seed)
        return parsed if matched is None else dataclasses.replace(parsed, stop_sequence=matched)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own (the `token` of OpenAI logprobs entries)."""
        return self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)


def _tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """The tool list as `TOOL_SYSTEM_PROMPT` shows it: one JSON object per line."""
    try:
        key = orjson.dumps(list(tools))
    except TypeError:  # not plain JSON (e.g. ints above 64 bits): described without the cache
        key = None
    if key is None or len(key) > CACHED_TOOLS_BYTES:  # a long list is not kept
        return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return _described_tools(key)


@functools.lru_cache(maxsize=256)
def _described_tools(key: bytes) -> str:
    # Keyed by the tools' exact JSON (orjson keeps key order and round-trips every value).
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in orjson.loads(key))

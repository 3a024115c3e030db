"""Bridged rendering (DESIGN.md §5): a request that extends an earlier turn is given that turn's
exact ids as the head of its prompt, so the engine sees its own sampled ids again.

The public question "does this request extend an earlier turn, and what are its bridged prompt
ids" is `find_bridge` / `plan_prompt` / `bridged_prompt_ids` (or `render_bridged` from
`(messages, prompt_ids, completion_ids)` tuples). A finished turn leaves a `BridgePoint`
(`bridge_point`: its request messages, the reply the agent got, its exact `prompt_ids +
completion_ids`). A request extends point P when its messages are P's messages, then P's reply
as the agent replays it (`same_replay`), then at least one new message, with the same tools. Its
prompt is then P's ids followed by the template's own framing of the new messages
(`bridge_suffix`): the conversation is rendered with P's reply replaced by a sentinel, and the
text after the sentinel, from the end of the template's end-of-turn token on, is encoded and
appended; a reply that ended without an EOS id (cut at `max_tokens` or by a stop string) gets
the end-of-turn framing too. So the engine sees its own sampled ids whatever the template does
to history (reasoning stripped, tool calls re-serialised, whitespace normalised), and the next
prompt extends the row (CLEAN). A request that extends no point (compaction, rewritten history,
a sub-agent, other tools) renders normally.

`BridgedRendering` holds these methods; `chat/layer.py`'s `ChatLayer` extends it and supplies
what they use: `render_marked`, `encode`, `parse` and `eos_token_ids`, and calls `_init_bridging`
with its tokenizer once `eos_token_ids` is set.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harnessrl.chat.messages import Message
from harnessrl.chat.parse import ParsedAssistant
from harnessrl.errors import RequestError


@dataclass(frozen=True, slots=True)
class BridgePoint:
    """A finished turn, as bridged rendering needs it (`ChatLayer.bridge_point`)."""

    turn_index: int
    messages: tuple[Message, ...]
    """The request's messages."""
    tools: tuple[dict[str, Any], ...]
    reply: Message
    """The assistant message the agent was given."""
    ids: tuple[int, ...]
    """`prompt_ids + completion_ids` exactly as the engine consumed and sampled them."""
    ended: bool
    """The completion ends with an EOS id (else the bridge adds the end-of-turn framing)."""


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """Prompt ids of a request are `head_ids + ChatLayer.encode(text)`."""

    head_ids: list[int]
    """An earlier turn's exact prompt + completion ids (empty unless bridged)."""
    text: str
    """Marked text to encode after `head_ids` (the whole render when not bridged)."""
    bridged_from: int | None
    """`turn_index` of the turn bridged on, or None."""


def same_replay(a: Message, b: Message) -> bool:
    """Whether `a` is `b` as an agent replays it: equal, or both assistant messages with the
    same text up to surrounding whitespace and the same tool calls (name, and arguments equal
    as JSON); reasoning and call ids are not compared (agents drop or rewrite them)."""
    if a == b:
        return True
    if a.role != "assistant" or b.role != "assistant" or a.content.strip() != b.content.strip() \
            or len(a.tool_calls) != len(b.tool_calls):
        return False
    return all(x.name == y.name and (x.arguments == y.arguments or json_or_str(x.arguments) == json_or_str(y.arguments))
               for x, y in zip(a.tool_calls, b.tool_calls))


def json_or_str(arguments: str) -> object:
    """`arguments` parsed as JSON, or the string itself when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class BridgedRendering:
    """The bridging half of `ChatLayer` (module docstring)."""

    eos_token_ids: frozenset[int]

    def _init_bridging(self, tokenizer: Any) -> None:
        """The sentinel `bridge_suffix` renders in place of a reply (random, so no content can
        hold it) and the pattern of the end-of-turn texts (those of `eos_token_ids`)."""
        self._bridge_sentinel = "\ue002" + secrets.token_hex(8) + "\ue003"
        eos_texts = sorted({t for t in tokenizer.convert_ids_to_tokens(sorted(self.eos_token_ids)) if t},
                           key=len, reverse=True)
        self._eos_text_re = re.compile("|".join(re.escape(t) for t in eos_texts)) if eos_texts else None

    if TYPE_CHECKING:  # supplied by ChatLayer
        def render_marked(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None,
                          *, add_generation_prompt: bool = True) -> str: ...

        def encode(self, text: str) -> list[int]: ...

        def parse(self, completion_ids: Sequence[int], has_tools: bool, *, call_id_seed: str = "",
                  stop: Sequence[str] = (), reasoning_open: bool | None = None) -> ParsedAssistant: ...

    def bridge_point(self, turn_index: int, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
                     reply: ParsedAssistant, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> BridgePoint:
        """What a finished turn leaves for bridging: its request, the reply the agent got, and
        the exact ids the engine consumed and sampled."""
        return BridgePoint(
            turn_index=turn_index, messages=tuple(messages), tools=tuple(tools or ()),
            reply=Message(role="assistant", content=reply.content or "", tool_calls=tuple(reply.tool_calls),
                          reasoning=reply.reasoning),
            ids=tuple(prompt_ids) + tuple(completion_ids),  # the engine's tuples: one copy
            ended=bool(completion_ids) and completion_ids[-1] in self.eos_token_ids)

    def find_bridge(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
                    points: Sequence[BridgePoint]) -> BridgePoint | None:
        """The earlier turn that `messages` extend, or None.

        `messages` extend point P when they start with P's request messages, then P's reply as
        the agent replays it (`same_replay`: same text up to surrounding whitespace, same tool
        calls up to JSON formatting; reasoning may be dropped), then at least one new message,
        with the same tools. The longest such P wins (the latest on ties).
        """
        tools_t = tuple(tools or ())
        best: BridgePoint | None = None
        n = len(messages)
        for point in points:
            k = len(point.messages)
            if k + 2 > n or (best is not None and k < len(best.messages)) or point.tools != tools_t:
                continue
            if same_replay(messages[k], point.reply) and all(
                    same_replay(a, b) for a, b in zip(messages[:k], point.messages)):
                best = point
        return best

    def bridge_suffix(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
                      point: BridgePoint) -> str | None:
        """The (marked) text that follows `point.ids` for `messages`: the template's framing of
        the messages after point's reply, and the generation prompt. None when the template
        cannot say (the request is rendered normally).

        Derived from the template itself: the conversation is rendered with point's reply
        replaced by a sentinel text; what follows the sentinel, from the end of the template's
        end-of-turn token on, is the new messages' framing. A reply that ended without an EOS id
        (cut at `max_tokens`, or by a stop string) gets the whole end-of-turn framing too.
        """
        k = len(point.messages)
        probe = Message(role="assistant", content=self._bridge_sentinel,
                        tool_calls=point.reply.tool_calls if point.ended else ())
        try:
            text = self.render_marked([*messages[:k], probe, *messages[k + 1:]], tools)
        except RequestError:
            return None
        at = text.find(self._bridge_sentinel)
        if at < 0 or text.find(self._bridge_sentinel, at + 1) >= 0:
            return None
        tail = text[at + len(self._bridge_sentinel):]
        eot = self._eos_text_re.search(tail) if self._eos_text_re is not None else None
        if eot is None:
            return tail if point.ended else None
        return tail[eot.end():] if point.ended else tail[eot.start():]

    def plan_prompt(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None,
                    points: Sequence[BridgePoint] = ()) -> PromptPlan:
        """How to build the prompt ids of a request: `head_ids + encode(text)`.

        Bridged (`bridged_from` set) when `find_bridge` finds an earlier turn these messages
        extend and `bridge_suffix` can frame the new messages; else a normal render (empty
        head). Raises `RequestError` like `render`.
        """
        point = self.find_bridge(messages, tools, points) if points else None
        if point is not None:
            suffix = self.bridge_suffix(messages, tools, point)
            if suffix is not None:
                return PromptPlan(head_ids=list(point.ids), text=suffix, bridged_from=point.turn_index)
        return PromptPlan(head_ids=[], text=self.render_marked(messages, tools), bridged_from=None)

    def render_bridged(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
                       prior: Sequence[tuple[Sequence[Message], Sequence[int], Sequence[int]]]) -> list[int]:
        """Prompt ids of `messages`, bridged on the earlier turns `prior` when they extend one.

        `prior` holds `(messages, prompt_ids, completion_ids)` of earlier turns in order; each
        reply is what `parse` makes of its completion (the agent replays that). Without a
        match this is `render(messages, tools)`.
        """
        points = [self.bridge_point(i, msgs, tools, self.parse(c, bool(tools)), p, c)
                  for i, (msgs, p, c) in enumerate(prior)]
        plan = self.plan_prompt(messages, tools, points)
        return plan.head_ids + self.encode(plan.text)

    def bridged_prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
                           points: Sequence[BridgePoint]) -> list[int] | None:
        """Prompt ids of `messages` bridged on an earlier turn, or None when they extend none."""
        plan = self.plan_prompt(messages, tools, points)
        return None if plan.bridged_from is None else plan.head_ids + self.encode(plan.text)

"""The template doctor: a preflight of a model's chat template, run by `harnessrl doctor` and at
the start of `harnessrl train` (`quick_line`).

Responsibility: say, before a run, whether training on this model + harness keeps every sampled
token trainable and aligned. Template probes (no model weights, no engine) each play a two-turn
conversation the way the proxy and an agent do: render turn 1 with the chat layer, take a reply
as the model would sample it (ids ending with the template's end-of-turn token), parse it with
the chat layer, replay it as the agent would (parsed content, tool calls, reasoning), add the
next message, render turn 2, and build training rows from the two turns with the samples
builder itself. A probe is CLEAN when turn 2's prompt extends turn 1's `prompt + completion`.

Probes (`PROBES`): `multi_turn` (plain text), `non_canonical_ids` (a reply sampled as ids that
re-tokenise differently, as sampling often yields), `trailing_whitespace` (a reply ending in
newlines), `tool_call` (a hermes call, its `tool` result), `reasoning` (a `<think>` block,
replayed as `reasoning_content`), `content_parts` (content as lists of text parts).

Findings per probe: the merge kind, the sampled tokens the builder leaves untrained, an example
of the divergence (what was sampled vs what the template re-renders), and whether bridged
rendering (DESIGN.md §5) covers it. Template facts: EOS ids (the engine's, from the model's
generation config, and the chat layer's), the generation prompt, the end-of-turn text, whether
a tool call round-trips through render and parse.

Exit code (`DoctorReport.exit_code`): 1 when training would silently lose or misalign tokens:
a probe leaves sampled tokens untrained (the builder's invariant is that none are; bridging
covering the case also clears it), the template rejects a replayed conversation (every such
turn becomes an error), a tool call does not round-trip, or the template's end-of-turn token is
not an EOS id of the engine (replies would run past the turn); 0 otherwise. A FORK keeps every
sampled token trained (in a new row, its context computed again): reported as a warning when
bridging does not cover it.
With a harness, `harnessrl doctor` (`doctor.py`) also runs a short real rollout and the same
rule applies to its main chain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harnessrl.chat.layer import ChatLayer, normalize_messages
from harnessrl.errors import RequestError
from harnessrl.train.samples import build_rows, common_prefix_len
from harnessrl.types import Rollout, Trace, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


PROBE_LOGPROB = -0.5
"""Logprob given to the probes' simulated sampled ids (any valid value; only ids matter)."""

_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
_SYSTEM = {"role": "system", "content": (
    "You are a helpful assistant. Answer the user's questions briefly and exactly; use the tools you are "
    "given when they help, and say so when you do not know.")}
"""Longer than the builder's `main_prefix_tokens` (32): a forked second turn stays on the main chain."""


@dataclass(frozen=True, slots=True)
class Probe:
    name: str
    feature: str
    """What the probe exercises, in words (shown in the report)."""
    first: list[dict[str, Any]]
    """Messages of turn 1 (OpenAI chat form)."""
    reply: str
    """The text the model samples on turn 1 (after the generation prompt), without EOS."""
    follow: list[dict[str, Any]]
    """Messages the agent adds after replaying the reply."""
    tools: list[dict[str, Any]] | None = None
    non_canonical: bool = False
    """Sample the reply's first word one character per id (ids that re-tokenise differently)."""
    parts: bool = False
    """The agent replays the reply's content as a list of text parts."""


PROBES: tuple[Probe, ...] = (
    Probe("multi_turn", "plain multi-turn text",
          [_SYSTEM, {"role": "user", "content": "What is 2 + 2?"}], "The answer is 4.",
          [{"role": "user", "content": "And 3 + 3?"}]),
    Probe("non_canonical_ids", "a reply sampled as ids that re-tokenise differently",
          [_SYSTEM, {"role": "user", "content": "Say hello."}], "Hello there, friend.",
          [{"role": "user", "content": "Again."}], non_canonical=True),
    Probe("trailing_whitespace", "a reply ending in newlines",
          [_SYSTEM, {"role": "user", "content": "Write one word."}], "Done.\n\n",
          [{"role": "user", "content": "Another."}]),
    Probe("tool_call", "a tool call and its result",
          [_SYSTEM, {"role": "user", "content": "Weather in Paris?"}], _CALL_TEXT,
          [{"role": "tool", "tool_call_id": "", "content": "18 C, sunny"}], tools=_TOOLS),
    Probe("reasoning", "reasoning content (<think>) replayed as reasoning_content",
          [_SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
          "<think>\nAdd two and two.\n</think>\n\n4",
          [{"role": "user", "content": "And 3 + 3?"}]),
    Probe("content_parts", "content as lists of text parts",
          [_SYSTEM, {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}],
          "It is 4.", [{"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]}], parts=True),
)


@dataclass(slots=True)
class ProbeFinding:
    probe: str
    feature: str
    kind: str
    """`clean`, `realign`, `fork`, or `rejected` (the template raised on the replay)."""
    sampled_tokens: int = 0
    untrained_sampled_tokens: int = 0
    example: str = ""
    """The divergence: `sampled ... | re-rendered ...` (repr'd text around the first differing id)."""
    bridged: str = "bridging: not available"
    """`clean`, another kind, or `bridging: not available` when the chat layer has none."""
    note: str = ""

    @property
    def loses_tokens(self) -> bool:
        """True when training would lose or misalign sampled tokens for this case."""
        if self.bridged == "clean":
            return False
        return self.kind == "rejected" or self.untrained_sampled_tokens > 0


@dataclass(slots=True)
class DoctorReport:
    """Everything `harnessrl doctor` found; `lines()` prints it, `exit_code` decides."""

    model: str
    engine_eos: dict[int, str]
    chat_eos: dict[int, str]
    generation_prompt: str
    end_of_turn: str
    end_of_turn_id: int | None
    findings: list[ProbeFinding]
    tool_roundtrip: str
    """`ok` or why not."""
    reasoning_split: str
    """`ok` or why not (a `<think>` reply's reasoning must not come back as content)."""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rollout: dict[str, Any] | None = None
    """With a harness: `harness`, `turns`, `frac_clean/realign/fork`, `sampled`,
    `untrained_sampled_tokens`, `example`."""

    @property
    def clean_fraction(self) -> float:
        """Fraction of probes whose second turn merges CLEAN (bridged when bridging covers it)."""
        n = len(self.findings)
        return sum(f.kind == "clean" or f.bridged == "clean" for f in self.findings) / n if n else 0.0

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def one_line(self) -> str:
        """The line `harnessrl train` logs at start."""
        n = len(self.findings)
        clean = sum(f.kind == "clean" or f.bridged == "clean" for f in self.findings)
        head = f"template doctor ({self.model}): CLEAN on {clean}/{n} probes"
        if not self.problems:
            return head + "; ok"
        return f"{head}; {len(self.problems)} problem(s): {self.problems[0]}; run `harnessrl doctor --model {self.model}`"

    def lines(self) -> list[str]:
        out = [f"harnessrl doctor: {self.model}",
               f"  EOS ids (engine): {_ids(self.engine_eos)}; chat layer strips {_ids(self.chat_eos)}",
               f"  generation prompt: {self.generation_prompt!r}",
               f"  end of an assistant turn: {self.end_of_turn!r} (id {self.end_of_turn_id})",
               f"  tool calls round-trip (render -> parse): {self.tool_roundtrip}",
               f"  reasoning split from the reply: {self.reasoning_split}",
               "  re-rendering history (turn 2 prompt vs turn 1 prompt + sampled reply):"]
        for f in self.findings:
            mark = "ok  " if not f.loses_tokens else "LOSS"
            bridged = "bridged: CLEAN" if f.bridged == "clean" else f.bridged
            out.append(f"   {mark} {f.probe:20s} re-rendered: {f.kind.upper():8s} untrained {f.untrained_sampled_tokens}/"
                       f"{f.sampled_tokens} sampled; {bridged}  ({f.feature})")
            if f.example:
                out.append(f"        {f.example}")
            if f.note:
                out.append(f"        {f.note}")
        out.append(f"  expected CLEAN fraction: {self.clean_fraction:.2f} of probes")
        if self.rollout is not None:
            r = self.rollout
            out.append(f"  rollout ({r['harness']}): {r['turns']} turns, CLEAN {r['frac_clean']:.2f} REALIGN "
                       f"{r['frac_realign']:.2f} FORK {r['frac_fork']:.2f}; untrained sampled tokens "
                       f"{r['untrained_sampled_tokens']}/{r['sampled']}")
            if r.get("example"):
                out.append(f"        {r['example']}")
        out += [f"  warning: {w}" for w in self.warnings]
        out += [f"  PROBLEM: {p}" for p in self.problems]
        out.append("  verdict: " + ("ok: every sampled token trains, aligned" if not self.problems
                                    else "training on this pair would lose or misalign tokens (exit 1)"))
        return out


def _ids(d: dict[int, str]) -> str:
    return ", ".join(f"{k} {v!r}" for k, v in d.items()) or "none"


def _bridge_fn(chat: ChatLayer) -> Callable[..., list[int] | None] | None:
    """The chat layer's bridged rendering (DESIGN.md §5), or None when it has none.

    Uses `ChatLayer.bridge_point` (what a finished turn leaves) and
    `ChatLayer.bridged_prompt_ids(messages, tools, points)` (ids, or None when the messages
    extend no earlier turn). The returned function takes `(messages, tools, turn1)` with
    `turn1 = (messages, parsed reply, prompt_ids, completion_ids)`.
    """
    point_fn = getattr(chat, "bridge_point", None)
    ids_fn = getattr(chat, "bridged_prompt_ids", None)
    if not callable(point_fn) or not callable(ids_fn):
        return None

    def bridged(messages: Any, tools: Any, turn1: tuple[Any, Any, list[int], list[int]]) -> list[int] | None:
        first, parsed, p1, c1 = turn1
        return ids_fn(messages, tools, [point_fn(0, first, tools, parsed, p1, c1)])

    return bridged


def diagnose_template(tokenizer: PreTrainedTokenizerBase, *, model: str = "",
                      engine_eos: Sequence[int] | None = None) -> DoctorReport:
    """Run every probe on `tokenizer`'s chat template (module docstring).

    Args:
        tokenizer: a tokenizer with a chat template.
        model: shown in the report.
        engine_eos: the engine's EOS ids (None: the chat layer's defaults).
    """
    chat = ChatLayer(tokenizer, encode_cache_tokens=0)
    engine = tuple(engine_eos) if engine_eos is not None else tuple(sorted(chat.eos_token_ids))
    def name(ids: Sequence[int]) -> dict[int, str]:
        return {i: str(tokenizer.convert_ids_to_tokens(i)) for i in ids}

    gen_prompt, end_text = _framing(tokenizer, chat)
    end_ids = chat.encode(end_text) if end_text else []
    end_id = end_ids[0] if end_ids else None
    stop_id = end_id if end_id in engine else (engine[0] if engine else None)
    findings = [_run_probe(chat, p, stop_id, gen_prompt) for p in PROBES]
    report = DoctorReport(model=model, engine_eos=name(engine), chat_eos=name(sorted(chat.eos_token_ids)),
                          generation_prompt=gen_prompt, end_of_turn=end_text, end_of_turn_id=end_id,
                          findings=findings, tool_roundtrip=_tool_roundtrip(chat, stop_id, gen_prompt),
                          reasoning_split=_reasoning_split(chat, gen_prompt, stop_id))
    if not engine:
        report.problems.append("the model declares no EOS id: replies end only at max_tokens")
    elif end_id is not None and end_id not in engine:
        report.problems.append(f"the template ends a turn with {end_text!r} (id {end_id}), which is not an "
                               f"EOS id of the engine ({sorted(engine)}): replies run past the turn")
    if report.tool_roundtrip != "ok":
        report.problems.append(f"tool calls do not round-trip: {report.tool_roundtrip}")
    for f in findings:
        if f.loses_tokens:
            what = ("the template rejects the replayed conversation" if f.kind == "rejected" else
                    f"{f.untrained_sampled_tokens} of {f.sampled_tokens} sampled tokens untrained ({f.kind.upper()})")
            report.problems.append(f"{f.probe}: {what}")
        elif f.kind == "fork" and f.bridged != "clean":
            report.warnings.append(f"{f.probe}: turn 2 FORKs (a new row: its context is computed again)")
    if report.reasoning_split != "ok":
        report.warnings.append(f"reasoning: {report.reasoning_split}")
    return report


def _framing(tokenizer: PreTrainedTokenizerBase, chat: ChatLayer) -> tuple[str, str]:
    """(generation prompt, text the template writes right after an assistant's content)."""
    user = [{"role": "user", "content": "u"}]
    try:
        with_gen = chat.render_text(normalize_messages(user))
        without = str(tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=False))
        marker = "MARKERxyz"
        turn = str(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": marker}],
                                                 tokenize=False, add_generation_prompt=False))
    except Exception:  # noqa: BLE001 - reported as unknown framing
        return "", ""
    gen = with_gen[len(without):] if with_gen.startswith(without) else with_gen
    end = turn.split(marker, 1)[1] if marker in turn else ""
    return gen, end


def _as_sampled(reply: str, gen_prompt: str) -> str:
    """`reply` as the model writes it after `gen_prompt`: when the generation prompt opens a
    `<think>` block, the model continues inside it (an empty one when the reply has none)."""
    if not gen_prompt.rstrip().endswith("<think>"):
        return reply
    if reply.startswith("<think>\n"):
        return reply[len("<think>\n"):]
    return "\n</think>\n\n" + reply


def _sampled_ids(chat: ChatLayer, text: str, stop_id: int | None, non_canonical: bool = False) -> list[int]:
    """Ids of `text` + the stop id; `non_canonical`: the first word (after a closed empty
    `<think>` block, if any) one id per character."""
    head, sep, body = text.rpartition("</think>\n\n")
    if non_canonical and sep:
        return chat.encode(head + sep) + _sampled_ids(chat, body, stop_id, True)
    if non_canonical:
        word, rest = (text.split(" ", 1) + [""])[:2]
        ids = [i for ch in word for i in chat.encode(ch)] + (chat.encode(" " + rest) if rest else [])
    else:
        ids = chat.encode(text)
    return ids + ([stop_id] if stop_id is not None else [])


def _replay(parsed: Any, parts: bool) -> dict[str, Any]:
    """The assistant message an agent sends back for a parsed reply."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parts and parsed.content is not None:
        msg["content"] = [{"type": "text", "text": parsed.content}]
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in parsed.tool_calls]
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    return msg


def _run_probe(chat: ChatLayer, probe: Probe, stop_id: int | None, gen_prompt: str = "") -> ProbeFinding:
    finding = ProbeFinding(probe=probe.name, feature=probe.feature, kind="rejected")
    try:
        first = normalize_messages(probe.first)
        p1 = chat.render(first, probe.tools)
    except RequestError as exc:
        finding.note = f"turn 1 does not render: {exc}"
        return finding
    c1 = _sampled_ids(chat, _as_sampled(probe.reply, gen_prompt), stop_id, probe.non_canonical)
    finding.sampled_tokens = len(c1)
    parsed = chat.parse(c1, bool(probe.tools), call_id_seed="doctor")
    follow = [dict(m) for m in probe.follow]
    for m in follow:
        if m.get("role") == "tool" and parsed.tool_calls:
            m["tool_call_id"] = parsed.tool_calls[0].id
    raw2 = [*probe.first, _replay(parsed, probe.parts), *follow]
    try:
        second = normalize_messages(raw2)
        p2 = chat.render(second, probe.tools)
    except RequestError as exc:
        finding.note = f"turn 2 (the replayed reply) does not render: {exc}"
        return finding
    c2 = _sampled_ids(chat, "OK.", stop_id)
    kind, untrained = _merge(p1, c1, p2, c2)
    finding.kind, finding.untrained_sampled_tokens = kind, untrained
    if kind != "clean":
        finding.example = divergence_text(chat, [*p1, *c1], p2)
    bridge = _bridge_fn(chat)
    if bridge is not None:
        try:
            b2 = bridge(second, probe.tools, (first, parsed, p1, c1))
        except RequestError as exc:
            finding.bridged = f"bridged: rejected ({exc})"
        else:
            if b2 is None:
                finding.bridged = "bridging: does not apply (rendered normally)"
            else:
                bkind, bun = _merge(p1, c1, list(b2), c2)
                finding.bridged = "clean" if bkind == "clean" and bun == 0 else f"bridged: {bkind.upper()}"
    return finding


def _merge(p1: list[int], c1: list[int], p2: list[int], c2: list[int]) -> tuple[str, int]:
    """Merge kind of turn 2 and sampled tokens left untrained, from the samples builder."""
    turns = [Turn(turn_index=k, request={}, prompt_ids=p, completion_ids=c,
                  completion_logprobs=[PROBE_LOGPROB] * len(c), policy_version=0)
             for k, (p, c) in enumerate(((p1, c1), (p2, c2)))]
    rollout = Rollout(rollout_id="doctor", group_id=0, task_id="doctor", harness="doctor", status="ok",
                      reward=1.0, trace=Trace(session_id="doctor", turns=turns))
    _, stats = build_rows(rollout)
    kind = "clean" if stats.num_clean else "realign" if stats.num_realign else "fork"
    return kind, len(c1) + len(c2) - stats.tokens_trained


def divergence_text(chat: ChatLayer, sampled: list[int], rerendered: list[int], width: int = 6) -> str:
    d = common_prefix_len(sampled, rerendered)
    dec = lambda ids: chat.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return (f"at token {d}: sampled {dec(sampled[max(0, d - width):d])!r} + {dec(sampled[d:d + width])!r}"
            f" | re-rendered {dec(rerendered[d:d + width])!r} (ids {sampled[d:d + 4]} vs {rerendered[d:d + 4]})")


def _tool_roundtrip(chat: ChatLayer, stop_id: int | None, gen_prompt: str = "") -> str:
    ids = _sampled_ids(chat, _as_sampled(_CALL_TEXT, gen_prompt), stop_id)
    parsed = chat.parse(ids, True, call_id_seed="doctor")
    if len(parsed.tool_calls) != 1:
        return f"the hermes call parsed to {len(parsed.tool_calls)} calls (text {parsed.content!r})"
    call = parsed.tool_calls[0]
    if call.name != "get_weather" or json.loads(call.arguments) != {"city": "Paris"}:
        return f"parsed as {call.name}({call.arguments})"
    replay = [_SYSTEM, {"role": "user", "content": "Weather in Paris?"}, _replay(parsed, False)]
    try:
        text = chat.render_text(normalize_messages(replay), _TOOLS)
    except RequestError as exc:
        return f"the template rejects the replayed call: {exc}"
    block = _as_sampled(_replayed_reply(text), gen_prompt)
    again = chat.parse(chat.encode(block), True, call_id_seed="doctor") if "get_weather" in text else None
    if again is None or [(c.name, json.loads(c.arguments)) for c in again.tool_calls] != [("get_weather", {"city": "Paris"})]:
        return "the re-rendered history does not parse back to the same call"
    return "ok"


def _replayed_reply(text: str) -> str:
    """The last `<tool_call>` block of a rendered history (what a re-parse would read)."""
    start = text.rfind("<tool_call>")
    end = text.find("</tool_call>", start)
    return text[start:end + len("</tool_call>")] if start >= 0 and end >= 0 else ""


def _reasoning_split(chat: ChatLayer, gen_prompt: str, stop_id: int | None) -> str:
    reply = _as_sampled("<think>\nAdd two and two.\n</think>\n\n4", gen_prompt)
    parsed = chat.parse(_sampled_ids(chat, reply, stop_id), False)
    if parsed.reasoning == "Add two and two." and (parsed.content or "").strip() == "4":
        return "ok"
    return f"a <think> reply parses to content {parsed.content!r}, reasoning {parsed.reasoning!r}"


def quick_line(tokenizer: PreTrainedTokenizerBase, model: str, engine_eos: Sequence[int] | None = None) -> str:
    """The template part of the doctor as one line (what `harnessrl train` logs at start)."""
    try:
        return diagnose_template(tokenizer, model=model, engine_eos=engine_eos).one_line()
    except Exception as exc:  # noqa: BLE001 - a preflight never stops the run
        return f"template doctor: could not run ({type(exc).__name__}: {exc})"


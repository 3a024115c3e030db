"""The shared data model: sampling, completions, turns, traces, rollouts, groups, rows.

Responsibility: the records every part of harnessrl exchanges, and the one function
(`check_turn_faithful`) that decides whether a recorded turn may ever be trained.

Invariants (DESIGN.md §3):
  1. Token faithfulness. A turn stores the exact `prompt_ids` the engine consumed and the
     `completion_ids` it sampled with their `completion_logprobs` (natural log, of the
     temperature/top-p/top-k distribution the id was drawn from). Concatenating
     `prompt_ids + completion_ids` of a turn reproduces the engine's input and output exactly.
     A turn whose ids/logprobs fail `check_turn_faithful` is stored with
     `status="unfaithful"`, kept for inspection and never trained.
  6. Versions are per turn: `Turn.policy_version` is the engine's version at dispatch.
  7. Groups are explicit: rollouts of a group share `group_id`; nothing groups by text.

What this module deliberately does not do: render text, call engines, or build rows.
Records that cross a process, HTTP or disk boundary are pydantic models; in-process
values are frozen dataclasses. Non-finite floats (a NaN or infinite logprob, reward, ...)
are written as the JSON strings `"NaN"`, `"Infinity"`, `"-Infinity"` and read back as
floats, so every record written reloads (`null` would not validate as a float).
"""

from __future__ import annotations

import array
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


TurnStatus = Literal["ok", "error", "unfaithful"]
"""`ok`: trainable; `error`: upstream/engine failed, the agent got an error; `unfaithful`:
ids/logprobs failed validation (kept, never trained)."""

RolloutStatus = Literal["ok", "agent_error", "timeout", "verifier_error", "infra_error"]
"""Exactly one terminal status per rollout (DESIGN.md §3.3)."""


MIN_TEMPERATURE = 1e-3
"""Smallest positive temperature used; a positive value below it is raised to it (at 1e-3 the
distribution is already greedy for any logit gap above ~0.1)."""


def effective_temperature(temperature: float) -> float:
    """The temperature actually used: 0 (greedy) stays 0, `(0, MIN_TEMPERATURE)` becomes
    `MIN_TEMPERATURE`, anything else is unchanged.

    Raises:
        ValueError: `temperature` is negative or not finite.
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0")
    return temperature if temperature == 0 or temperature >= MIN_TEMPERATURE else MIN_TEMPERATURE


class Sampling(BaseModel):
    """Sampling parameters actually used for one generation (recorded per turn)."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="strings")

    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy (logprobs are then those of the T=1 distribution)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass kept; 1.0 disables it."""
    top_k: int = Field(default=0, ge=0)
    """Number of highest-probability ids kept; 0 disables it."""
    max_tokens: int = Field(default=256, ge=1)
    """Cap on completion ids for this generation."""
    stop: tuple[str, ...] = ()
    """Stop strings; generation ends when the decoded completion contains one (the ids that
    produced it are kept, so the completion ids stay exactly what was sampled)."""
    seed: int | None = None
    """Per-request sampling seed; None draws from the engine's generator."""


@dataclass(frozen=True, slots=True)
class Completion:
    """What an engine returns for one prompt.

    Shapes: `completion_ids` and `completion_logprobs` both have length T (T >= 0).
    """

    prompt_ids: tuple[int, ...]
    """The exact ids the engine consumed."""
    completion_ids: tuple[int, ...]
    """The ids the engine sampled, in order (EOS included when it was sampled)."""
    completion_logprobs: tuple[float, ...]
    """Natural-log probability of each sampled id under the distribution it was drawn from."""
    finish_reason: Literal["stop", "length"]
    policy_version: int
    """Engine weight version at dispatch (when the request was admitted)."""
    straddled: bool = False
    """The engine's policy version changed while this request was in flight: its later ids may
    come from newer weights (`policy_version` is the older one; the proxy notes it on the turn)."""


class ReplyToolCall(BaseModel):
    """One tool call of a `Reply`, as the chat layer parsed it from the completion."""

    model_config = ConfigDict(extra="forbid")

    id: str
    """The call id the chat layer assigned (`call_<hex>`); a protocol may present it in its own
    form (Messages: `toolu_<hex>`, the same hex)."""
    name: str
    """Function name, as the model wrote it."""
    arguments: str
    """The arguments as a JSON string, as the model wrote them (not re-serialised)."""


class Reply(BaseModel):
    """The assistant reply of one turn, parsed once from its completion ids, the same for every
    protocol: what `Turn.raw_response` says in the protocol's own words."""

    model_config = ConfigDict(extra="forbid")

    content: str | None = None
    """Assistant text (cut where a stop string begins); None when the reply is only tool calls."""
    tool_calls: list[ReplyToolCall] = Field(default_factory=list)
    """Parsed tool calls, in order; [] when none."""
    reasoning: str | None = None
    """The reasoning (`<think>` block) text, when the completion had one."""


class Turn(BaseModel):
    """One LLM call of a rollout, as recorded by the proxy or the white-box loop.

    The record is protocol-neutral: `request` (the chat-layer request) and `reply` (the parsed
    reply) have one shape whatever protocol the agent spoke; hooks, shaping, the console and
    the rollout-cause code read only them. The protocol's own bodies are kept for inspection in
    `raw_request` / `raw_response`. A turn is built once, when it is recorded.

    Old records (a `response` field: the chat.completion body, or for `responses` / `messages`
    turns the protocol's body, with `request` the protocol's body) load through a validator:
    `reply` is parsed from `response`; for the other protocols the bodies move to the `raw_*`
    fields and `request` is `{}` (the conversion is not redone on load).
    """

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    turn_index: int
    """0-based position in the session's trace, in order of arrival."""
    protocol: str = "chat.completions"
    """Wire protocol of the request: `chat.completions`, `responses`, `messages`, `white_box`."""
    request: dict[str, Any]
    """The request as the chat layer saw it: an OpenAI chat-completions body (`messages` with
    roles system/user/assistant/tool, `tools` as function tools, `max_tokens`, ...) before
    sampling overrides. For `chat.completions` it is the body as received; for another
    protocol its adapter's conversion, with `stream: false` (the protocol streams itself;
    `raw_request` is the body as received and says whether the agent streamed). An error turn
    keeps at most `proxy.capture.REJECTED_BODY_CHARS` characters of it (`summarize_body`);
    `{}` when the protocol's body could not be converted."""
    reply: Reply | None = None
    """The parsed assistant reply the agent was given; None when no reply was generated
    (`status="error"`)."""
    raw_request: dict[str, Any] | None = Field(default=None, exclude_if=lambda v: v is None)
    """The protocol's request body as received, when the protocol is not chat completions
    (bounded like `request` on error turns); None (and not written) otherwise."""
    raw_response: dict[str, Any] | None = Field(default=None, exclude_if=lambda v: v is None)
    """The protocol's unary response body as sent (for streams: the equivalent unary body),
    when the protocol is not chat completions and a reply was sent; None (and not written)
    otherwise (a chat.completion body is `reply` + `finish_reason` + `usage`)."""
    prompt_ids: list[int] = Field(default_factory=list)
    completion_ids: list[int] = Field(default_factory=list)
    completion_logprobs: list[float] = Field(default_factory=list)
    sampling: Sampling | None = None
    """Sampling actually used (after the run's overrides)."""
    policy_version: int = -1
    """Engine weight version at dispatch; -1 when no generation happened."""
    finish_reason: str | None = None
    status: TurnStatus = "ok"
    error: str | None = None
    started_at: float = Field(default_factory=time.time)
    """Unix time (s) the request arrived."""
    latency_s: float = 0.0
    headers: dict[str, str] = Field(default_factory=dict)
    """Headers of interest: x-session-id, x-stainless-retry-count, x-codex-turn-metadata, ..."""
    request_kind: str | None = None
    """What the agent's own headers say the call is (`turn`, `compaction`, ...), if they say."""
    usage: dict[str, int] = Field(default_factory=dict)
    """Usage reported to the agent: prompt_tokens, completion_tokens, total_tokens."""
    notes: list[str] = Field(default_factory=list)
    """What the proxy did that `request` alone does not show: what the protocol's conversion
    dropped (e.g. hosted tools the engine cannot run), `bridged_from=N` (bridged rendering)."""

    @model_validator(mode="before")
    @classmethod
    def _map_old_record(cls, data: Any) -> Any:
        """Old records carry `response` (see the class docstring); map it to the fields above."""
        if not isinstance(data, dict) or "response" not in data:
            return data
        data = dict(data)
        old = data.pop("response")
        if data.get("protocol", "chat.completions") not in ("chat.completions", "white_box"):
            data["raw_request"], data["request"] = data.get("request"), {}
            data["raw_response"] = old
        data.setdefault("reply", _old_reply(old) if data.get("status", "ok") != "error" else None)
        return data


def _old_reply(body: Any) -> dict[str, Any] | None:
    """The reply an old record's `response` body shows: a chat.completion (`choices`), a
    Responses body (`output` items) or a Messages body (`content` blocks)."""
    if not isinstance(body, dict):
        return None
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    if isinstance(body.get("choices"), list) and body["choices"]:
        message = (body["choices"][0] or {}).get("message") or {}
        for c in message.get("tool_calls") or []:
            fn = (c or {}).get("function") or {}
            calls.append({"id": str(c.get("id", "")), "name": str(fn.get("name", "")),
                          "arguments": str(fn.get("arguments", ""))})
        return {"content": message.get("content"), "tool_calls": calls,
                "reasoning": message.get("reasoning_content")}
    for item in body.get("output") or []:  # Responses
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "message":
            texts.extend(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
        elif kind == "function_call":
            calls.append({"id": str(item.get("call_id", "")), "name": str(item.get("name", "")),
                          "arguments": str(item.get("arguments", ""))})
        elif kind == "reasoning":
            thoughts.extend(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
    for block in body.get("content") or [] if isinstance(body.get("content"), list) else []:  # Messages
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": str(block.get("id", "")), "name": str(block.get("name", "")),
                          "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)})
        elif kind == "thinking":
            thoughts.append(block.get("thinking", ""))
    return {"content": "\n".join(texts) if texts else None, "tool_calls": calls,
            "reasoning": "\n".join(thoughts) if thoughts else None}


class CallInFlight(BaseModel):
    """A call the engine was still serving when its session closed (a timed-out or killed
    agent): what tells a slow engine (a long prompt still prefilling, a reply still decoding)
    from a hung agent (no call in flight)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    turn_index: int
    prompt_tokens: int
    age_s: float
    """Seconds from the call's arrival at the proxy to the session's close."""
    prefilled_tokens: int | None = None
    """Prompt tokens the engine had prefilled (prefix-cache hits included); None: the engine
    does not report it (`engine.base.CallProgress`)."""
    decoded_tokens: int | None = None
    """Completion tokens sampled so far; None: not reported."""
    wait_s: float | None = None
    """Seconds from arrival until the prompt was prefilled (queueing and prefill), or `age_s`
    when it never was; None: not reported."""
    decode_s: float | None = None
    """Seconds spent decoding since then; None: not reported or not begun."""


class Trace(BaseModel):
    """All turns of one proxy session (one rollout)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    session_id: str
    rollout_id: str | None = None
    turns: list[Turn] = Field(default_factory=list)
    opened_at: float = Field(default_factory=time.time)
    closed_at: float | None = None
    rejected_calls: int = 0
    """Calls that arrived with this session's key after it was revoked."""
    refused_calls: int = 0
    """Calls refused without a turn: past `max_turns_per_session` (429), past
    `max_session_body_bytes` (413) or past `max_concurrent_calls_per_session` (429)."""
    in_flight: list[CallInFlight] = Field(default_factory=list, exclude_if=lambda v: not v)
    """The calls the engine was still serving when the session closed, in turn order (written
    only when there were some)."""


class Rollout(BaseModel):
    """One agent run on one task: its trace, its reward and its terminal status."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    rollout_id: str
    group_id: int
    task_id: str
    harness: str
    status: RolloutStatus
    reward: float | None = None
    """The verifier's scalar reward; None when the rollout could not be scored (excluded from
    baselines). Never overwritten: pass rate and pass@k count it."""
    train_reward: float | None = Field(default=None, exclude_if=lambda v: v is None)
    """The reward the advantage uses: `hooks.rollout_reward_fn` applied to the rollout's outcome
    (`train/hooks.reshape_reward`). Unset when no shaping ran: the advantage uses `reward`
    (`train/hooks.training_reward`). Written only when not None."""
    reward_parts: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    trace: Trace
    timings_s: dict[str, float] = Field(default_factory=dict)
    """Wall seconds per phase: sandbox, agent, verify, total."""
    final_answer: str | None = None
    """What the agent submitted / its last assistant text, when known."""
    metadata: dict[str, Any] = Field(default_factory=dict)


class Group(BaseModel):
    """G rollouts of the same task; `group_id` is also the seed that picked the task."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    group_id: int
    task_id: str
    rollouts: list[Rollout]


@dataclass(frozen=True, slots=True)
class Row:
    """One training row (a packed unit of one rollout's tokens).

    Shapes: every per-token field has length T = len(input_ids).
    `sampler_logprobs[t]` is 0.0 and `policy_versions[t]` is -1 where `completion_mask[t]` is 0.
    The logprob at index t is that of `input_ids[t]` given `input_ids[:t]`.
    """

    input_ids: tuple[int, ...]
    completion_mask: tuple[int, ...]
    sampler_logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    rollout_id: str
    group_id: int
    advantage: float = 0.0
    divergences: tuple[tuple[int, int], ...] = ()
    """Row metadata from the samples builder: `(turn_index, position)` for each turn whose
    prompt diverged from the ids before it (its parent turn's prompt + completion), `position`
    being the first index where they differ. A REALIGN merged into this row overwrites from
    `position`; a FORK starts this row with that turn's prompt (the previous row ends before)."""

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.completion_mask)


MIN_SAMPLED_LOGPROB = -745.0
"""Below this no id can have been sampled: `exp(-745)` is under the smallest positive double,
so the id had probability 0 in any IEEE float. Lower values are sentinels (e.g. -9999.0)."""


def check_turn_faithful(turn: Turn) -> str | None:
    """Return why `turn` violates token faithfulness, or None when it holds.

    Checks (DESIGN.md §3.1): non-empty prompt ids; `len(completion_ids) ==
    len(completion_logprobs)`; `usage.completion_tokens` (when reported) equals that length;
    every logprob finite and in [`MIN_SAMPLED_LOGPROB`, 0]; every id a non-negative int.
    """
    if not turn.prompt_ids:
        return "prompt_ids is empty"
    n_ids, n_lps = len(turn.completion_ids), len(turn.completion_logprobs)
    if n_ids != n_lps:
        return f"len(completion_ids)={n_ids} != len(completion_logprobs)={n_lps}"
    reported = turn.usage.get("completion_tokens")
    if reported is not None and reported != n_ids:
        return f"usage.completion_tokens={reported} != len(completion_ids)={n_ids}"
    lps = turn.completion_logprobs
    # Fast path in C (min/max/sum): a non-finite value makes the sum non-finite, and a finite
    # sum that overflowed only sends us to the exact per-element loop below. The ids are
    # non-negative when they fit unsigned 64-bit array items (OverflowError for a negative one,
    # TypeError for a non-int: both take the exact loop); ~1.8x faster than min() on 12k ids.
    if not lps or (max(lps) <= 0.0 and min(lps) >= MIN_SAMPLED_LOGPROB and math.isfinite(sum(lps))):
        try:
            array.array("Q", turn.prompt_ids)
            array.array("Q", turn.completion_ids)
        except (OverflowError, TypeError):
            pass
        else:
            return None
    for i, lp in enumerate(lps):
        if not math.isfinite(lp) or not MIN_SAMPLED_LOGPROB <= lp <= 0.0:
            return f"completion_logprobs[{i}]={lp!r} is not a finite value in [{MIN_SAMPLED_LOGPROB}, 0]"
    for i, tok in enumerate([*turn.prompt_ids, *turn.completion_ids]):
        if tok < 0:
            return f"token id {tok} at position {i} is negative"
    return None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an agent reaches the proxy for one rollout."""

    base_url: str
    """OpenAI-style base URL ending in `/v1`, e.g. `http://127.0.0.1:8000/v1`."""
    api_key: str
    """The rollout's unguessable session key."""
    model: str
    """Model name the agent should request."""
    keyed_base_url: str = ""
    """Base URL carrying the key as a path prefix (`/r/<key>/v1`) for agents that cannot set keys."""
    extra: dict[str, str] = field(default_factory=dict)

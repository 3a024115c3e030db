"""One rollout, as the agent saw it and as it trains (the viewer's per-rollout payload).

Responsibility: read one rollout by its index offsets, rebuild its training rows with the
project's own samples builder (`train/samples.py`, the run's `[train]` settings and `[hooks]`)
and stamp the rollout's advantage, so what is shown is what trains. Per turn: the messages the
agent sent (those new since its previous call), the reply it got, status, and why a turn never
trains (`error`, `unfaithful` with `check_turn_faithful`'s reason, `retry_superseded`,
`auxiliary`), its row and how many of its completion ids train there. Per row: every token id
with its mask (context 0 / trained 1), sampler logprob and policy version, the turns merged
into it with the kind of each merge, and where a REALIGN or FORK turn's prompt diverged from
the ids before it (`Row.divergences`, the builder's own), and what the loss did with each
trained token when the row trained (`weights`: its weight, and whether the ratio clip stopped
it or its importance weight was truncated or masked; the trainer's `token_weights.jsonl`).

Merge kinds are the builder's own counts: turn j's kind is the counter (`num_clean`,
`num_realign`, `num_fork`) that building the eligible turns up to j adds over building those up
to j - 1, with the main/auxiliary split of the whole rollout held fixed; the first main turn is
`start`. A merged turn's context starts at the common prefix of its prompt with its parent's
`prompt + completion` in the same row (0 for a row's first turn).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from harnessrl.hooks import Hooks
from harnessrl.loss.advantages import stamp_advantage
from harnessrl.loss.token_weights import TokenWeightRecord, row_key
from harnessrl.train.samples import (
    build_rows,
    classify_main,
    common_prefix_len,
    find_parents,
)
from harnessrl.types import Rollout, Row, Turn, check_turn_faithful

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from harnessrl.view.index import RunIndex

MAIN_PREFIX_TOKENS = 32
"""`build_rows`'s default `main_prefix_tokens` (the trainer does not change it)."""


def build_kwargs(index: RunIndex, hooks: Hooks) -> dict[str, Any]:
    """The `build_rows` keyword arguments `harnessrl train` uses for this run."""
    return run_build_kwargs(index.cfg, hooks)


def run_build_kwargs(cfg: Any, hooks: Hooks) -> dict[str, Any]:
    """`build_rows` keyword arguments from a run config's `[train]` and its hooks: each
    `[train]` setting `build_rows` takes (e.g. `train_auxiliary`), and the row hooks."""
    accepted = inspect.signature(build_rows).parameters
    kwargs: dict[str, Any] = {k: v for k, v in cfg.train.model_dump().items() if k in accepted and k != "rollout"}
    if "train_turn_fn" in accepted:
        kwargs["train_turn_fn"] = hooks.train_turn_fn
    if "agent_turn_fn" in accepted:
        kwargs["agent_turn_fn"] = hooks.agent_turn_fn
    return kwargs


def rollout_rows(rollout: Rollout, advantage: float | None, kwargs: dict[str, Any]) -> list[Row]:
    """The rollout's training rows exactly as the trainer builds them, advantage stamped
    (0.0 when the rollout is unscored or its group has zero variance: such rows are dropped
    by the trainer, and the page says so)."""
    rows, _ = build_rows(rollout, **kwargs)
    return stamp_advantage(rows, 0.0 if advantage is None else advantage)


def rollout_detail(index: RunIndex, i: int, tokenizer: PreTrainedTokenizerBase,
                   hooks: Hooks) -> dict[str, Any]:
    """The JSON-ready payload of rollout `i` (module docstring).

    Keys: `summary` (the index entry), `error`, `final_answer`, `turns` (list, in arrival order:
    each with the messages new since the previous call, so a tool's output shows in the turn
    after the call that ran it, the reply, its `row` and `trained_tokens`), `rows` (list of
    `{ids, mask, lp, ver, advantage, trained_ids, segments, divergences, weights}`; `weights`:
    `row_weights`), `stats` (the builder's
    `MergeStats.as_metrics()`), `vocab` (`{id: text}` for every id in the rows, each id
    decoded alone).

    Raises:
        IndexError: no rollout `i`.
    """
    rollout = index.read(i)
    summary = {k: v for k, v in index.summaries[i].items() if k not in ("offset", "length")}

    kwargs = build_kwargs(index, hooks)
    built, stats = build_rows(rollout, **kwargs)
    rows = stamp_advantage(built, summary.get("advantage") or 0.0)
    eligible, is_main, kinds = merge_kinds(rollout, kwargs)
    parents = find_parents(eligible)
    row_of = _rows_of_turns(rows, eligible)
    by_index = {t.turn_index: j for j, t in enumerate(eligible)}
    rejected = _rejected_by_hook(eligible, is_main, hooks.train_turn_fn, bool(kwargs.get("train_auxiliary")))
    vocab_ids = sorted({tok for r in rows for tok in r.input_ids})
    texts = tokenizer.batch_decode([[t] for t in vocab_ids], skip_special_tokens=False)
    return {
        "summary": summary,
        "error": rollout.error,
        "final_answer": rollout.final_answer,
        "turns": _turns(rollout.trace.turns, by_index, is_main, kinds, row_of,
                        _trained_per_turn(rows, eligible, row_of), tokenizer, rejected),
        "rows": [{**_row(k, r, eligible, parents, kinds, row_of),
                  "weights": row_weights(r, index.token_weights.get(rollout.rollout_id, ()))}
                 for k, r in enumerate(rows)],
        "stats": stats.as_metrics(),
        "dropped_by_trainer": _dropped_reason(summary, has_rows=bool(rows), rejected=len(rejected)),
        "vocab": dict(zip((str(t) for t in vocab_ids), texts)),
    }


def row_weights(row: Row, records: Sequence[TokenWeightRecord]) -> dict[str, object] | None:
    """What the loss did with `row`'s trained tokens, from the rollout's `token_weights.jsonl`
    records (`loss/token_weights.py`): the last record whose `row_key` and trained-token count
    are the row's, as `{step, w, clipped, bounded}` (`w`: one weight per trained token in row
    order, or None past the step's recording bound; `clipped` / `bounded`: positions among the
    trained tokens, or counts when `w` is None). None when the row never trained (a
    zero-advantage or stale row, a run before the file existed)."""
    key, n = row_key(row.input_ids), row.num_trained_tokens
    for rec in reversed(records):
        if rec.get("row_key") == key and rec.get("n") == n:
            return {"step": rec.get("step"), "w": rec["w"], "clipped": rec["clipped"], "bounded": rec["bounded"]}
    return None


def merge_kinds(rollout: Rollout, kwargs: dict[str, Any]) -> tuple[list[Turn], list[bool], list[str]]:
    """The turns the builder merges, whether each is main, and each one's merge kind
    (`start`, `clean`, `realign`, `fork`, `auxiliary`; module docstring), for `build_rows`
    keyword arguments `kwargs`."""
    eligible, is_main = _eligible_and_main(rollout, kwargs)
    return eligible, is_main, _merge_kinds(rollout, eligible, is_main, kwargs)


def _dropped_reason(summary: dict[str, Any], has_rows: bool = True, rejected: int = 0) -> str | None:
    """Why the trainer trains nothing of this rollout, or None: `hooks.train_turn_fn` kept every
    turn it was asked about as context (named first: the rewards are then beside the point), an
    unscored rollout, or a zero-variance group."""
    if not has_rows and rejected:
        return (f"no row to train: hooks.train_turn_fn kept {rejected} turn{'s' if rejected != 1 else ''} "
                "as context only")
    if summary.get("train_reward") is None:
        return "unscored rollout: its rows are not trained"
    if summary.get("advantage") is None:
        return "zero-variance group: its rows carry no gradient and are dropped"
    return None


def _rejected_by_hook(eligible: Sequence[Turn], is_main: Sequence[bool], fn: Callable[[Turn], bool] | None,
                     train_auxiliary: bool) -> set[int]:
    """Turn indices `train_turn_fn` (`fn`) kept as context only, of the turns `build_rows` asks
    it about (main-chain turns, and auxiliary ones with `train_auxiliary`)."""
    if fn is None:
        return set()
    asked = [t for t, main in zip(eligible, is_main) if main or train_auxiliary]
    return {t.turn_index for t in asked if not fn(t)}


def _eligible_and_main(rollout: Rollout, kwargs: dict[str, Any]) -> tuple[list[Turn], list[bool]]:
    """The turns the builder merges (it hands them to `agent_turn_fn`) and which are main."""
    seen: list[Turn] = []
    user_fn = kwargs.get("agent_turn_fn")

    def capture(turns: list[Turn]) -> list[Turn]:
        seen[:] = turns
        if user_fn is not None:
            return user_fn(turns)
        flags = classify_main(turns, find_parents(turns), MAIN_PREFIX_TOKENS)
        return [t for t, m in zip(turns, flags) if m]

    chosen = {t.turn_index for t in _capture_call(rollout, kwargs, capture)}
    return seen, [t.turn_index in chosen for t in seen]


def _capture_call(rollout: Rollout, kwargs: dict[str, Any], fn: Callable[[list[Turn]], list[Turn]]) -> list[Turn]:
    """Build the rollout's rows with `fn` as `agent_turn_fn`; returns the turns `fn` chose."""
    out: list[Turn] = []

    def wrapped(turns: list[Turn]) -> list[Turn]:
        out[:] = fn(turns)
        return out

    build_rows(rollout, **{**kwargs, "agent_turn_fn": wrapped})
    return out


def _merge_kinds(rollout: Rollout, eligible: Sequence[Turn], is_main: Sequence[bool],
                 kwargs: dict[str, Any]) -> list[str]:
    main = {t.turn_index for t, m in zip(eligible, is_main) if m}
    fixed = {**kwargs, "agent_turn_fn": lambda turns: [t for t in turns if t.turn_index in main]}
    kinds: list[str] = []
    before = (0, 0, 0)
    seen_main = False
    for j, turn in enumerate(eligible):
        part = rollout.model_copy(update={"trace": rollout.trace.model_copy(update={"turns": list(eligible[:j + 1])})})
        _, s = build_rows(part, **fixed)
        now = (s.num_clean, s.num_realign, s.num_fork)
        if not is_main[j]:
            kinds.append("auxiliary")
        elif not seen_main:
            kinds.append("start")
            seen_main = True
        else:
            diff = [b - a for a, b in zip(before, now)]
            kinds.append(("clean", "realign", "fork")[diff.index(1)] if 1 in diff else "start")
        before = now
    return kinds


def _rows_of_turns(rows: Sequence[Row], eligible: Sequence[Turn]) -> list[int | None]:
    """For each eligible turn, the first row holding its prompt followed by its completion's
    first id (None for a turn in no kept row)."""
    out: list[int | None] = []
    for turn in eligible:
        p, c = turn.prompt_ids, turn.completion_ids
        found = None
        for k, row in enumerate(rows):
            ids = row.input_ids
            if len(ids) >= len(p) + min(1, len(c)) and list(ids[:len(p)]) == p and (not c or ids[len(p)] == c[0]):
                found = k
                break
        out.append(found)
    return out


def _trained_per_turn(rows: Sequence[Row], eligible: Sequence[Turn], row_of: Sequence[int | None]) -> list[int]:
    """For each eligible turn, how many of its completion ids train in its row (0 in none)."""
    out: list[int] = []
    for turn, k in zip(eligible, row_of):
        n_prompt = len(turn.prompt_ids)
        out.append(0 if k is None else sum(rows[k].completion_mask[n_prompt:n_prompt + len(turn.completion_ids)]))
    return out


def _row(k: int, row: Row, eligible: Sequence[Turn], parents: Sequence[int | None], kinds: Sequence[str],
         row_of: Sequence[int | None]) -> dict[str, Any]:
    segments = []
    for j, turn in enumerate(eligible):
        if row_of[j] != k:
            continue
        parent = parents[j]
        if parent is not None and row_of[parent] == k:
            prev = eligible[parent]
            start = common_prefix_len(turn.prompt_ids, [*prev.prompt_ids, *prev.completion_ids])
        else:
            start = 0
        n_prompt = len(turn.prompt_ids)
        segments.append({"turn_index": turn.turn_index, "kind": kinds[j], "context_start": start,
                         "completion_start": n_prompt,
                         "completion_end": min(len(row.input_ids), n_prompt + len(turn.completion_ids))})
    return {
        "ids": list(row.input_ids), "mask": list(row.completion_mask),
        "lp": [round(x, 5) for x in row.sampler_logprobs], "ver": list(row.policy_versions),
        "advantage": row.advantage,
        "trained_ids": [t for t, m in zip(row.input_ids, row.completion_mask) if m],
        "segments": segments,
        # the builder's row metadata: where each REALIGN / FORK turn's prompt left the ids before it
        "divergences": [{"turn_index": t, "position": pos} for t, pos in row.divergences],
    }


def _turns(turns: Sequence[Turn], by_index: dict[int, int], is_main: Sequence[bool], kinds: Sequence[str],
           row_of: Sequence[int | None], trained: Sequence[int],
           tokenizer: PreTrainedTokenizerBase, rejected: set[int]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    prev_messages: list[Any] = []
    for turn in turns:
        messages = _request_messages(turn.request)
        new_from = len(prev_messages) if messages[:len(prev_messages)] == prev_messages else 0
        prev_messages = messages
        j = by_index.get(turn.turn_index)
        why: str | None = None
        if turn.status != "ok":
            why = turn.status
        elif check_turn_faithful(turn) is not None:
            why = "unfaithful"
        elif j is None:
            why = "retry_superseded"
        elif turn.turn_index in rejected:
            why = "train_turn_fn"  # the run's hook kept it as context only
        unfaithful = check_turn_faithful(turn) if turn.status in ("ok", "unfaithful") else None
        try:
            sampled = tokenizer.decode(turn.completion_ids, skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - unfaithful turns may hold ids outside the vocabulary
            sampled = None
        out.append({
            "turn_index": turn.turn_index, "protocol": turn.protocol, "status": turn.status,
            "error": turn.error, "excluded": why, "unfaithful_reason": unfaithful,
            "request_kind": turn.request_kind, "notes": turn.notes,
            "main": None if j is None else is_main[j], "merge": None if j is None else kinds[j],
            "row": None if j is None else row_of[j], "trained_tokens": 0 if j is None else trained[j],
            "messages": [_message_view(m) for m in messages[new_from:]], "messages_total": len(messages),
            "messages_from": new_from, "reply": _turn_reply(turn), "sampled": sampled,
            "prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(turn.completion_ids),
            "finish_reason": turn.finish_reason, "policy_version": turn.policy_version,
            "latency_s": round(turn.latency_s, 3),
        })
    return out


def _request_messages(request: dict[str, Any]) -> list[Any]:
    """The conversation of a request in any protocol (chat `messages`, Messages `system` +
    `messages`, Responses `instructions` + `input`), as sent."""
    msgs: list[Any] = []
    if "system" in request:
        msgs.append({"role": "system", "content": request["system"]})
    if isinstance(request.get("instructions"), str):
        msgs.append({"role": "system", "content": request["instructions"]})
    for key in ("messages", "input"):
        value = request.get(key)
        if isinstance(value, list):
            msgs.extend(value)
        elif isinstance(value, str):
            msgs.append({"role": "user", "content": value})
    return msgs


def _message_view(m: Any) -> dict[str, str]:
    if not isinstance(m, dict):
        return {"role": "?", "text": json.dumps(m, ensure_ascii=False)}
    role = str(m.get("role", m.get("type", "?")))
    parts = [_content_text(m.get("content"))]
    for key in ("reasoning_content", "reasoning", "thinking"):
        if isinstance(m.get(key), str) and m[key]:
            parts.insert(0, f"[{key}] {m[key]}")
    for call in m.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        parts.append(f"-> tool call {fn.get('name')}({fn.get('arguments')})")
    if m.get("tool_call_id"):
        role += f" ({m['tool_call_id']})"
    if m.get("type") == "function_call":
        parts.append(f"-> tool call {m.get('name')}({m.get('arguments')})")
    if m.get("type") == "function_call_output":
        parts.append(_content_text(m.get("output")))
    return {"role": role, "text": "\n".join(p for p in parts if p)}


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "tool_result":
                texts.append(_content_text(part.get("content")))
            elif isinstance(part, dict) and part.get("type") == "tool_use":
                texts.append(f"-> tool call {part.get('name')}({json.dumps(part.get('input'), ensure_ascii=False)})")
            else:
                texts.append(json.dumps(part, ensure_ascii=False))
        return "\n".join(texts)
    return json.dumps(content, ensure_ascii=False)


def _turn_reply(turn: Turn) -> str | None:
    """The reply the agent was given: the turn's parsed `reply` (reasoning, content, tool
    calls), or for records that carry only a protocol body, that body's text."""
    reply = getattr(turn, "reply", None)
    if reply is None:
        return _reply_text(getattr(turn, "raw_response", None) or getattr(turn, "response", None))
    parts = [f"[reasoning] {reply.reasoning}"] if reply.reasoning else []
    parts += [reply.content] if reply.content else []
    parts += [f"-> tool call {c.name}({c.arguments})" for c in reply.tool_calls]
    return "\n".join(parts)


def _reply_text(response: Any) -> str | None:
    """The reply the agent got, as text (chat, Responses, Messages, white-box bodies)."""
    if hasattr(response, "model_dump"):
        response = response.model_dump()
    if not response:
        return None
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return _message_view(choices[0].get("message") or {})["text"]
    if isinstance(response.get("output"), list):
        return "\n".join(_message_view(item)["text"] for item in response["output"])
    if isinstance(response.get("content"), list):
        return _content_text(response["content"])
    return json.dumps(response, ensure_ascii=False)[:4000]

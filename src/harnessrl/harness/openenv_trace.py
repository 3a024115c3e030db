"""A loop-owning OpenEnv session's own captured trace (`fetch_proxy_trace`) as harnessrl turns.

Responsibility: when a session's agent did not call harnessrl's proxy (its factory cannot be
pointed at an endpoint) but the session offers `fetch_proxy_trace() -> list[TraceEntry]`,
turn each entry into a `Turn` on the rollout's trace, validated like any upstream:
`check_turn_faithful` (non-empty prompt ids, one finite logprob in [-745, 0] per sampled id,
`usage.completion_tokens` equal to the count, non-negative ids). A turn that fails, or that its
producer masked out (`loss_mask` 0 over its whole completion), is stored with
`status="unfaithful"` and its reason: kept for inspection, never trained.

Field mapping (OpenEnv `TraceEntry` -> `Turn`): `prompt_token_ids` -> `prompt_ids`;
`completion_token_ids` (else the `"token_id:N"` strings of `completion_tokens`) ->
`completion_ids`; `per_token_logps` -> `completion_logprobs`; `request` -> `request`;
`response.choices[0].message` -> `reply`; `response.usage` -> `usage`. `policy_version` is the
engine's version when the trace was read (the producer does not say which weights sampled it).
"""

from __future__ import annotations

import json
from typing import Any

from harnessrl.types import Reply, ReplyToolCall, Turn, check_turn_faithful


def turn_from_entry(entry: Any, index: int, policy_version: int) -> Turn:
    """One `TraceEntry` (a dict) as a `Turn` (see the module docstring). Never raises for a
    malformed entry: it becomes an `unfaithful` turn naming what is wrong."""
    if not isinstance(entry, dict):
        return Turn(turn_index=index, protocol="openenv", request={}, status="unfaithful",
                    error=f"trace entry is a {type(entry).__name__}, not an object")
    problems: list[str] = []
    prompt = _ints(entry.get("prompt_token_ids"), "prompt_token_ids", problems)
    ids = entry.get("completion_token_ids")
    if not ids and entry.get("completion_tokens"):
        ids = [_token_id(t) for t in entry["completion_tokens"]]
    completion = _ints(ids, "completion_token_ids", problems)
    logprobs = _floats(entry.get("per_token_logps"), problems)
    response: dict[str, Any] = entry["response"] if isinstance(entry.get("response"), dict) else {}
    request: dict[str, Any] = entry["request"] if isinstance(entry.get("request"), dict) else {}
    usage = {k: v for k, v in (response.get("usage") or {}).items() if isinstance(v, int) and not isinstance(v, bool)}
    choice = (response.get("choices") or [{}])[0] if isinstance(response.get("choices"), list) else {}
    turn = Turn(turn_index=index, protocol="openenv", request=request, reply=_reply(choice.get("message")),
                prompt_ids=prompt, completion_ids=completion, completion_logprobs=logprobs,
                policy_version=policy_version, finish_reason=choice.get("finish_reason"), usage=usage,
                notes=["from the session's fetch_proxy_trace"])
    mask = entry.get("loss_mask")
    whole = isinstance(mask, list) and len(mask) == len(prompt) + len(completion)
    if whole and completion and isinstance(mask, list) and not any(mask[len(prompt):]):
        problems.append("its producer masked the whole completion (loss_mask 0)")
    why = "; ".join(problems) or check_turn_faithful(turn)
    if why:
        turn = turn.model_copy(update={"status": "unfaithful", "error": why})
    return turn


def _token_id(token: Any) -> Any:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token.removeprefix("token_id:"))
        except ValueError:
            return token
    return token


def _ints(value: Any, name: str, problems: list[str]) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or any(type(v) is not int for v in value):
        problems.append(f"{name} is not a list of integers")
        return []
    return list(value)


def _floats(value: Any, problems: list[str]) -> list[float]:
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        problems.append("per_token_logps is not a list of numbers")
        return []
    return [float(v) for v in value]


def _reply(message: Any) -> Reply | None:
    if not isinstance(message, dict):
        return None
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            args = fn.get("arguments")
            calls.append(ReplyToolCall(id=str(call.get("id") or f"call_{i}"), name=fn["name"],
                                       arguments=args if isinstance(args, str) else json.dumps(args or {})))
    content = message.get("content")
    return Reply(content=content if isinstance(content, str) else None, tool_calls=calls)

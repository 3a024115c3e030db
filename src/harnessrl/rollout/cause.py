"""Why an agent failed, when the cause is on the proxy's side of the trace.

Responsibility: after the agent exited with an error, look at its recorded turns and say what
the proxy did to it (refused a prompt over the context limit, answered with an error, cut the
last reply at the token cap) in the rollout's `error`, with the setting to change. An agent's
own message (`codex exited with code 1: 0`) rarely says it; the trace does.

After a timeout, say what the agent was waiting for (`timeout_cause`): the engine calls in
flight when its session closed (`Trace.in_flight`: prompt tokens, prefilled and decoded so far,
seconds waiting and decoding) and its last line of output, so a slow engine reads apart from a
hung agent.

What it does not do: change a rollout's status (still `agent_error`), or guess when the trace
shows nothing unusual (the agent's own message is kept as it is).
"""

from __future__ import annotations

from harnessrl.types import CallInFlight, Trace

_CONTEXT_MARKERS = ("max_context_tokens", "context limit", "context_length_exceeded")
_ASKED_KEYS = ("max_tokens", "max_completion_tokens")
"""Fields of the neutral request (`Turn.request`, a chat body: the Responses and Messages
adapters convert their caps to `max_tokens`) that carry the agent's own cap."""


def proxy_cause(trace: Trace) -> str | None:
    """What the proxy did that likely ended the agent, from `trace`'s turns, or None.

    In order of precedence: a call refused for the context limit (`engine.max_context_tokens`),
    a call answered with another error, the agent's last reply cut at the token cap
    (`finish_reason = "length"`: the agent's own `max_tokens`, else `sampling.max_tokens` or the
    context left).
    """
    errors = [t for t in trace.turns if t.status == "error"]
    context = [t for t in errors if any(m in (t.error or "") for m in _CONTEXT_MARKERS)]
    if context:
        last = context[-1]
        return (f"the proxy refused {len(context)} call(s) over the context limit (turn {last.turn_index}: "
                f"{last.error}); raise engine.max_context_tokens")
    if errors:
        last = errors[-1]
        return f"the proxy answered {len(errors)} call(s) with an error (turn {last.turn_index}: {last.error})"
    answered = [t for t in trace.turns if t.status != "error"]
    if answered and answered[-1].finish_reason == "length":
        last = answered[-1]
        n = len(last.completion_ids)
        asked = next((v for k in _ASKED_KEYS if isinstance(v := last.request.get(k), int)), None)
        if asked is not None and asked <= n:
            return (f"the agent's last reply (turn {last.turn_index}) was cut at {n} tokens, the max_tokens "
                    "the agent itself asked for (a harness option such as harness.options.output_tokens)")
        cap = last.sampling.max_tokens if last.sampling is not None else n
        return (f"the agent's last reply (turn {last.turn_index}) was cut at {n} tokens "
                f"(cap {cap}: sampling.max_tokens or the context left); raise sampling.max_tokens "
                "or engine.max_context_tokens")
    return None


def explain_agent_error(agent_error: str, trace: Trace | None) -> str:
    """`agent_error` prefixed with the proxy's part in it when the trace shows one."""
    cause = proxy_cause(trace) if trace is not None else None
    return agent_error if cause is None else f"{cause} (agent: {agent_error})"


LAST_OUTPUT_CHARS = 200
"""Characters of the agent's last line of output that a timeout's message quotes."""


def timeout_cause(timeout_s: float, trace: Trace | None, log_tail: str) -> str:
    """The message of a timed-out rollout: the limit, the engine calls the agent was still
    waiting on (`Trace.in_flight`) or that it waited on none, and its last line of output."""
    calls = trace.in_flight if trace is not None else []
    if calls:
        waiting = (f"{len(calls)} engine call(s) in flight at the timeout (" + "; ".join(map(describe_call, calls))
                   + "): the engine was still serving the agent")
    else:
        waiting = "no engine call in flight at the timeout: the agent itself was busy or hung"
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    last = f"; agent's last output: {lines[-1][-LAST_OUTPUT_CHARS:]!r}" if lines else "; the agent wrote no output"
    return f"agent exceeded {timeout_s:.0f} s; {waiting}{last}"


def describe_call(call: CallInFlight) -> str:
    """One in-flight call in words, e.g. `turn 1: 7,501 prompt tokens, 3,072 prefilled, 0 decoded,
    598.0 s waiting`."""
    head = f"turn {call.turn_index}: {call.prompt_tokens:,} prompt tokens"
    if call.prefilled_tokens is None:
        return f"{head}, {call.age_s:.1f} s since it was sent (the engine reports no progress)"
    head += f", {call.prefilled_tokens:,} prefilled, {call.decoded_tokens or 0:,} decoded"
    if call.decode_s is None:
        return f"{head}, {call.wait_s or 0.0:.1f} s waiting or prefilling"
    return f"{head}, {call.wait_s or 0.0:.1f} s to prefill, {call.decode_s:.1f} s decoding"

"""Why an agent failed, when the cause is on the proxy's side of the trace.

Responsibility: after the agent exited with an error, look at its recorded turns and say what
the proxy did to it (refused a prompt over the context limit, answered with an error, cut the
last reply at the token cap) in the rollout's `error`, with the setting to change. An agent's
own message (`codex exited with code 1: 0`) rarely says it; the trace does.

What it does not do: change a rollout's status (still `agent_error`), or guess when the trace
shows nothing unusual (the agent's own message is kept as it is).
"""

from __future__ import annotations

from harnessrl.types import Trace

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

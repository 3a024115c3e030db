"""The settings of the intercepting proxy: the run's sampling (`SamplingConfig`, a run config's
`[sampling]`), its bounds (`ProxyBounds`, a run config's `[proxy]`), and `ProxyConfig`, both with
what the command sets (listener, model name, trace file), built by `proxy_config`.

What this module deliberately does not do: start anything. `server.ProxyServer` reads it.
Sampling values here are the run's: with `enforce_sampling` they override whatever an agent
sends (DESIGN.md §3.2).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class SamplingConfig(BaseModel):
    """The run's sampling parameters (`[sampling]`), enforced by the proxy whatever the agent
    sends; the one shape of them (each turn records what was used, `types.Sampling`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=0.4, ge=0.0)
    """0.4 by default: SmolLM2-135M through mini-swe-agent's compact prompt wrote a well-formed
    action in 10 of 16 replies at 0.4 and 2 of 16 at 0.7 (the trainer's logprobs use the same
    temperature, so a lower one stays exact; top_p / top_k truncation is refused in training).
    0 is greedy, for a proxy run by hand; a run config refuses it (`RunConfig`)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass kept; 1.0 disables it."""
    top_k: int = Field(default=0, ge=0)
    """Highest-probability ids kept; 0 disables it."""
    max_tokens: int = Field(default=192, ge=1)
    """Cap on completion tokens per turn: the agent's `max_tokens` / `max_completion_tokens` can
    only lower it, and the context left caps it too. Unset in a run config: the reply length
    the harness asks for, at least 192."""


class ProxyBounds(BaseModel):
    """The proxy's bounds on what agents send and hold (`[proxy]` of a run config): each one
    refuses or ends what goes past it, with the error named below."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Request bodies above this get 413."""
    max_stop_strings: int = Field(default=16, ge=0, le=1024)
    """Stop strings one call may send (`stop`, Messages `stop_sequences`, Google
    `generationConfig.stopSequences`); more get 400 naming the field. Every stop string is
    searched in each reply, so a long list costs CPU on the event loop per call."""
    max_stop_bytes: int = Field(default=256, ge=1, le=65536)
    """UTF-8 bytes of one stop string at most; a longer one gets 400 naming the field."""
    max_messages: int = Field(default=4096, ge=1)
    """Messages one call may send (after a protocol's conversion to chat messages); more get
    400 (`messages`). The template renders every message, on the event loop."""
    max_tool_calls_per_message: int = Field(default=128, ge=1)
    """Replayed tool calls one assistant message may hold; more get 400 naming the message."""
    max_tools: int = Field(default=256, ge=0)
    """Tool definitions one call may send; more get 400 (`tools`)."""
    max_tools_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Bytes of the JSON of all tool definitions of one call together; more get 400 (`tools`)."""
    max_session_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Request-body bytes one session may send in all (every call counted as it arrives, refused
    ones too); past it, calls get 413 (code `session_body_budget`), are counted in
    `Trace.refused_calls` and not recorded, so one session cannot grow the trainer's memory or
    `rollouts.jsonl` without bound. At the default max_body_bytes this is 8 full bodies."""
    max_connections: int = Field(default=1024, ge=1)
    """Open connections the agents' listeners (TCP and Unix socket) hold at most; one past it is
    closed at once, before any byte is read. Kept below the process's descriptor limit at start
    (`ProxyServer.start` lowers it there and logs why)."""
    max_connections_per_peer: int = Field(default=64, ge=1)
    """Open connections one peer may hold: a TCP client address, a session key (while a call
    holds it), or one Unix-socket connection's sender (pid and uid, `SO_PEERCRED`). One past
    it is closed; its siblings are served."""
    max_concurrent_calls_per_session: int = Field(default=8, ge=1)
    """Calls one session may have in flight at once (each holds a connection while it is
    served, a stream until its last event); one more gets 429 (code
    `too_many_concurrent_calls`), counted in `Trace.refused_calls`, not recorded. The shipped
    agents make one call at a time, a few with a side call (a title, a summary) or parallel
    sub-agents beside it; 8 leaves them room while one session cannot queue dozens of long
    calls in front of its siblings'."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    """Bytes of one request's header section at most (request line and headers); past it the
    connection gets 431 and is closed. Headers are outside `max_body_bytes`."""
    max_json_depth: int = Field(default=64, ge=4, le=200)
    """Request bodies nested deeper than this (objects and arrays) get 400 at parse time. At
    most 200, so a recorded body stays below the JSON encoders' 255-level limit."""
    read_timeout_s: float = Field(default=30.0, gt=0.0)
    """A connection must deliver a request's headers and whole body within this many seconds
    of connecting (or of its previous response); otherwise it is closed (slow-header,
    partial-body and silent connections cannot hold sockets)."""
    keepalive_timeout_s: float = Field(default=5.0, gt=0.0)
    """An idle keep-alive connection is closed after this many seconds (uvicorn's
    `timeout_keep_alive`)."""
    max_closed_traces: int = Field(default=64, ge=0)
    """Without a `trace_path`, the traces of this many most recently closed sessions stay in
    memory for `GET /admin/sessions/{id}/trace`; older ones are dropped. With a trace path,
    closed traces are served from the file and none stay in memory."""
    max_turns_per_session: int = Field(default=4096, ge=1)
    """Calls one session may make; later calls get 429 (counted in `Trace.refused_calls`, not
    recorded), so a session flooding the proxy with calls cannot grow its trace without bound."""
    max_revoked_keys: int = Field(default=100_000, ge=1)
    """Revoked keys remembered (a few hundred bytes each) so late calls are counted in
    `Trace.rejected_calls`; older revoked keys still get 401, uncounted (keys are never reused)."""
    stream_keepalive_s: float = Field(default=15.0, gt=0.0)
    """While a streamed call generates, an SSE comment is sent this often (keeps clients'
    read timeouts from firing on slow CPU generation)."""
    max_model_calls: int = Field(default=64, ge=0)
    """Model calls one session (one rollout) may make, each counted on arrival, rejected ones
    too (0: no limit). Past it, and when a call's prompt leaves no room in the context, the
    agent gets a final stop in its own protocol (empty assistant text, no tool call,
    finish_reason stop) that ends its loop, rather than an error it may retry until the
    timeout; recorded as an `error` turn noted `final_stop: ...`, never trained. 64 by default:
    the shipped harnesses need at most about 40 (claude-code's `max_turns` 20, each with a side
    call; mini-swe-agent's `step_limit` and the white-box loops' `max_turns` are single digits;
    the opencode recipe sets 64 itself), and without a bound one rollout could make thousands
    of calls."""


class ProxyConfig(ProxyBounds):
    """A proxy's settings: its bounds, the sampling it enforces, and what the command sets."""

    host: str = "127.0.0.1"
    """Interface the agents listener binds (a run on a Ray cluster binds `rollout.ray.proxy_host`);
    the admin listener always binds 127.0.0.1."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 lets the OS pick one (read it back from `ProxyServer.base_url`)."""
    model_name: str = "harnessrl-policy"
    """Model id listed by `GET /v1/models` (requests may name any model; it is echoed back)."""
    sampling: SamplingConfig = SamplingConfig()
    """The run's sampling (0 temperature: greedy)."""
    enforce_sampling: bool = True
    """True: temperature/top_p/top_k/seed from the agent are ignored and the run's are used.
    False: the agent's values win where it sends them (useful for hand tests, never for RL)."""
    trace_path: Path | None = None
    """JSONL file to which each session's trace is appended when it closes; None keeps
    traces in memory only."""


def proxy_config(bounds: ProxyBounds, sampling: SamplingConfig, *, host: str, port: int, model_name: str,
                 trace_path: Path | None = None) -> ProxyConfig:
    """The settings of a command's proxy: a run config's `[proxy]` bounds and `[sampling]`,
    enforced, on `host:port` (the one mapping of a run's sampling to the proxy: `harnessrl
    train`, `rollout` and `serve` all use it)."""
    return ProxyConfig(**dict(bounds), sampling=sampling, enforce_sampling=True, host=host, port=port,
                       model_name=model_name, trace_path=trace_path)

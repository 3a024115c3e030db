"""Sessions and the recorder: which rollout a key addresses, and the trace of its turns.

Responsibility: open a session (an unguessable key per rollout), find the session of a key,
append recorded `Turn`s to its `Trace`, revoke the key and close the trace, write closed
traces as JSONL (one session per line) and read them back (`read_traces`).

Invariants:
  * A key is live from `open` until `close`; after that it is revoked forever. Calls with a
    revoked key are counted in `Trace.rejected_calls` (served by `trace`/`trace_json`).
  * `close` returns the final trace: a call still in flight when it ran is never appended
    after it (`Session.record` refuses once the session is revoked; the caller answers 401).
  * `Turn.turn_index` is assigned at arrival (`Session.reserve_turn_index`); the trace lists
    turns in that order whatever order they finish in.
  * Writing never fails on a turn: a turn that cannot be serialised (`trace_json`) is
    replaced by an error turn saying why, so a trace always writes and reloads.
  * Memory is bounded: a closed session is dropped from memory. With a trace file its trace is
    served from the file (offset kept); without one, only the `max_closed_traces` most
    recently closed traces stay in memory. At most `max_revoked_keys` revoked keys are
    remembered for counting late calls (older ones still get 401, uncounted; keys are never
    reused).
  * A session records at most `max_turns_per_session` turns and receives at most
    `max_session_body_bytes` of request bodies; later calls are answered 429 / 413 and counted
    in `Trace.refused_calls` (with error bodies truncated, a live session's memory is then
    bounded too).
  * `close` records the calls the engine was still serving (`Session.engine_calls`) on the
    trace (`Trace.in_flight`): a timed-out rollout says whether its agent waited on the engine.
  * The store is used from one event loop; it holds no locks.

What this module deliberately does not do: talk HTTP or call engines.
"""

from __future__ import annotations

import bisect
import collections
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.chat.layer import BridgePoint
from harnessrl.engine.base import CallProgress
from harnessrl.errors import ConfigError, RequestError
from harnessrl.types import CallInFlight, Trace, Turn

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Session:
    """One rollout's live session (mutable: the recorder appends to `trace`)."""

    session_id: str
    key: str
    trace: Trace
    revoked: bool = False
    max_turns: int = 4096
    """Calls recorded at most; later calls are refused (`reserve_turn_index`)."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Request-body bytes the session may send in all (`charge_body`)."""
    body_bytes: int = 0
    """Request-body bytes received so far (calls refused by `charge_body` not counted)."""
    in_flight: int = 0
    """Calls of this session being served now (`begin_call` / `end_call`)."""
    max_in_flight: int = 8
    """Calls served at once at most (`begin_call`)."""
    cache_scope: str | None = None
    """The engine's prefix-cache scope of its calls (`Engine.generate`): its rollout group, so
    the group's rollouts share their task prompt's KV and no other session times it; without a
    group its own session id."""
    _next_index: int = field(default=0, repr=False)
    bridge_points: list[BridgePoint] = field(default_factory=list, repr=False)
    """Recent finished turns a later request may bridge on (`capture.py`, `chat.plan_prompt`)."""
    engine_calls: dict[int, CallProgress] = field(default_factory=dict, repr=False)
    """Turn index -> progress of the calls waiting on the engine now (`capture.generate_chat`)."""
    cut_off: list[CallInFlight] = field(default_factory=list, repr=False)
    """Engine calls cancelled because their client went away (`cut_off_call`), as they stood
    then: an agent killed at its timeout drops its connections, which cancels its calls before
    its session closes, and `close` still reports them (at most `max_in_flight` kept)."""

    def calls_in_flight(self, now_s: float | None = None) -> list[CallInFlight]:
        """The engine calls in flight at `now_s` (`time.perf_counter()`; default now), in turn
        order, after those cut off by their client (`cut_off`)."""
        now = time.perf_counter() if now_s is None else now_s
        return [*self.cut_off, *(in_flight(i, c, now) for i, c in sorted(self.engine_calls.items()))]

    def cut_off_call(self, turn_index: int) -> None:
        """Keep, for `close`, how far the engine had got with call `turn_index` when its client
        went away; the call leaves `engine_calls`."""
        call = self.engine_calls.pop(turn_index, None)
        if call is not None and len(self.cut_off) < self.max_in_flight:
            self.cut_off.append(in_flight(turn_index, call, time.perf_counter()))

    def reserve_turn_index(self) -> int:
        """The next 0-based turn index, in order of arrival.

        Raises:
            RequestError: 429 once `max_turns` calls were made (the call is counted in
                `Trace.refused_calls` and gets no turn): a session's memory stays bounded.
        """
        index = self._next_index
        if index >= self.max_turns:
            self.trace.refused_calls += 1
            raise RequestError(f"this session already made max_turns_per_session={self.max_turns} calls",
                               code="too_many_turns", status_code=429)
        self._next_index += 1
        return index

    def begin_call(self) -> None:
        """Count a call being served (until `end_call`).

        Raises:
            RequestError: 429 (code `too_many_concurrent_calls`) when `max_in_flight` calls are
                being served already; counted in `Trace.refused_calls`, not in `in_flight`.
        """
        if self.in_flight >= self.max_in_flight:
            self.trace.refused_calls += 1
            raise RequestError(f"this session already has {self.in_flight} calls in flight "
                               f"(max_concurrent_calls_per_session={self.max_in_flight})",
                               code="too_many_concurrent_calls", status_code=429)
        self.in_flight += 1

    def end_call(self) -> None:
        self.in_flight -= 1

    def charge_body(self, size: int) -> None:
        """Count a request body of `size` bytes against `max_body_bytes`.

        Raises:
            RequestError: 413 (code `session_body_budget`) when it would exceed the budget; the
                call is counted in `Trace.refused_calls`, gets no turn, and its bytes are not
                counted.
        """
        if self.body_bytes + size > self.max_body_bytes:
            self.trace.refused_calls += 1
            raise RequestError(f"this session already sent {self.body_bytes} bytes of request bodies; a body of "
                               f"{size} bytes would exceed max_session_body_bytes={self.max_body_bytes}",
                               code="session_body_budget", status_code=413)
        self.body_bytes += size

    def record(self, turn: Turn) -> bool:
        """Append `turn`, keeping turns ordered by `turn_index`.

        Returns:
            False (nothing appended) when the session was closed meanwhile: the trace that
            `close` returned is final.
        """
        if self.revoked:
            log.debug("dropped turn %d of closed session %s", turn.turn_index, self.session_id)
            return False
        turns = self.trace.turns
        if not turns or turns[-1].turn_index < turn.turn_index:
            turns.append(turn)
        else:
            bisect.insort(turns, turn, key=lambda t: t.turn_index)
        return True


@dataclass(slots=True)
class _Closed:
    """What stays of a closed session: its key, late-call count and where its trace is."""

    key: str
    rejected_calls: int
    trace: Trace | None = None
    """Kept only without a trace file, for the most recently closed sessions."""
    offset: int = -1
    """Byte offset of its line in the trace file (-1: not written)."""


class SessionStore:
    """All sessions of one proxy, addressed by session id and by key.

    Args:
        trace_path: JSONL file that closed traces are appended to; None keeps the most
            recent `max_closed_traces` of them in memory instead.
        max_closed_traces: closed traces kept in memory when there is no trace file (>= 0).
        max_revoked_keys: closed sessions (key, late-call count, file offset) remembered (>= 1).
        max_turns_per_session: calls a session may make (>= 1); later ones get 429, counted
            in `Trace.refused_calls`, unrecorded.
        max_session_body_bytes: request-body bytes a session may send in all (>= 1); a call
            past it gets 413, counted in `Trace.refused_calls`, unrecorded.
        max_concurrent_calls: calls a session may have in flight at once; one more gets 429,
            counted in `Trace.refused_calls`, unrecorded.

    Raises:
        ConfigError: a bound is out of range.
    """

    def __init__(self, trace_path: Path | None = None, *, max_closed_traces: int = 64,
                 max_revoked_keys: int = 100_000, max_turns_per_session: int = 4096,
                 max_session_body_bytes: int = 64 * 1024 * 1024, max_concurrent_calls: int = 8) -> None:
        if max_closed_traces < 0 or max_revoked_keys < 1 or max_turns_per_session < 1 or max_session_body_bytes < 1:
            raise ConfigError(f"max_closed_traces={max_closed_traces} must be >= 0, "
                              f"max_revoked_keys={max_revoked_keys}, "
                              f"max_turns_per_session={max_turns_per_session} and "
                              f"max_session_body_bytes={max_session_body_bytes} >= 1")
        self.max_turns_per_session = max_turns_per_session
        self.max_session_body_bytes = max_session_body_bytes
        self.max_concurrent_calls = max(1, max_concurrent_calls)
        self.trace_path = trace_path
        self.max_closed_traces = max_closed_traces
        self.max_revoked_keys = max_revoked_keys
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._closed: collections.OrderedDict[str, _Closed] = collections.OrderedDict()
        self._revoked: dict[str, str] = {}
        """Revoked key -> session id (same entries as `_closed`)."""
        self._in_memory: collections.deque[str] = collections.deque()
        """Ids of closed sessions whose trace is kept in memory, oldest first."""

    def open(self, rollout_id: str | None = None, group: str | None = None) -> Session:
        """Open a session for `rollout_id`; its calls share the prefix cache with `group`'s
        sessions only (None: with no other session)."""
        session = Session(
            session_id="ses_" + secrets.token_hex(8),
            key="hrl-" + secrets.token_urlsafe(24),
            trace=Trace(session_id="", rollout_id=rollout_id),
            max_turns=self.max_turns_per_session,
            max_body_bytes=self.max_session_body_bytes,
            max_in_flight=self.max_concurrent_calls,
        )
        session.trace.session_id = session.session_id
        session.cache_scope = session.session_id if group is None else f"g:{group}"
        self._by_id[session.session_id] = session
        self._by_key[session.key] = session
        return session

    def lookup(self, key: str) -> Session | None:
        """The live session of `key`; None for unknown or revoked keys (a remembered revoked
        key's call is counted on its trace)."""
        session = self._by_key.get(key)
        if session is not None:
            return session
        session_id = self._revoked.get(key)
        if session_id is not None:
            closed = self._closed[session_id]
            closed.rejected_calls += 1
            if closed.trace is not None:
                closed.trace.rejected_calls = closed.rejected_calls
        return None

    def get(self, session_id: str) -> Session | None:
        """The live session with this id; None when unknown or closed."""
        return self._by_id.get(session_id)

    def known(self, session_id: str) -> bool:
        """True for a live session or a remembered closed one."""
        return session_id in self._by_id or session_id in self._closed

    def close(self, session_id: str) -> Trace:
        """Revoke the key, stamp `closed_at`, write the trace (if a path is set), return it.

        A second close of the same session returns its trace again (from the file or memory).

        Raises:
            KeyError: no session has this id, or it was closed so long ago that it is no
                longer remembered (or its trace is no longer kept).
        """
        session = self._by_id.pop(session_id, None)
        if session is None:
            trace = self.trace(session_id)
            if trace is None:
                raise KeyError(session_id)
            return trace
        session.revoked = True
        del self._by_key[session.key]
        trace = session.trace
        trace.closed_at = time.time()
        trace.in_flight = session.calls_in_flight()
        closed = _Closed(session.key, trace.rejected_calls)
        line = trace_json(trace)  # also makes the returned trace serialisable (rollouts.jsonl)
        if self.trace_path is not None:
            closed.offset = _append_line(self.trace_path, line)
        elif self.max_closed_traces > 0:
            closed.trace = trace
            self._in_memory.append(session_id)
            while len(self._in_memory) > self.max_closed_traces:
                old = self._closed.get(self._in_memory.popleft())
                if old is not None:
                    old.trace = None
        self._closed[session_id] = closed
        self._revoked[session.key] = session_id
        while len(self._closed) > self.max_revoked_keys:
            _, old = self._closed.popitem(last=False)
            del self._revoked[old.key]
        return trace

    def trace(self, session_id: str) -> Trace | None:
        """The trace of a live or closed session (a closed one read back from the trace file,
        with late calls counted); None when unknown or no longer kept."""
        session = self._by_id.get(session_id)
        if session is not None:
            return session.trace
        closed = self._closed.get(session_id)
        if closed is None:
            return None
        if closed.trace is not None:
            return closed.trace
        if closed.offset < 0 or self.trace_path is None:
            return None
        with self.trace_path.open("rb") as f:
            f.seek(closed.offset)
            trace = Trace.model_validate_json(f.readline())
        trace.rejected_calls = closed.rejected_calls
        return trace

    def trace_json(self, session_id: str) -> str | None:
        """`trace(session_id)` as JSON (see `trace_json`); None when unknown or not kept."""
        trace = self.trace(session_id)
        return None if trace is None else trace_json(trace)

    def close_all(self) -> list[Trace]:
        """Close every live session (shutdown)."""
        return [self.close(s.session_id) for s in list(self._by_key.values())]

    def longest_prefill(self) -> CallProgress | None:
        """The engine call of a live session with the most prompt tokens still to prefill, for
        the console's progress line; None when no call is prefilling (or the engine does not
        report it)."""
        best: CallProgress | None = None
        for session in self._by_key.values():
            for call in session.engine_calls.values():
                if call.prefilled_tokens is None or call.prefilled_s is not None:
                    continue
                if best is None or _left(call) > _left(best):
                    best = call
        return best

    @property
    def live_sessions(self) -> int:
        return len(self._by_key)

    @property
    def closed_sessions(self) -> int:
        """Closed sessions still remembered (bounded by `max_revoked_keys`)."""
        return len(self._closed)


def in_flight(turn_index: int, call: CallProgress, now_s: float) -> CallInFlight:
    """What `call` had got from the engine by `now_s` (`time.perf_counter()`)."""
    age = max(0.0, now_s - call.started_s)
    wait = decode = None
    if call.prefilled_tokens is not None:
        wait = age if call.prefilled_s is None else max(0.0, call.prefilled_s - call.started_s)
        decode = None if call.prefilled_s is None else max(0.0, now_s - call.prefilled_s)
    return CallInFlight(turn_index=turn_index, prompt_tokens=call.prompt_tokens, age_s=round(age, 3),
                        prefilled_tokens=call.prefilled_tokens, decoded_tokens=call.decoded_tokens,
                        wait_s=None if wait is None else round(wait, 3),
                        decode_s=None if decode is None else round(decode, 3))


def _left(call: CallProgress) -> int:
    return call.prompt_tokens - (call.prefilled_tokens or 0)


def trace_json(trace: Trace) -> str:
    """Serialise `trace`; a turn that cannot be serialised (e.g. nested past the encoder's
    limit) is first replaced, in `trace` itself, by an error turn saying why."""
    try:
        return trace.model_dump_json()
    except ValueError:  # PydanticSerializationError: find the turns at fault
        pass
    for i, turn in enumerate(trace.turns):
        try:
            turn.model_dump_json()
        except ValueError as exc:
            log.warning("trace %s: turn %d cannot be serialised: %s", trace.session_id, turn.turn_index, exc)
            trace.turns[i] = unserialisable_turn(turn, exc)
    return trace.model_dump_json()


def unserialisable_turn(turn: Turn, exc: Exception) -> Turn:
    """An error turn standing in for `turn`: same index, protocol, timing and headers; no
    bodies or ids (never trained)."""
    return Turn(turn_index=turn.turn_index, protocol=turn.protocol, request={}, status="error",
                error=f"turn could not be serialised ({str(exc)[:300]}); its bodies and ids were dropped",
                started_at=turn.started_at, latency_s=turn.latency_s,
                headers={str(k): str(v) for k, v in turn.headers.items()}, request_kind=turn.request_kind,
                policy_version=turn.policy_version)


def _append_line(path: Path, line: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        offset = f.seek(0, 2)
        f.write(line.encode("utf-8") + b"\n")
    return offset


def read_traces(path: Path) -> list[Trace]:
    """Read every trace of a JSONL trace file. A torn last line (a write cut by a crash: no
    final newline, not valid) is skipped with a warning.

    Raises:
        ConfigError: a line is not a valid trace (the message names the file and line).
    """
    traces: list[Trace] = []
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            traces.append(Trace.model_validate_json(line))
        except ValueError as exc:
            if lineno == len(lines) and not line.endswith("\n"):
                log.warning("%s:%d: skipped a torn last line (%d characters)", path, lineno, len(line))
                continue
            raise ConfigError(f"{path}:{lineno}: not a valid trace: {exc}") from exc
    return traces

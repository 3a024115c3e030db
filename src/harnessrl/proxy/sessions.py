"""Sessions and the recorder: which rollout a key addresses, and the trace of its turns.

Responsibility: open a session (an unguessable key per rollout), find the session of a key,
append recorded `Turn`s to its `Trace`, revoke the key and close the trace, write closed
traces as JSONL (one session per line) and read them back (`read_traces`).

Invariants:
  * A key is live from `open` until `close`; after that it is revoked forever and calls with
    it are counted in `Trace.rejected_calls` (of the trace object `close` returned).
  * `Turn.turn_index` is assigned at arrival (`Session.reserve_turn_index`); the trace lists
    turns in that order whatever order they finish in.
  * The store is used from one event loop; it holds no locks.

What this module deliberately does not do: talk HTTP or call engines.
"""

from __future__ import annotations

import bisect
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.errors import ConfigError
from harnessrl.types import Trace, Turn


@dataclass(slots=True)
class Session:
    """One rollout's live session (mutable: the recorder appends to `trace`)."""

    session_id: str
    key: str
    trace: Trace
    revoked: bool = False
    _next_index: int = field(default=0, repr=False)

    def reserve_turn_index(self) -> int:
        """The next 0-based turn index, in order of arrival."""
        index = self._next_index
        self._next_index += 1
        return index

    def record(self, turn: Turn) -> None:
        """Append `turn`, keeping turns ordered by `turn_index`."""
        turns = self.trace.turns
        if not turns or turns[-1].turn_index < turn.turn_index:
            turns.append(turn)
        else:
            bisect.insort(turns, turn, key=lambda t: t.turn_index)


class SessionStore:
    """All sessions of one proxy, addressed by session id and by key.

    Args:
        trace_path: JSONL file that closed traces are appended to; None keeps them in memory.
    """

    def __init__(self, trace_path: Path | None = None) -> None:
        self.trace_path = trace_path
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._revoked: dict[str, Session] = {}

    def open(self, rollout_id: str | None = None) -> Session:
        session = Session(
            session_id="ses_" + secrets.token_hex(8),
            key="hrl-" + secrets.token_urlsafe(24),
            trace=Trace(session_id="", rollout_id=rollout_id),
        )
        session.trace.session_id = session.session_id
        self._by_id[session.session_id] = session
        self._by_key[session.key] = session
        return session

    def lookup(self, key: str) -> Session | None:
        """The live session of `key`; None for unknown or revoked keys (a revoked key's
        call is counted on its trace)."""
        session = self._by_key.get(key)
        if session is not None:
            return session
        revoked = self._revoked.get(key)
        if revoked is not None:
            revoked.trace.rejected_calls += 1
        return None

    def get(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def close(self, session_id: str) -> Trace:
        """Revoke the key, stamp `closed_at`, write the trace (if a path is set), return it.

        Raises:
            KeyError: no session has this id (already closed sessions return their trace).
        """
        session = self._by_id[session_id]
        if session.revoked:
            return session.trace
        session.revoked = True
        del self._by_key[session.key]
        self._revoked[session.key] = session
        session.trace.closed_at = time.time()
        if self.trace_path is not None:
            append_trace(self.trace_path, session.trace)
        return session.trace

    def close_all(self) -> list[Trace]:
        """Close every live session (shutdown)."""
        return [self.close(s.session_id) for s in list(self._by_key.values())]

    @property
    def live_sessions(self) -> int:
        return len(self._by_key)


def append_trace(path: Path, trace: Trace) -> None:
    """Append one trace as a JSON line to `path` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(trace.model_dump_json() + "\n")


def read_traces(path: Path) -> list[Trace]:
    """Read every trace of a JSONL trace file.

    Raises:
        ConfigError: a line is not a valid trace (the message names the file and line).
    """
    traces: list[Trace] = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                traces.append(Trace.model_validate_json(line))
            except ValueError as exc:
                raise ConfigError(f"{path}:{lineno}: not a valid trace: {exc}") from exc
    return traces

"""The `Verifier` seam: scores a finished workspace with hidden tests.

A verifier runs only after the agent's processes are dead and its proxy key revoked. It
returns a `Reward`. Three kinds of outcome (DESIGN.md §3.5, "no opting out of a reward"):
  * scored: `value` is the verifier's judgement of the submission;
  * failed by the agent's own doing (`Reward.agent_failure`, `cause` set): the sandbox went
    past a bound (`disk_bytes`, inodes, the verifier's copy bounds, a filesystem it filled),
    or the workspace is one the verifier refuses. `value` is the verifier's failure value
    (`failure_value`, 0.0 unless the verifier says otherwise): the rollout stays in its group's
    baseline with that reward, so a policy cannot opt out of a negative advantage;
  * the verifier itself failed (crash, timeout, missing interpreter): `Reward.error`, which
    the rollout runner records as status `verifier_error`, reward None. Only faults of the
    infrastructure belong here.

`limit_cause` tells a sandbox error the agent caused from an infrastructure one, whatever
type it surfaces as; `over_limit` reads the bound a sandbox records as exceeded.

Budget: a verifier that runs the agent's code must end within the rollout's
`rollout.verify_timeout_s`, or the runner cancels it and the rollout goes unscored, which a
submission that sleeps would choose. The runner sets the verifier's budget (`verify_budget`:
the rollout's timeout less `verify_margin_s` for staging and teardown) and the built-in
verifiers read its deadline (`verify_deadline`), cutting each run of the agent's code to what
is left: a timeout there is a failed test, a scored outcome.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from harnessrl.errors import SandboxError, SandboxLimitError, SandboxLostError
from harnessrl.sandbox.base import Sandbox
from harnessrl.tasks.base import Task

LIMIT_MARKERS = ("disk_bytes", "inode", "max_inodes")
"""Words a `SandboxError` names when a bound the agent filled stopped it (the local and podman
sandboxes refuse a command with `exceeded disk_bytes=N`)."""
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A filesystem that is full (no blocks or no inodes left, or a quota): the agent filled it."""


@dataclass(frozen=True, slots=True)
class Reward:
    value: float | None
    """Scalar reward in the task family's range (usually [0, 1]); None when unscorable."""
    parts: dict[str, float] = field(default_factory=dict)
    """Named components (e.g. `tests_passed`, `tests_total`, `format_ok`)."""
    error: str | None = None
    """Set when the verifier itself failed (crash, timeout): the rollout is `verifier_error`."""
    cause: str | None = None
    """Set when the agent's own doing made this a failure without the submission being judged
    (see the module docstring); the runner records it as `Rollout.metadata["failure_cause"]`."""

    @classmethod
    def agent_failure(cls, cause: str, value: float = 0.0, parts: dict[str, float] | None = None) -> Reward:
        """A failure the agent caused: `value` (the verifier's failure value), `cause` recorded,
        part `agent_fault` = 1.0."""
        return cls(value=value, parts={**(parts or {}), "agent_fault": 1.0}, cause=cause)


class Verifier(Protocol):
    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        """Score the sandbox's workspace (and/or the agent's final answer) for `task`.

        A verifier may define `failure_value: float`, the reward of a rollout failed by the
        agent's own doing (0.0 when absent)."""
        ...


def failure_value(verifier: Any) -> float:
    """The reward `verifier` gives a failure the agent caused: its `failure_value`, else 0.0. A
    wrapper (a config-named verifier, a Ray node's) answers with its `inner` verifier's."""
    while not hasattr(verifier, "failure_value") and hasattr(verifier, "inner"):
        verifier = verifier.inner
    value = getattr(verifier, "failure_value", 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def limit_cause(exc: BaseException) -> str | None:
    """Why `exc` is the agent's doing, or None when it is not: a `SandboxLimitError`; a
    `SandboxError` naming one of `LIMIT_MARKERS` (a sandbox refusing commands past its
    `disk_bytes` or an inode bound); an OSError, or a `SandboxError` caused by one, whose errno
    says the filesystem is full (`FULL_ERRNOS`). A lost sandbox (`SandboxLostError`) is never
    the agent's doing."""
    if isinstance(exc, SandboxLostError):
        return None
    if isinstance(exc, SandboxLimitError):
        return str(exc)
    if isinstance(exc, SandboxError) and any(m in str(exc) for m in LIMIT_MARKERS):
        return str(exc)
    for err in (exc, exc.__cause__):
        if isinstance(err, OSError) and err.errno in FULL_ERRNOS:
            return f"the sandbox's filesystem is full: {exc}"
    return None


def over_limit(sandbox: Any) -> str | None:
    """The bound `sandbox` records as exceeded by its agent, or None: `limit_exceeded` (a
    string naming the bound, for backends that record one) or `disk_exceeded` (the local and
    podman sandboxes' disk watchdog)."""
    named = getattr(sandbox, "limit_exceeded", None)
    if isinstance(named, str) and named:
        return named
    if getattr(sandbox, "disk_exceeded", False) is True:
        limit = getattr(getattr(sandbox, "config", None), "disk_bytes", None)
        return f"disk_bytes={limit} exceeded" if limit is not None else "disk_bytes exceeded"
    return None


VERIFY_MARGIN_FRACTION = 0.1
"""Share of the rollout's verify timeout kept back from the verifier's budget (`verify_margin_s`)."""
VERIFY_MARGIN_MIN_S = 1.0
"""Least seconds kept back: staging the workspace copy, killing the last command, teardown."""
_DEADLINE: ContextVar[float | None] = ContextVar("harnessrl_verify_deadline", default=None)


def verify_margin_s(timeout_s: float) -> float:
    """Seconds of a rollout's verify timeout `timeout_s` the verifier leaves unspent:
    max(`VERIFY_MARGIN_MIN_S`, `VERIFY_MARGIN_FRACTION` * timeout_s)."""
    return max(VERIFY_MARGIN_MIN_S, VERIFY_MARGIN_FRACTION * timeout_s)


def verify_budget_s(timeout_s: float) -> float:
    """Seconds a verifier may spend within a rollout's verify timeout `timeout_s` (seconds):
    `timeout_s - verify_margin_s(timeout_s)`, possibly <= 0 for a timeout too short to verify
    (`rollout.verify_timeout_s` is refused below 10 s)."""
    return timeout_s - verify_margin_s(timeout_s)


@contextlib.contextmanager
def verify_budget(budget_s: float) -> Iterator[None]:
    """Within the block (and the tasks it starts), verifiers must end within `budget_s`
    seconds from now (`verify_deadline`)."""
    token = _DEADLINE.set(time.monotonic() + budget_s)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def verify_deadline(default_s: float) -> float:
    """The `time.monotonic()` by which the verifier running now must be done: the runner's
    (`verify_budget`), else `default_s` seconds from now (a verifier called directly)."""
    deadline = _DEADLINE.get()
    return deadline if deadline is not None else time.monotonic() + default_s


def remaining_budget_s() -> float | None:
    """Seconds left of the budget set by `verify_budget` (None outside one; may be <= 0)."""
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()

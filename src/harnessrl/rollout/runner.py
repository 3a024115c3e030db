"""One rollout, top to bottom: sandbox → proxy session → agent → kill → revoke → verify → release.

Responsibility: run one agent on one task and return a `Rollout` with exactly one terminal
status, its trace, its reward and its timings. `run_rollout` never raises for agent, sandbox or
verifier faults (a bad rollout is data, DESIGN.md §3.4); it re-raises only cancellation and
errors that mean the run cannot work at all (agent not installed, invalid config), after
releasing everything.

Invariants (DESIGN.md §3.3, §3.5):
  * every resource taken is released in `finally`: processes, the sandbox directory, the proxy
    key; teardown is shielded from cancellation;
  * the agent's processes are dead and its key revoked before the verifier runs; hidden tests
    enter the sandbox only inside the verifier; with a `VerifyGate` (the orchestrator gives each
    group one), never while an agent of the group is live, so no sibling on the same task can
    read a host-wide figure the hidden tests move;
  * no opting out of a reward (DESIGN.md §3.5): a sandbox the agent took past a bound
    (`disk_bytes`, inodes: `rewards/base.over_limit`) is not verified and scores the verifier's
    failure value (0.0); a verifier stopped by such a bound (`SandboxLimitError`, a
    `SandboxError` naming it, a full filesystem: `rewards/base.limit_cause`) or refusing the
    workspace (`Reward.agent_failure`) scores the same. The cause goes to
    `Rollout.metadata["failure_cause"]` (and `error` when nothing else is there); the status
    stays what the agent phase gave. Only verifier crashes, timeouts, a non-finite reward
    (`nan`, `inf`: `verifier_error` naming the value) and a lost sandbox are unscored (reward
    None);
  * status precedence: infra_error > verifier_error > timeout > agent_error > ok. Timed-out and
    failed agents are still verified, so their reward is known (usually 0). A sandbox whose
    processes survive the kill (`kill_processes` raises) is `infra_error` and is not verified;
    so is one whose machine went away (`SandboxLostError`, a dead Ray node), even mid-verify.
  * a sandbox that names its machine (`node_id`, Ray sandboxes) has it recorded in
    `Rollout.metadata["node_id"]`.

What it does not do: choose tasks, group rollouts or bound staleness (`orchestrator.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Protocol

from harnessrl.errors import ConfigError, HarnessInstallError, SandboxLostError
from harnessrl.harness.base import Harness, HarnessResult
from harnessrl.rewards.base import (
    Reward,
    Verifier,
    failure_value,
    limit_cause,
    over_limit,
    verify_budget,
    verify_budget_s,
)
from harnessrl.rollout.cause import explain_agent_error, timeout_cause
from harnessrl.sandbox.base import Sandbox, SandboxBackend
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint, Rollout, RolloutStatus, Trace

log = logging.getLogger(__name__)


class SessionHost(Protocol):
    """What the runner needs from the proxy (or the white-box recorder): keyed sessions."""

    def open_session(self, rollout_id: str, group: str | None = None) -> tuple[str, str]:
        """Open a session; returns `(session_id, key)`. Sessions of one `group` share the
        engine's prefix cache (and no other session does)."""
        ...

    def endpoint(self, key: str) -> Endpoint:
        """Where an agent holding `key` reaches the proxy."""
        ...

    def close_session(self, session_id: str) -> Trace:
        """Revoke the session's key and return its final trace."""
        ...


class VerifyGate(Protocol):
    """Keeps a group's verifications and its agents apart in time (`orchestrator.GroupGate`):
    hidden tests run while no sibling agent on the same task is live to read a host-wide
    figure they move (`/proc/sys/fs/file-nr`, `/proc/loadavg`)."""

    async def agent_starts(self) -> None:
        """Returns once no rollout of the group is verifying; this rollout's agent is then live."""
        ...

    async def agents_ended(self) -> None:
        """This rollout's agent has ended; returns once no agent of the group is live (this
        rollout is then verifying)."""
        ...

    def leave(self) -> None:
        """This rollout is done with the gate, in whatever state (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class RolloutLimits:
    agent_timeout_s: float = 300.0
    """Wall-clock limit of the agent phase."""
    verify_timeout_s: float = 120.0
    """Wall-clock limit of the verifier (beyond its own per-test limits)."""
    max_final_answer_chars: int = 65536
    """Characters of the agent's final answer the rollout records (`cut_answer`); the verifier
    scores the whole answer."""


async def run_rollout(
    task: Task,
    group_id: int,
    harness: Harness,
    backend: SandboxBackend,
    sessions: SessionHost,
    verifier: Verifier,
    limits: RolloutLimits = RolloutLimits(),
    rollout_id: str | None = None,
    gate: VerifyGate | None = None,
) -> Rollout:
    """Run `harness` on `task` in a fresh sandbox and score it. With `gate`, the agent starts
    when no sibling verifies and verification when no sibling agent is live (`VerifyGate`);
    the second wait is `timings_s["verify_wait_s"]`.

    Returns a `Rollout` whatever the agent, sandbox or verifier did. Raises only
    `asyncio.CancelledError`, `HarnessInstallError` and `ConfigError` (after releasing every
    resource).
    """
    rollout_id = rollout_id or uuid.uuid4().hex[:16]
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    sandbox: Sandbox | None = None
    session_id: str | None = None
    trace: Trace | None = None
    result: HarnessResult | None = None
    reward: Reward | None = None
    status: RolloutStatus = "ok"
    error: str | None = None
    try:
        # 1) sandbox with a fresh copy of the task's workspace
        try:
            sandbox = await backend.create(rollout_id, dict(task.workspace))
        except Exception as exc:  # noqa: BLE001 - a failed sandbox is this rollout's data
            status, error = "infra_error", f"sandbox create failed: {_describe(exc)}"
            return _finish(task, group_id, harness, rollout_id, status, error, None, None, None, timings, t0)
        timings["sandbox_s"] = time.monotonic() - t0

        # 2) a keyed proxy session; the key is the agent's API key
        session_id, key = sessions.open_session(rollout_id, group=f"group-{group_id}")
        endpoint = sandbox.agent_endpoint(sessions.endpoint(key))  # as the agent addresses it

        # 3) the agent runs its own loop until it exits or times out (never beside a
        # sibling's verification)
        if gate is not None:
            await gate.agent_starts()
        t_agent = time.monotonic()
        try:
            result = await harness.run(task, sandbox, endpoint, limits.agent_timeout_s)
        except (HarnessInstallError, ConfigError):
            raise  # the run cannot work at all: stop it with the message, don't record N failures
        except Exception as exc:  # noqa: BLE001 - a harness fault is this rollout's data
            status, error = "infra_error", f"harness {harness.name} raised: {_describe(exc)}"
        timings["agent_s"] = time.monotonic() - t_agent

        # 4) every agent process dead, 5) key revoked, before the hidden tests come in. A
        # process that survives the kill means no verification (hidden tests never meet a
        # live agent): this rollout's infra_error, the run goes on
        try:
            await sandbox.kill_processes()
        except SandboxLostError as exc:  # its processes went with its machine
            if status != "infra_error":
                status, error = "infra_error", f"sandbox lost: {exc}"
        except Exception as exc:  # noqa: BLE001 - a failed kill is this rollout's data
            status, error = "infra_error", f"agent processes survived the kill: {_describe(exc)}"
        trace = sessions.close_session(session_id)
        session_id = None
        if result is not None and status != "infra_error":
            if result.timed_out:
                # which calls the engine still served, and the agent's last words: slow engine or hung agent
                status, error = "timeout", timeout_cause(limits.agent_timeout_s, trace, result.log_tail)
            elif result.error is not None:
                # the agent's own message rarely names the cause when it is the proxy's answer
                status, error = "agent_error", explain_agent_error(result.error, trace)

        # 6) verify (also after a timeout or an agent error: the workspace is still scored).
        # A sandbox the agent took past one of its bounds scores as the agent's failure, and
        # so does a verifier that refused because of one: never an unscored rollout
        if gate is not None:  # no hidden test runs while a sibling's agent is live
            t_wait = time.monotonic()
            await gate.agents_ended()
            timings["verify_wait_s"] = time.monotonic() - t_wait
        if status != "infra_error":
            t_verify = time.monotonic()
            limit = over_limit(sandbox)
            if limit is not None:
                reward = Reward.agent_failure(f"the agent took its sandbox past a bound: {limit}",
                                              value=failure_value(verifier))
            else:
                try:
                    reward = await _verify(verifier, task, sandbox, result, limits.verify_timeout_s)
                except SandboxLostError as exc:  # the sandbox's machine went away: not the verifier's fault
                    status, error = "infra_error", f"sandbox lost during verification: {exc}"
                if reward is not None and reward.error is not None and (limit := over_limit(sandbox)) is not None:
                    reward = Reward.agent_failure(f"the workspace took the sandbox past a bound during "
                                                  f"verification: {limit} (verifier: {reward.error})",
                                                  value=failure_value(verifier))
            timings["verify_s"] = time.monotonic() - t_verify
            if reward is not None and reward.error is not None:
                status, error = "verifier_error", reward.error
        result = cut_answer(result, limits.max_final_answer_chars)
        return _finish(task, group_id, harness, rollout_id, status, error, trace, result, reward, timings, t0,
                       node_id=getattr(sandbox, "node_id", None))
    finally:
        if gate is not None:
            gate.leave()  # a rollout that ended early never holds its siblings back
        # 7) release everything, even under cancellation: a cancel arriving meanwhile waits
        # for the release to finish before it propagates
        release = asyncio.ensure_future(_release(sessions, session_id, sandbox))
        try:
            await asyncio.shield(release)
        except asyncio.CancelledError:
            await release
            raise


ANSWER_CUT_MARK = "…[final answer cut: {n} characters in all]"
"""Ends a recorded final answer that `cut_answer` shortened (`{n}`: the answer's length)."""


def cut_answer(result: HarnessResult | None, max_chars: int) -> HarnessResult | None:
    """`result` with its final answer cut to its first `max_chars` characters plus
    `ANSWER_CUT_MARK`, when longer. The answer is kept on the rollout (`rollouts.jsonl`, the
    trainer's memory, the viewer): an agent could otherwise make one row of megabytes."""
    answer = result.final_answer if result is not None else None
    if result is None or answer is None or len(answer) <= max_chars:
        return result
    return dataclasses.replace(result, final_answer=answer[:max_chars] + ANSWER_CUT_MARK.format(n=len(answer)))


async def _verify(
    verifier: Verifier, task: Task, sandbox: Sandbox, result: HarnessResult | None, timeout_s: float
) -> Reward:
    answer = result.final_answer if result is not None else None
    try:
        # the verifier's own deadline falls inside this timeout (rewards/base.verify_budget):
        # the built-in verifiers end on time, scoring what they could not run as failed
        with verify_budget(verify_budget_s(timeout_s)):
            reward = await asyncio.wait_for(verifier.score(task, sandbox, answer), timeout_s)
    except SandboxLostError:
        raise
    except asyncio.TimeoutError:
        return Reward(value=None, error=f"verifier exceeded {timeout_s:.0f} s")
    except Exception as exc:  # noqa: BLE001 - a verifier crash is this rollout's data
        cause = limit_cause(exc)
        if cause is not None:  # a bound the agent filled stopped the verifier: the agent's failure
            return Reward.agent_failure(f"the verifier refused: {cause}", value=failure_value(verifier))
        return Reward(value=None, error=f"verifier crashed: {_describe(exc)}")
    if reward.value is not None and not math.isfinite(reward.value):  # no advantage can use it
        return Reward(value=None, parts=reward.parts,
                      error=f"verifier returned reward {reward.value!r}, which is not finite")
    return reward


async def _release(sessions: SessionHost, session_id: str | None, sandbox: Sandbox | None) -> None:
    if session_id is not None:
        try:
            sessions.close_session(session_id)
        except Exception:  # noqa: BLE001 - teardown must go on
            log.exception("closing proxy session %s failed", session_id)
    if sandbox is not None:
        try:
            await sandbox.close()
        except Exception:  # noqa: BLE001 - teardown must go on
            log.exception("closing sandbox failed")


def _finish(
    task: Task,
    group_id: int,
    harness: Harness,
    rollout_id: str,
    status: RolloutStatus,
    error: str | None,
    trace: Trace | None,
    result: HarnessResult | None,
    reward: Reward | None,
    timings: dict[str, float],
    t0: float,
    node_id: str | None = None,
) -> Rollout:
    timings["total_s"] = time.monotonic() - t0
    scored = reward is not None and reward.error is None and status != "infra_error"
    cause = reward.cause if reward is not None and scored else None
    return Rollout(
        rollout_id=rollout_id,
        group_id=group_id,
        task_id=task.task_id,
        harness=harness.name,
        status=status,
        reward=reward.value if scored and reward is not None else None,
        reward_parts=dict(reward.parts) if reward is not None else {},
        error=error if error is not None or cause is None else cause,
        trace=trace or Trace(session_id="", rollout_id=rollout_id),
        timings_s=timings,
        final_answer=result.final_answer if result is not None else None,
        metadata={
            "exit_code": result.exit_code if result is not None else None,
            "log_tail": (result.log_tail[-2000:] if result is not None else ""),
            **({"node_id": node_id} if node_id is not None else {}),
            **({"failure_cause": cause} if cause is not None else {}),
        },
    )


def _describe(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"

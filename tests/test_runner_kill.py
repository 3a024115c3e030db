"""A sandbox whose processes survive SIGKILL ends one rollout, not the run; the rollout status
table (one terminal status per rollout, DESIGN.md §3.3) on a fake sandbox.

On the fake sandbox of `tests/fakes.py` (every method recorded; `kill_processes` raises as
`LocalSandbox` does when pids survive): the rollout is `infra_error` with the cause, the verifier never runs (hidden
tests never meet a live agent), the proxy session is closed and the sandbox closed; the next
rollout on a healthy sandbox runs normally.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harnessrl.harness.base import HarnessResult
from harnessrl.rewards.base import Reward
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint, Trace
from fakes import FakeBackend as Backend
from fakes import FakeSandbox, ScriptedVerifier


class Sessions:
    def __init__(self) -> None:
        self.open: set[str] = set()

    def open_session(self, rollout_id: str, group: str | None = None) -> tuple[str, str]:
        self.open.add(rollout_id)
        return rollout_id, "k-" + rollout_id

    def endpoint(self, key: str) -> Endpoint:
        return Endpoint(base_url="http://127.0.0.1:9/v1", api_key=key, model="m")

    def close_session(self, session_id: str) -> Trace:
        self.open.discard(session_id)
        return Trace(session_id=session_id, rollout_id=session_id)


class Harness:
    name = "fake"

    async def run(self, task: Task, sandbox: FakeSandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        return HarnessResult(exit_code=0, timed_out=False, final_answer="42", log_tail="done")


class Verifier:
    def __init__(self) -> None:
        self.scored: list[str] = []

    async def score(self, task: Task, sandbox: FakeSandbox, final_answer: str | None) -> Reward:
        self.scored.append(task.task_id)
        return Reward(value=1.0)


def test_a_failed_kill_is_this_rollouts_infra_error_and_the_next_one_runs(tmp_path: Path) -> None:
    backend, sessions, verifier = Backend(tmp_path, [True, False]), Sessions(), Verifier()
    task = Task("t/0", "test", "do it")

    async def both() -> list:
        out = []
        for rid in ("r-bad", "r-good"):
            out.append(await run_rollout(task, 0, Harness(), backend, sessions, verifier,
                                         RolloutLimits(agent_timeout_s=5), rollout_id=rid))
        return out

    bad, good = asyncio.run(both())
    assert bad.status == "infra_error"
    assert "survived" in (bad.error or "") and "4242" in (bad.error or "")
    assert bad.reward is None and "verify_s" not in bad.timings_s
    assert bad.final_answer == "42" and bad.metadata["log_tail"] == "done"
    assert backend.made[0].calls == ["kill_processes", "close"], "verified or not released"
    assert good.status == "ok" and good.reward == 1.0
    assert verifier.scored == ["t/0"], "the verifier ran on the rollout whose kill failed"
    assert sessions.open == set()


class ScriptedHarness:
    name = "scripted"

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome

    async def run(self, task: Task, sandbox: FakeSandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        match self.outcome:
            case "crash":
                raise RuntimeError("harness bug")
            case "timeout":
                return HarnessResult(exit_code=None, timed_out=True)
            case "agent_error":
                return HarnessResult(exit_code=1, timed_out=False, error="agent exited with code 1")
        return HarnessResult(exit_code=0, timed_out=False, final_answer="42")


# (harness outcome, kill fails, verifier fails) -> (status, verified)
STATUS_TABLE = [
    (("ok", False, False), ("ok", True)),
    (("agent_error", False, False), ("agent_error", True)),
    (("timeout", False, False), ("timeout", True)),
    (("timeout", False, True), ("verifier_error", True)),
    (("crash", False, False), ("infra_error", False)),
    (("ok", True, False), ("infra_error", False)),
    (("timeout", True, True), ("infra_error", False)),
]


@pytest.mark.parametrize(("case", "expected"), STATUS_TABLE)
def test_status_table_on_the_fake_sandbox(tmp_path: Path, case: tuple, expected: tuple) -> None:
    outcome, kill_fails, verifier_fails = case
    backend, sessions, verifier = Backend(tmp_path, [kill_fails]), Sessions(), ScriptedVerifier(verifier_fails)
    rollout = asyncio.run(run_rollout(Task("t/0", "test", "x"), 0, ScriptedHarness(outcome), backend, sessions,
                                      verifier, RolloutLimits(agent_timeout_s=5), rollout_id="r"))
    status, verified = expected
    assert rollout.status == status, rollout.error
    assert verifier.scored == int(verified)
    assert (rollout.reward is not None) == (status in ("ok", "agent_error", "timeout"))
    assert backend.made[0].calls[-1] == "close" and sessions.open == set()


def test_a_huge_final_answer_is_recorded_cut_and_scored_whole(tmp_path: Path) -> None:
    """Attack: an 8 MiB final answer, a 74 MB rollout row with the traces. The rollout records
    its first `max_final_answer_chars` characters and a marker saying it was cut; the verifier
    scores the whole answer."""
    from harnessrl.rollout.runner import ANSWER_CUT_MARK

    answer = "a" * (8 * 1024 * 1024)
    seen: list[int] = []

    class Huge(Harness):
        async def run(self, task: Task, sandbox: FakeSandbox, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
            return HarnessResult(exit_code=0, timed_out=False, final_answer=answer)

    class Measuring(Verifier):
        async def score(self, task: Task, sandbox: FakeSandbox, final_answer: str | None) -> Reward:
            seen.append(len(final_answer or ""))
            return Reward(value=1.0)

    rollout = asyncio.run(run_rollout(Task("t/0", "test", "do it"), 0, Huge(), Backend(tmp_path, [False]), Sessions(),
                                      Measuring(), RolloutLimits(agent_timeout_s=5, max_final_answer_chars=1000)))
    assert rollout.final_answer == "a" * 1000 + ANSWER_CUT_MARK.format(n=len(answer))
    assert rollout.final_answer.endswith("…[final answer cut: 8388608 characters in all]")
    assert seen == [len(answer)] and rollout.reward == 1.0
    short = asyncio.run(run_rollout(Task("t/0", "test", "do it"), 0, Harness(), Backend(tmp_path, [False]), Sessions(),
                                    Verifier(), RolloutLimits(agent_timeout_s=5, max_final_answer_chars=2)))
    assert short.final_answer == "42"  # at the bound: recorded whole

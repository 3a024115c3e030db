"""Summary numbers: pass@k against hand-computed values, statuses, rewards."""

from __future__ import annotations

import pytest

from harnessrl.rollout.summary import pass_at_k, rollout_line, summarize_groups
from harnessrl.types import Group, Rollout, Trace, Turn


def _rollout(i: int, reward: float | None, status: str = "ok") -> Rollout:
    turn = Turn(turn_index=0, request={}, prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.1, -0.2])
    return Rollout(rollout_id=f"r{i}", group_id=0, task_id="t", harness="h", status=status,
                   reward=reward, trace=Trace(session_id=f"s{i}", turns=[turn]),
                   timings_s={"agent_s": 2.0, "total_s": 3.0})


def test_pass_at_k_hand_computed() -> None:
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=0: never passes
    assert pass_at_k(4, 0, 4) == 0.0
    # n=4, c=3, k=2: n-c=1 < k -> 1.0
    assert pass_at_k(4, 3, 2) == 1.0
    # n=5, c=2, k=1: 1 - 3/5 = 0.4 = c/n
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_summarize_groups_counts_and_rewards() -> None:
    g0 = Group(group_id=0, task_id="a", rollouts=[_rollout(0, 1.0), _rollout(1, 0.0), _rollout(2, None, "infra_error")])
    g1 = Group(group_id=1, task_id="b", rollouts=[_rollout(3, 0.5), _rollout(4, 0.0), _rollout(5, 1.0, "timeout")])
    s = summarize_groups([g0, g1])
    assert s["rollouts"] == 6 and s["tasks"] == 2
    assert s["scored"] == 5 and s["errors"] == 1
    assert s["error_rate"] == pytest.approx(1 / 6)
    assert s["pass_rate"] == pytest.approx(2 / 5), "pass rate is over scored rollouts"
    # rewards 1, 0, 0.5, 0, 1: mean 0.5, population var = (0.25+0.25+0+0.25+0.25)/5 = 0.2
    assert s["reward/verifier_mean"] == pytest.approx(0.5)
    assert s["reward/verifier_std"] == pytest.approx(0.2 ** 0.5)
    # task a: n=2 scored, c=1; task b: n=3, c=1. pass@1 = (1/2 + 1/3)/2;
    # pass@2 = (1 + (1 - C(2,2)/C(3,2)))/2 = (1 + 2/3)/2; k stops at the smallest n (2)
    assert s["pass@1"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert s["pass@2"] == pytest.approx((1 + 2 / 3) / 2)
    assert "pass@3" not in s
    assert s["status/ok"] == 4 and s["status/infra_error"] == 1 and s["status/timeout"] == 1
    assert s["prompt_tokens"] == 18 and s["completion_tokens"] == 12


def test_turns_passing_mean_is_over_passing_scored_rollouts_only() -> None:
    def with_turns(i: int, reward: float | None, turns: int, status: str = "ok") -> Rollout:
        r = _rollout(i, reward, status)
        return r.model_copy(update={"trace": Trace(session_id=f"s{i}", turns=r.trace.turns * turns)})

    g = Group(group_id=0, task_id="a", rollouts=[
        with_turns(0, 1.0, 2), with_turns(1, 1.0, 3), with_turns(2, 0.0, 1), with_turns(3, 1.0, 5, "agent_error")])
    s = summarize_groups([g])
    assert s["turns_passing_mean"] == pytest.approx(2.5)  # the errored 5-turn rollout is not scored
    assert s["turns_mean"] == pytest.approx(11 / 4)
    assert "turns_passing_mean" not in summarize_groups([Group(group_id=1, task_id="b", rollouts=[_rollout(4, 0.0)])])


def test_agent_errors_are_counted_apart_from_scores() -> None:
    # an agent that crashed still gets a reward from its (empty) workspace; it is an error, not a 0
    g = Group(group_id=0, task_id="a", rollouts=[
        _rollout(0, 1.0), _rollout(1, 0.0, "agent_error"), _rollout(2, 0.0, "agent_error"),
        _rollout(3, None, "verifier_error")])
    s = summarize_groups([g])
    assert s["scored"] == 1 and s["errors"] == 3 and s["error_rate"] == pytest.approx(0.75)
    assert s["pass_rate"] == 1.0 and s["reward/verifier_mean"] == 1.0 and s["pass@1"] == 1.0
    only_errors = summarize_groups([Group(group_id=1, task_id="b", rollouts=[_rollout(4, 0.0, "agent_error")])])
    assert only_errors["error_rate"] == 1.0 and only_errors["scored"] == 0
    assert "pass_rate" not in only_errors and "reward/verifier_mean" not in only_errors and "pass@1" not in only_errors


def test_rollout_line_is_short_and_readable() -> None:
    ok = _rollout(0, 1.0)
    assert rollout_line(ok) == "t ok reward 1.00 turns 1 tok 3+2 3.0s"
    bad = _rollout(1, None, "infra_error").model_copy(
        update={"error": "harness x raised: OpenAIException - Connection error.\n" + "trace " * 100})
    line = rollout_line(bad, error_chars=40)
    assert line.startswith("t infra_error reward - turns 1 tok 3+2 3.0s error: harness x raised: OpenAIExcept")
    assert "\n" not in line and line.endswith("…") and len(line) < 120


def test_action_format_credit_hand_computed() -> None:
    from harnessrl.recipes.shaping import FORMAT_BONUS, action_format_credit
    from harnessrl.hooks import outcome_of

    def turn(i: int, content: str) -> Turn:
        return Turn(turn_index=i, request={}, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.5],
                    response={"choices": [{"message": {"role": "assistant", "content": content}}]})

    good = "THOUGHT: look\n```mswea_bash_command\nls\n```"
    two = good + "\n```bash\npwd\n```"
    r = _rollout(0, 0.0).model_copy(update={"trace": Trace(session_id="s", turns=[turn(0, good), turn(1, "no action"), turn(2, two), turn(3, good)])})
    # 2 of 4 replies hold exactly one action block: 0 + 0.3 * 0.5 * (1 - 0) = 0.15
    assert action_format_credit(outcome_of(r)) == pytest.approx(FORMAT_BONUS * 0.5)
    solved = r.model_copy(update={"reward": 1.0})
    assert action_format_credit(outcome_of(solved)) == 1.0
    assert action_format_credit(outcome_of(r.model_copy(update={"reward": None}))) is None


def test_phase_means_cover_only_the_rollouts_that_reached_the_phase() -> None:
    a, b, c = _rollout(0, 1.0), _rollout(1, 0.0), _rollout(2, None, "infra_error")
    a.timings_s.update(sandbox_s=0.2, verify_s=1.0)
    b.timings_s.update(sandbox_s=0.4, verify_s=3.0)
    c.timings_s.update(sandbox_s=0.6)  # its sandbox came up, it never reached the verifier
    s = summarize_groups([Group(group_id=0, task_id="a", rollouts=[a, b, c])])
    assert s["sandbox_s_mean"] == pytest.approx(0.4) and s["verify_s_mean"] == pytest.approx(2.0)
    assert "verify_s_mean" not in summarize_groups([Group(group_id=0, task_id="a", rollouts=[_rollout(3, 0.0)])])


def test_total_s_max_is_the_slowest_rollout_of_the_groups() -> None:
    """A step waits for its slowest rollout: `total_s_max` is that one's seconds, across groups."""
    a, b, c = _rollout(0, 1.0), _rollout(1, 0.0), _rollout(2, None, "infra_error")
    a.timings_s["total_s"], b.timings_s["total_s"], c.timings_s["total_s"] = 2.5, 9.4, 4.0
    s = summarize_groups([Group(group_id=0, task_id="a", rollouts=[a]), Group(group_id=1, task_id="b", rollouts=[b, c])])
    assert s["total_s_max"] == pytest.approx(9.4)
    assert s["total_s_mean"] == pytest.approx((2.5 + 9.4 + 4.0) / 3)

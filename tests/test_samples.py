"""Samples builder: CLEAN / REALIGN / FORK merging, exclusions, auxiliary calls, hooks."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from harnessrl.errors import ConfigError
from harnessrl.hooks import has_tool_call, load_hook, outcome_of
from harnessrl.train.samples import MergeStats, build_rows, common_prefix_len, find_parents
from harnessrl.types import Rollout, Trace, Turn

SYSTEM = list(range(1000, 1040))  # the agent's 40-token system prompt
TASK = [7, 8, 9]


def _turn(
    index: int,
    prompt: list[int],
    completion: list[int],
    *,
    status: str = "ok",
    version: int | None = None,
    request_kind: str | None = None,
    response: dict[str, Any] | None = None,
) -> Turn:
    return Turn(
        turn_index=index,
        request={},
        response=response,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[-0.01 * (index + 1)] * len(completion),
        policy_version=index if version is None else version,
        status=status,  # type: ignore[arg-type]
        request_kind=request_kind,
    )


def _rollout(turns: list[Turn], status: str = "ok", reward: float | None = 1.0) -> Rollout:
    return Rollout(
        rollout_id="ro-1", group_id=5, task_id="t", harness="h", status=status,  # type: ignore[arg-type]
        reward=reward, trace=Trace(session_id="s", turns=turns),
    )


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([5], [6]) == 0
    assert common_prefix_len([], [1]) == 0
    a = list(range(10_000))
    b = a[:7321] + [-1] + a[7322:]
    assert common_prefix_len(a, b) == 7321


def test_clean_merge_appends_prompt_tail_as_context_and_completion_as_trained() -> None:
    p0 = SYSTEM + TASK
    t0 = _turn(0, p0, [10, 11])
    t1 = _turn(1, p0 + [10, 11, 20, 21], [30], version=4)
    (row,), stats = build_rows(_rollout([t0, t1]))
    assert row.input_ids == tuple(p0 + [10, 11, 20, 21, 30])
    assert row.completion_mask == tuple([0] * 43 + [1, 1, 0, 0, 1])
    assert row.sampler_logprobs == tuple([0.0] * 43 + [-0.01, -0.01, 0.0, 0.0, -0.02])
    assert row.policy_versions == tuple([-1] * 43 + [0, 0, -1, -1, 4])
    assert (row.rollout_id, row.group_id, row.advantage) == ("ro-1", 5, 0.0)
    assert (stats.num_clean, stats.num_realign, stats.num_fork) == (1, 0, 0)
    assert stats.tokens_trained == 3 and stats.tokens_total == 48 and stats.num_rows == 1


def test_divergence_inside_a_trained_completion_ends_the_row_and_forks() -> None:
    p0 = SYSTEM + TASK
    t0 = _turn(0, p0, [10, 11, 12])
    # the agent re-rendered the answer: diverges at its 2nd token (11 -> 99); a REALIGN would
    # untrain 11, 12, so the row ends at turn 0 and turn 1 starts a new one
    t1 = _turn(1, p0 + [10, 99, 20], [30])
    rows, stats = build_rows(_rollout([t0, t1]))
    assert (stats.num_clean, stats.num_realign, stats.num_fork) == (0, 0, 1)
    assert rows[0].input_ids == tuple(p0 + [10, 11, 12]) and rows[0].completion_mask[43:] == (1, 1, 1)
    assert rows[1].input_ids == tuple(p0 + [10, 99, 20, 30]) and rows[1].completion_mask[43:] == (0, 0, 0, 1)
    assert stats.tokens_trained == 4 == stats.main_sampled_tokens and stats.untrained_sampled_tokens == 0
    # the row metadata says where: turn 1's prompt leaves turn 0's ids at position 44 (11 -> 99)
    assert rows[0].divergences == () and rows[1].divergences == ((1, 44),)


def test_realign_only_overwrites_context() -> None:
    p0 = SYSTEM + TASK
    t0 = _turn(0, p0, [10, 11, 12])
    t1 = _turn(1, p0 + [10, 11, 12, 20], [30, 31])  # kept as context by the hook
    t2 = _turn(2, p0 + [10, 11, 12, 20, 30, 99, 21], [40])  # diverges inside t1's completion
    (row,), stats = build_rows(_rollout([t0, t1, t2]), train_turn_fn=lambda t: t.turn_index != 1)
    assert (stats.num_clean, stats.num_realign, stats.num_fork) == (1, 1, 0)
    assert row.input_ids == tuple(p0 + [10, 11, 12, 20, 30, 99, 21, 40])
    assert row.completion_mask[43:] == (1, 1, 1, 0, 0, 0, 0, 1)
    assert stats.untrained_sampled_tokens == 0 and stats.main_sampled_tokens == 4
    assert row.divergences == ((2, 48),), "turn 2 overwrites from position 48 (31 -> 99)"


def test_history_rewrite_before_last_completion_forks() -> None:
    p0 = SYSTEM + TASK
    t0 = _turn(0, p0, [10, 11])
    t1 = _turn(1, p0 + [10, 11, 20], [30])
    # the agent dropped turn 0's answer from the history (divergence before the last completion)
    t2 = _turn(2, p0 + [10, 11, 20, 30, 40], [50])  # clean continuation of t1
    t3 = _turn(3, p0 + [20, 30, 40, 50, 60], [70])  # continues t0's prompt but rewrites history
    rows, stats = build_rows(_rollout([t0, t1, t2, t3]))
    assert (stats.num_clean, stats.num_realign, stats.num_fork) == (2, 0, 1)
    assert [sum(r.completion_mask) for r in rows] == [4, 1]
    assert rows[1].input_ids == tuple(p0 + [20, 30, 40, 50, 60, 70])
    assert rows[1].divergences == ((3, 43),), "turn 3 rewrites the history right after the task prompt"


def test_error_and_unfaithful_turns_never_train_and_are_counted() -> None:
    p0 = SYSTEM + TASK
    bad_lp = _turn(1, p0 + [10, 11, 20], [30])
    bad_lp.completion_logprobs = [0.5]  # a positive logprob: fails check_turn_faithful
    turns = [
        _turn(0, p0, [10, 11]),
        bad_lp,
        _turn(2, p0 + [10, 11, 20, 30, 21], [], status="error"),
        _turn(3, p0 + [10, 11, 20, 31], [40], status="unfaithful"),
    ]
    (row,), stats = build_rows(_rollout(turns))
    assert row.input_ids == tuple(p0 + [10, 11])
    assert stats.excluded == Counter({"error": 1, "unfaithful": 2})
    assert stats.as_metrics()["samples/excluded/unfaithful"] == 2.0


def _random_trace(seed: int) -> tuple[list[Turn], int]:
    """A 20-turn trace mixing clean continuations, re-rendered answers and history rewrites."""
    rng = random.Random(seed)
    context = SYSTEM + TASK
    turns: list[Turn] = []
    total_completion = 0
    for i in range(20):
        completion = [rng.randrange(100, 50_000) for _ in range(rng.randint(1, 30))]
        turns.append(_turn(i, list(context), completion))
        total_completion += len(completion)
        kind = rng.random()
        if kind < 0.6:  # clean
            context = context + completion
        elif kind < 0.85:  # re-rendered answer (realign or fork by threshold)
            cut = rng.randint(0, len(completion) - 1)
            context = context + completion[:cut] + [rng.randrange(100, 50_000)]
        else:  # history rewritten after the system prompt
            context = SYSTEM + TASK + [rng.randrange(100, 50_000) for _ in range(5)]
        context = context + [rng.randrange(100, 50_000) for _ in range(rng.randint(1, 20))]
    return turns, total_completion


@pytest.mark.parametrize("seed", range(12))
def test_every_sampled_token_trains_exactly_once(seed: int) -> None:
    turns, total = _random_trace(seed)
    rows, stats = build_rows(_rollout(turns))
    trained_per_version: Counter[int] = Counter()
    for row in rows:
        assert sum(row.completion_mask) > 0
        for t, m in enumerate(row.completion_mask):
            if m:
                v = row.policy_versions[t]
                trained_per_version[v] += 1
                assert row.sampler_logprobs[t] == pytest.approx(-0.01 * (v + 1))
            else:
                assert row.sampler_logprobs[t] == 0.0 and row.policy_versions[t] == -1
    for v, n in trained_per_version.items():
        assert n == len(turns[v].completion_ids)
    assert len(trained_per_version) == len(turns)
    # accounting identity: nothing trains twice, nothing vanishes
    assert stats.tokens_trained == total == stats.main_sampled_tokens
    assert stats.untrained_sampled_tokens == 0
    assert stats.num_clean + stats.num_realign + stats.num_fork == 19


def test_title_call_in_parallel_with_turn_one_is_auxiliary() -> None:
    p0 = SYSTEM + TASK
    title_prompt = list(range(2000, 2030)) + TASK  # its own system prompt, same user text
    turns = [
        _turn(0, p0, [10, 11]),
        _turn(1, title_prompt, [90, 91]),  # title generation, arrives while the agent works
        _turn(2, p0 + [10, 11, 20], [30]),
    ]
    (row,), stats = build_rows(_rollout(turns))
    assert row.input_ids == tuple(p0 + [10, 11, 20, 30])
    assert stats.num_auxiliary == 1 and stats.num_clean == 1 and stats.num_fork == 0
    rows, stats = build_rows(_rollout(turns), train_auxiliary=True)
    assert len(rows) == 2 and rows[1].input_ids == tuple(title_prompt + [90, 91])


def test_labelled_auxiliary_call_after_the_last_turn_does_not_become_final() -> None:
    p0 = SYSTEM + TASK
    turns = [
        _turn(0, p0, [10, 11]),
        _turn(1, p0 + [10, 11, 20], [30]),
        _turn(2, list(range(2000, 2030)), [90], request_kind="title"),
    ]
    (row,), stats = build_rows(_rollout(turns))
    assert row.input_ids == tuple(p0 + [10, 11, 20, 30]) and stats.num_auxiliary == 1


def test_compaction_mid_run_keeps_the_continued_session_main() -> None:
    p0 = SYSTEM + TASK
    history = p0 + [10, 11, 20, 30, 21]
    summary_prompt = list(range(3000, 3040)) + [10, 11, 20, 30, 21]  # summariser's own system
    p3 = SYSTEM + TASK + [91, 92]  # restarted session: system + task + summary
    turns = [
        _turn(0, p0, [10, 11]),
        _turn(1, p0 + [10, 11, 20], [30]),
        _turn(2, summary_prompt, [91, 92]),  # the compaction call
        _turn(3, p3, [40]),
        _turn(4, p3 + [40, 22], [50]),
    ]
    rows, stats = build_rows(_rollout(turns))
    assert [r.input_ids for r in rows] == [tuple(p0 + [10, 11, 20, 30]), tuple(p3 + [40, 22, 50])]
    assert stats.num_auxiliary == 1
    assert (stats.num_clean, stats.num_realign, stats.num_fork) == (2, 0, 1)
    assert history[:len(p0)] == p0


def test_compaction_appended_to_history_is_auxiliary_when_labelled() -> None:
    p0 = SYSTEM + TASK
    turns = [
        _turn(0, p0, [10, 11]),
        _turn(1, p0 + [10, 11, 20], [30]),
        _turn(2, p0 + [10, 11, 20, 30, 99], [91, 92], request_kind="compaction"),
        _turn(3, p0 + [91, 92], [40]),  # continues turn 0's prompt with the history replaced
    ]
    rows, stats = build_rows(_rollout(turns))
    assert stats.num_auxiliary == 1
    assert (stats.num_clean, stats.num_realign, stats.num_fork) == (1, 0, 1)
    # an unknown label leaves the agent's own turns trainable
    relabelled = [t.model_copy(update={"request_kind": "user_turn"}) for t in (turns[0], turns[1], turns[3])]
    _, stats_unknown = build_rows(_rollout(relabelled))
    assert stats_unknown.num_auxiliary == 0
    assert [r.input_ids for r in rows] == [tuple(p0 + [10, 11, 20, 30]), tuple(p0 + [91, 92, 40])]
    assert rows[1].completion_mask == tuple([0] * (len(p0) + 2) + [1])  # the summary is context


def test_retries_train_once() -> None:
    p0 = SYSTEM + TASK
    turns = [
        _turn(0, p0, [10, 11]),  # the agent timed out on this one and retried
        _turn(1, p0, [12, 13, 14]),
        _turn(2, p0 + [12, 13, 14, 20], [30]),
    ]
    (row,), stats = build_rows(_rollout(turns))
    assert row.input_ids == tuple(p0 + [12, 13, 14, 20, 30])
    assert stats.excluded["retry_superseded"] == 1 and stats.tokens_trained == 4
    # an identical duplicate trains once
    dup = [_turn(0, p0, [10, 11]), _turn(1, p0, [10, 11]), _turn(2, p0 + [10, 11, 20], [30])]
    (row,), stats = build_rows(_rollout(dup))
    assert sum(row.completion_mask) == 3 and stats.excluded["retry_superseded"] == 1
    # a retry after an upstream error: the error turn is excluded as such
    err = [_turn(0, p0, [], status="error"), _turn(1, p0, [10, 11])]
    (row,), stats = build_rows(_rollout(err))
    assert stats.excluded == Counter({"error": 1}) and sum(row.completion_mask) == 2


def test_parents_pick_the_longest_extended_turn() -> None:
    p0 = SYSTEM + TASK
    turns = [
        _turn(0, p0, [10, 11]),
        _turn(1, list(range(2000, 2010)), [5]),
        _turn(2, p0 + [10, 11, 20], [30]),
        _turn(3, p0 + [10, 11, 20, 30, 21], [31]),
    ]
    assert find_parents(turns) == [None, None, 0, 2]


def test_train_turn_fn_keeps_rejected_turns_as_context() -> None:
    p0 = SYSTEM + TASK
    tool_response = {"choices": [{"message": {"tool_calls": [{"function": {"name": "bash"}}]}}]}
    turns = [
        _turn(0, p0, [10, 11]),  # no tool call: rejected, stays as context
        _turn(1, p0 + [10, 11, 20], [30], response=tool_response),
    ]
    (row,), stats = build_rows(_rollout(turns), train_turn_fn=has_tool_call)
    assert row.completion_mask == tuple([0] * (len(p0) + 3) + [1])
    assert stats.num_rejected_by_hook == 1 and stats.num_clean == 1
    rows, stats = build_rows(_rollout(turns), train_turn_fn=lambda t: False)
    assert rows == [] and stats.num_dropped_rows == 1 and stats.tokens_trained == 0


def test_agent_turn_fn_replaces_the_structural_rule() -> None:
    p0 = SYSTEM + TASK
    turns = [_turn(0, p0, [10, 11]), _turn(1, list(range(2000, 2050)), [90]), _turn(2, p0 + [10, 11, 20], [30])]
    rows, stats = build_rows(_rollout(turns), agent_turn_fn=lambda ts: [t for t in ts if t.turn_index == 1])
    assert [r.input_ids for r in rows] == [tuple(range(2000, 2050)) + (90,)]
    assert stats.num_auxiliary == 2


def test_merge_stats_merge_and_metrics() -> None:
    a = MergeStats(num_clean=3, num_fork=1, tokens_trained=10, excluded=Counter({"error": 1}))
    b = MergeStats(num_clean=1, num_realign=4, tokens_trained=5, excluded=Counter({"error": 2, "unfaithful": 1}))
    m = a.merge(b)
    assert (m.num_clean, m.num_realign, m.num_fork, m.tokens_trained) == (4, 4, 1, 15)
    assert m.excluded == Counter({"error": 3, "unfaithful": 1})
    assert m.fractions() == {"clean": 4 / 9, "realign": 4 / 9, "fork": 1 / 9}
    metrics = m.as_metrics()
    assert metrics["samples/frac_fork"] == pytest.approx(1 / 9) and metrics["samples/excluded/error"] == 3.0


def _bridged(turn: Turn, source: int) -> Turn:
    return turn.model_copy(update={"notes": [f"bridged_from={source}"]})


def _multi_turn_rollouts() -> list[Rollout]:
    """Two rollouts of known turns: A has six agent turns (completions of 2, 3, 1, 4, 5, 6
    ids), a title call and an error turn; its 2nd and 5th prompts are bridged, its 4th rewrites
    history (FORK); B has one turn of 7 ids."""
    p0 = SYSTEM + TASK
    t0 = _turn(0, p0, [10, 11])
    title = _turn(1, list(range(3000, 3040)), [90, 91], request_kind="title")
    t1 = _bridged(_turn(2, p0 + [10, 11, 20], [30, 31, 32]), 0)
    t2 = _turn(3, p0 + [10, 11, 20, 30, 31, 32, 21], [40])  # CLEAN, rendered (no bridge)
    err = _turn(4, p0 + [10, 11, 20, 30, 31, 32, 21, 40, 22], [], status="error")
    t3 = _turn(5, p0 + [12, 50], [60, 61, 62, 63])  # drops turn 0's reply: FORK
    t4 = _bridged(_turn(6, p0 + [12, 50, 60, 61, 62, 63, 23], [70, 71, 72, 73, 74]), 5)
    t5 = _turn(7, p0 + [12, 50, 60, 61, 62, 63, 23, 70, 71, 72, 73, 74, 24], [80, 81, 82, 83, 84, 85])
    a = _rollout([t0, title, t1, t2, err, t3, t4, t5])
    b = _rollout([_turn(0, p0, [1, 2, 3, 4, 5, 6, 7])]).model_copy(update={"rollout_id": "ro-2"})
    return [a, b]


def test_multi_turn_accounting_rows_bridged_share_and_trained_tokens_by_turn() -> None:
    a, b = _multi_turn_rollouts()
    rows_a, stats_a = build_rows(a)
    assert len(rows_a) == 2 and stats_a.num_auxiliary == 1
    assert (stats_a.num_clean, stats_a.num_realign, stats_a.num_fork, stats_a.num_bridged) == (4, 0, 1, 2)
    assert stats_a.trained_by_turn == Counter({1: 2, 2: 3, 3: 1, 4: 4 + 5 + 6})
    stats = stats_a.merge(build_rows(b)[1])
    assert stats.num_rollouts == 2 and stats.num_rows == 3 and stats.rows_per_rollout() == 1.5
    assert stats.fractions() == {"clean": 0.8, "realign": 0.0, "fork": 0.2}
    assert stats.frac_bridged() == 0.4
    assert stats.turn_shares() == {"turn_1": 9 / 28, "turn_2": 3 / 28, "turn_3": 1 / 28, "turn_4plus": 15 / 28}
    assert stats.untrained_sampled_tokens == 0 and stats.tokens_trained == 28
    metrics = stats.as_metrics()
    assert metrics["samples/rows_per_rollout"] == 1.5 and metrics["samples/frac_bridged"] == 0.4
    assert metrics["samples/trained_token_share/turn_4plus"] == 15 / 28
    assert metrics["samples/num_rollouts"] == 2.0 and metrics["samples/num_bridged"] == 2.0
    # a turn the hook keeps as context keeps its position; later turns stay where they were
    _, hooked = build_rows(a, train_turn_fn=lambda t: t.turn_index != 3)
    assert hooked.trained_by_turn == Counter({1: 2, 2: 3, 4: 15}) and hooked.untrained_sampled_tokens == 0
    # the title call trains with train_auxiliary, in no turn bucket
    _, aux = build_rows(a, train_auxiliary=True)
    assert aux.tokens_trained == 23 and sum(aux.trained_by_turn.values()) == 21


def test_turn_accounting_of_nothing_is_zeros() -> None:
    stats = MergeStats()
    assert stats.rows_per_rollout() == 0.0 and stats.frac_bridged() == 0.0
    assert stats.turn_shares() == {"turn_1": 0.0, "turn_2": 0.0, "turn_3": 0.0, "turn_4plus": 0.0}
    # a bridged turn that does not merge CLEAN (here it forks) is not counted as bridged
    p0 = SYSTEM + TASK
    turns = [_turn(0, p0, [10, 11]), _bridged(_turn(1, p0 + [10, 99, 20], [30]), 0)]
    _, forked = build_rows(_rollout(turns))
    assert (forked.num_fork, forked.num_bridged, forked.num_rows) == (1, 0, 2)


def test_load_hook_by_dotted_path_and_clear_errors() -> None:
    assert load_hook("harnessrl.hooks:has_tool_call") is has_tool_call
    assert load_hook("harnessrl.hooks.has_tool_call") is has_tool_call
    with pytest.raises(ConfigError, match="no_such_pkg.mod:fn"):
        load_hook("no_such_pkg.mod:fn")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_hook("harnessrl.hooks:nope")
    with pytest.raises(ConfigError, match="not a callable"):
        load_hook("harnessrl.train.samples:MergeKind.__doc__")
    with pytest.raises(ConfigError, match="'justaname'"):
        load_hook("justaname")


def test_outcome_counts_tool_calls_from_responses_and_tolerates_failures() -> None:
    def resp(*names: str) -> dict[str, Any]:
        return {"choices": [{"message": {"content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": n, "arguments": "{}"}} for n in names]}}]}

    turns = [
        _turn(0, [1], [2], response=resp("bash", "read")),
        _turn(1, [1], [2], response=resp("bash")),
        _turn(2, [1], [2], response={"choices": []}),
        _turn(3, [1], [2], response={"choices": [{"message": None}]}),
        _turn(4, [1], [2], response={"choices": [{"message": {"tool_calls": None}}]}),
        _turn(5, [1], [], status="error", response=resp("bash")),
    ]
    outcome = outcome_of(_rollout(turns, status="timeout", reward=None))
    assert outcome.tool_calls_by_name == {"bash": 2, "read": 1}
    assert outcome.num_turns == 5 and outcome.timed_out and outcome.reward is None


def test_step_metrics_log_merge_fractions_and_untrained_sampled_tokens() -> None:
    from harnessrl.hooks import Hooks
    from harnessrl.loss.advantages import advantage_fn_for
    from harnessrl.train.rows import rows_for_step
    from harnessrl.types import Group

    p0 = SYSTEM + TASK
    clean = [_turn(0, p0, [10, 11]), _turn(1, p0 + [10, 11, 20], [30])]
    forked = [_turn(0, p0, [10, 11]), _turn(1, p0 + [10, 99, 20], [30])]  # diverges inside the reply
    rollouts = [_rollout(clean, reward=1.0).model_copy(update={"rollout_id": "a"}),
                _rollout(forked, reward=0.0).model_copy(update={"rollout_id": "b"})]
    step = rows_for_step([Group(group_id=5, task_id="t", rollouts=rollouts)], hooks=Hooks(),
                         advantage_fn=advantage_fn_for("grpo"), version=0, max_staleness=1)
    rows, metrics = step.rows, step.metrics
    assert metrics["samples/frac_clean"] == 0.5 and metrics["samples/frac_fork"] == 0.5
    assert metrics["samples/frac_realign"] == 0.0
    assert metrics["untrained_sampled_tokens"] == 0.0 == metrics["samples/untrained_sampled_tokens"]
    assert metrics["samples/main_sampled_tokens"] == 6.0
    assert sum(sum(r.completion_mask) for r in rows) == 6  # every sampled token in exactly one row
    assert metrics["samples/rows_per_rollout"] == 1.5  # the clean rollout one row, the forked two
    assert metrics["samples/frac_bridged"] == 0.0  # no turn notes bridged_from
    shares = {k: v for k, v in metrics.items() if k.startswith("samples/trained_token_share/")}
    assert shares == {"samples/trained_token_share/turn_1": 4 / 6, "samples/trained_token_share/turn_2": 2 / 6,
                      "samples/trained_token_share/turn_3": 0.0, "samples/trained_token_share/turn_4plus": 0.0}

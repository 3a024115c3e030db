"""Group-relative advantages: hand-computed values, unscored rollouts, zero-variance groups."""

from __future__ import annotations

import math

import pytest

from harnessrl.errors import ConfigError
from harnessrl.loss.advantages import (
    advantage_fn_for,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    stamp_advantage,
)
from harnessrl.types import Row


def test_grpo_uses_population_std() -> None:
    # r = [1, 0, 0, 1]: mean 0.5, population var = 4 * 0.25 / 4 = 0.25, std 0.5
    # A = (r - 0.5) / (0.5 + 1e-6) = +-0.999998
    out = grpo_advantages([1.0, 0.0, 0.0, 1.0])
    expected = 0.5 / (0.5 + 1e-6)
    assert out.advantages_G == pytest.approx((expected, -expected, -expected, expected), abs=1e-12)
    assert not out.zero_variance and out.num_scored == 4


def test_grpo_three_values() -> None:
    # r = [0, 1, 2]: mean 1, population var (1 + 0 + 1) / 3 = 2/3, std 0.816496...
    # A = [-1, 0, 1] / (0.8164966 + 1e-6)
    std = math.sqrt(2 / 3)
    out = grpo_advantages([0.0, 1.0, 2.0])
    assert out.advantages_G == pytest.approx((-1 / (std + 1e-6), 0.0, 1 / (std + 1e-6)), abs=1e-12)


def test_dr_grpo_is_mean_centred_only() -> None:
    # r = [0, 1, 2, 5]: mean 2 -> A = [-2, -1, 0, 3]
    assert dr_grpo_advantages([0.0, 1.0, 2.0, 5.0]).advantages_G == (-2.0, -1.0, 0.0, 3.0)


def test_rloo_leave_one_out() -> None:
    # r = [0, 1, 2, 5], sum 8, n 4: A_i = r_i - (8 - r_i) / 3
    # -> [0 - 8/3, 1 - 7/3, 2 - 6/3, 5 - 3/3] = [-2.6667, -1.3333, 0, 4]
    out = rloo_advantages([0.0, 1.0, 2.0, 5.0])
    assert out.advantages_G == pytest.approx((-8 / 3, -4 / 3, 0.0, 4.0), abs=1e-12)
    # identity: RLOO = n/(n-1) * Dr.GRPO
    assert out.advantages_G == pytest.approx(tuple(4 / 3 * a for a in (-2.0, -1.0, 0.0, 3.0)), abs=1e-12)


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_unscored_rollouts_are_excluded_from_baseline_and_get_none(fn) -> None:
    with_none = fn([1.0, None, 0.0, None, 2.0])
    without = fn([1.0, 0.0, 2.0])
    assert with_none.advantages_G[1] is None and with_none.advantages_G[3] is None
    assert [a for a in with_none.advantages_G if a is not None] == pytest.approx(list(without.advantages_G))
    assert with_none.num_scored == 3


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_zero_variance_group_gives_zero_and_is_flagged(fn) -> None:
    out = fn([0.7, 0.7, None, 0.7])
    assert out.advantages_G == (0.0, 0.0, None, 0.0)
    assert out.zero_variance
    single = fn([None, 1.0])
    assert single.advantages_G == (None, 0.0) and single.zero_variance
    empty = fn([None, None])
    assert empty.advantages_G == (None, None) and not empty.zero_variance and empty.num_scored == 0


def test_non_finite_reward_is_rejected() -> None:
    with pytest.raises(ValueError, match="nan"):
        grpo_advantages([1.0, float("nan")])


def test_advantage_fn_for_and_stamp() -> None:
    assert advantage_fn_for("rloo") is rloo_advantages
    with pytest.raises(ConfigError, match="'ppo'"):
        advantage_fn_for("ppo")
    row = Row((1, 2), (0, 1), (0.0, -0.5), (-1, 0), "r", 3)
    (stamped,) = stamp_advantage([row], 0.25)
    assert stamped.advantage == 0.25 and stamped.input_ids == row.input_ids and row.advantage == 0.0

"""Off-policy diagnostics by staleness (`loss/diagnostics.py`), the console's warning lines, and
the trainer's one forward per micro-batch under the decoupled objective."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harnessrl.loss.diagnostics import OffPolicyStats, staleness_of
from harnessrl.loss.losses import PpoClipLoss, loss_fn_for
from harnessrl.train.console import offpolicy_warnings
from harnessrl.train.policy import load_policy
from harnessrl.train.step import optimizer_step
from harnessrl.types import Row
from fakes import opposed_rows

torch.set_num_threads(1)


def test_staleness_is_the_trainer_version_minus_the_token_version() -> None:
    versions = torch.tensor([-1, 3, 2, 0])
    assert staleness_of(versions, 3).tolist() == [-1, 0, 1, 3]
    assert staleness_of(versions, None) is None


def test_stats_on_a_constructed_batch_by_staleness() -> None:
    # staleness 0: w = [1, 1]; staleness 1: w = [2, 0.5]; one context token (mask 0)
    prox = torch.tensor([-1.0, -2.0, -1.0, -1.0, -5.0])
    sampler = prox - torch.log(torch.tensor([1.0, 1.0, 2.0, 0.5, 9.0]))
    mask = torch.tensor([True, True, True, True, False])
    stale = staleness_of(torch.tensor([4, 4, 3, 3, -1]), 4)
    clipped = torch.tensor([False, True, False, False, False])
    bounded = torch.tensor([False, False, True, True, False])
    stats = OffPolicyStats()
    # two micro-batches, as the step adds them
    stats.add(prox[:2], sampler[:2], mask[:2], stale[:2], clipped[:2], bounded[:2])
    stats.add(prox[2:], sampler[2:], mask[2:], stale[2:], clipped[2:], bounded[2:])
    m = stats.metrics()
    # totals: w = [1, 1, 2, .5]: mean 1.125, ESS = 4.5^2 / (4 * 6.25) = 0.81
    assert m["offpolicy/tokens"] == 4
    assert m["offpolicy/is_weight_mean"] == pytest.approx(1.125, abs=1e-6)
    assert m["offpolicy/is_weight_max"] == pytest.approx(2.0, abs=1e-6)
    assert m["offpolicy/is_weight_ess"] == pytest.approx(0.81, abs=1e-6)
    assert m["offpolicy/clip_frac"] == 0.25 and m["offpolicy/bounded_frac"] == 0.5
    # staleness 0 (the precision gap alone): none here
    assert m["offpolicy/s0/tokens"] == 2 and m["offpolicy/s0/mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["offpolicy/s0/is_weight_ess"] == pytest.approx(1.0, abs=1e-6)
    assert m["offpolicy/s0/clip_frac"] == 0.5 and m["offpolicy/s0/bounded_frac"] == 0.0
    # staleness 1: k3 = (2 - 1 - ln 2 + .5 - 1 + ln 2) / 2 = 0.25; ESS = 2.5^2 / (2 * 4.25)
    assert m["offpolicy/s1/mismatch_kl"] == pytest.approx(0.25, abs=1e-6)
    assert m["offpolicy/s1/abs_logprob_diff"] == pytest.approx(math.log(2), abs=1e-6)
    assert m["offpolicy/s1/is_weight_ess"] == pytest.approx(6.25 / 8.5, abs=1e-6)
    assert m["offpolicy/s1/bounded_frac"] == 1.0
    assert m["offpolicy/lag/tokens"] == 2 and m["offpolicy/lag/mismatch_kl"] == m["offpolicy/s1/mismatch_kl"]
    assert "offpolicy/s2/tokens" not in m


def test_unknown_staleness_counts_in_the_totals_only() -> None:
    stats = OffPolicyStats()
    stats.add(torch.tensor([-1.0]), torch.tensor([-1.0 - math.log(3.0)]), torch.tensor([True]), None)
    m = stats.metrics()
    assert m["offpolicy/tokens"] == 1 and m["offpolicy/is_weight_mean"] == pytest.approx(3.0, abs=1e-5)
    assert not any(k.startswith(("offpolicy/s0/", "offpolicy/lag/")) for k in m)
    assert OffPolicyStats().metrics() == {}


def _metrics(kl0: float, ess0: float, mean0: float, kl1: float, ess1: float, mean1: float) -> dict[str, float]:
    return {"offpolicy/s0/tokens": 10.0, "offpolicy/s0/mismatch_kl": kl0, "offpolicy/s0/is_weight_ess": ess0,
            "offpolicy/s0/is_weight_mean": mean0, "offpolicy/lag/tokens": 10.0, "offpolicy/lag/mismatch_kl": kl1,
            "offpolicy/lag/is_weight_ess": ess1, "offpolicy/lag/is_weight_mean": mean1}


def test_warnings_name_the_precision_gap_or_the_lag() -> None:
    assert offpolicy_warnings(_metrics(0.01, 0.9, 1.0, 0.02, 0.8, 1.1)) == []
    lines = offpolicy_warnings(_metrics(0.01, 0.9, 1.0, 0.3, 0.2, 1.1))
    assert len(lines) == 1 and "policy lag" in lines[0]
    assert "mismatch KL 0.300 > 0.1" in lines[0] and "ESS 0.20 < 0.3" in lines[0]
    lines = offpolicy_warnings(_metrics(0.01, 0.9, 2.5, 0.01, 0.9, 1.0))
    assert len(lines) == 1 and "precision gap" in lines[0] and "mean weight 2.50 outside [0.5, 2.0]" in lines[0]
    total = {"offpolicy/tokens": 3.0, "offpolicy/mismatch_kl": 0.5, "offpolicy/is_weight_ess": 0.9,
             "offpolicy/is_weight_mean": 1.0}
    assert offpolicy_warnings(total) == ["off-policy: sampler/trainer mismatch (mismatch KL 0.500 > 0.1)"]


def _stale_rows() -> list[Row]:
    """`opposed_rows` with the second row's tokens sampled one version earlier (version 0 vs 1)."""
    a, b = opposed_rows()
    vers = tuple(-1 if v < 0 else 1 for v in a.policy_versions)
    return [Row(a.input_ids, a.completion_mask, a.sampler_logprobs, vers, a.rollout_id, 0, 1.0), b]


@pytest.mark.parametrize("clip_center", ["proximal", "behaviour"])
def test_one_forward_per_micro_batch_and_the_step_reports_by_staleness(tiny_model_dir: Path,
                                                                      clip_center: str) -> None:
    """The trainer takes one optimizer step per batch, so the proximal policy is the current
    weights: the decoupled loss adds no forward pass (counted on the model's forward)."""
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    forwards = []
    handle = policy.model.register_forward_hook(lambda *_: forwards.append(1))
    steps = []
    original = policy.optimizer.step
    policy.optimizer.step = lambda *a, **k: (steps.append(1), original(*a, **k))[1]  # type: ignore[method-assign]
    m = optimizer_step(policy.model, policy.optimizer, _stale_rows(), loss_fn_for(PpoClipLoss(clip_center=clip_center)),
                       temperature=1.0, token_budget=40, max_grad_norm=1.0, policy_version=1).metrics
    handle.remove()
    assert m["micro_batches"] == 2 and len(forwards) == 2 and len(steps) == 1
    assert m["offpolicy/s0/tokens"] == 10 and m["offpolicy/s1/tokens"] == 10 and m["offpolicy/lag/tokens"] == 10
    assert m["offpolicy/tokens"] == 20 and 0 < m["offpolicy/is_weight_ess"] <= 1
    # the tiny random model is far from the recorded logprob -2: the weights say so
    assert m["offpolicy/is_weight_mean"] != pytest.approx(1.0, abs=1e-3)

"""`train.lr_schedule`: the factors equal transformers' schedules, and a training step uses them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.train.schedule import lr_factor


@pytest.mark.parametrize("schedule, warmup", [("linear", 0), ("linear", 3), ("cosine", 0), ("cosine", 2)])
def test_factors_equal_transformers_schedules(schedule: str, warmup: int) -> None:
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    total = 11
    make = get_linear_schedule_with_warmup if schedule == "linear" else get_cosine_schedule_with_warmup
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt, num_warmup_steps=warmup, num_training_steps=total)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [lr_factor(schedule, k, total, warmup) for k in range(total)]
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert ours[-1] < ours[warmup] and ours[-1] > 0


def test_constant_and_bad_values() -> None:
    assert [lr_factor("constant", k, 5) for k in range(5)] == [1.0] * 5
    assert [lr_factor("constant", k, 5, warmup=2) for k in range(3)] == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor("step", 0, 5)
    with pytest.raises(ValueError, match="total >= 1"):
        lr_factor("linear", 0, 0)


def test_trainer_step_uses_the_scheduled_rate(tiny_model_dir: Path) -> None:
    from harnessrl.config import load_config, trainer_settings
    from harnessrl.train.trainer_group import TrainerGroup
    from harnessrl.types import Row

    cfg = load_config(None, ["train.learning_rate=1e-3", "train.lr_schedule=\"linear\"", "train.steps=4",
                             "train.token_budget=96"])
    group = TrainerGroup(trainer_settings(cfg))
    group.load(tiny_model_dir)
    ids = tuple(100 + 7 * t for t in range(24))
    row = Row(ids, tuple([0] * 16 + [1] * 8), tuple([0.0] * 16 + [-3.0] * 8), tuple([-1] * 16 + [0] * 8),
              "r0", 0, 1.0)
    lrs = []
    for step in (1, 2, 4):
        lrs.append(group.step([row], step).metrics["lr"])
        assert group.update_norm() > 0  # the update's size, measured after the step
        assert group.update_norm() is None  # once per step
    assert lrs == pytest.approx([1e-3, 0.75e-3, 0.25e-3])
    before = {k: v.clone() for k, v in group.policy.model.state_dict().items()}
    assert group.step([row]).metrics["lr"] == pytest.approx(0.25e-3)  # no step: the rate stays
    assert any(not torch.equal(before[k], v) for k, v in group.policy.model.state_dict().items())

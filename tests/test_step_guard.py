"""The optimizer step guards against non-finite gradients, and NaN weights never leave the trainer.

A NaN or inf gradient (injected with a tensor hook on one parameter, as a NaN loss or an
overflow would produce) skips the update: weights and optimizer state are bit-identical
afterwards, the step says `skipped_nonfinite`; the next finite step trains normally. Weights
holding a NaN are refused by `export_weights` (the engine push) and `save_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.loss.losses import loss_fn_for
from harnessrl.engine.weight_sync import NonFiniteWeightsError, check_finite
from harnessrl.train.policy import (
    export_weights,
    latest_checkpoint,
    load_policy,
    save_checkpoint,
)
from harnessrl.train.step import StepResult, optimizer_step
from fakes import opposed_rows

torch.set_num_threads(1)


def _result(policy) -> StepResult:  # noqa: ANN001
    return optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"),
                          temperature=1.0, token_budget=256, max_grad_norm=1.0)


def _step(policy) -> dict:  # noqa: ANN001
    return _result(policy).metrics


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_gradient_skips_the_update(tiny_model_dir: Path, poison: float) -> None:
    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=0.0, lora_rank=0)
    before = export_weights(policy, copy=True)
    param = next(p for p in policy.model.parameters() if p.requires_grad)
    handle = param.register_hook(lambda g: g * poison)
    result = _result(policy)
    handle.remove()
    m = result.metrics
    assert (result.applied, result.nonfinite) == (False, True)
    assert m["skipped"] == 1.0 and m["skipped_nonfinite"] == 1.0
    assert "non-finite gradient norm" in m["skip_reason"]
    assert m["tokens_trained"] == 20
    after = export_weights(policy)  # also checks every weight is finite
    assert all(torch.equal(after[k], before[k]) for k in before), "weights changed on a skipped step"
    assert policy.optimizer.state_dict()["state"] == {}, "optimizer state advanced on a skipped step"
    assert all(p.grad is None for p in policy.model.parameters())
    # the next, finite step trains
    second = _result(policy)
    m2 = second.metrics
    assert (second.applied, second.nonfinite) == (True, False)
    assert "skipped" not in m2 and m2["grad_norm"] > 0
    moved = export_weights(policy)
    assert any(not torch.equal(moved[k], before[k]) for k in before)


def test_an_error_before_the_update_leaves_the_weights_untouched(tiny_model_dir: Path) -> None:
    """`before_update` (the loop's wait for the last canary verdict) runs after the gradients and
    before the update; what it raises propagates, weights and optimizer state as they were."""
    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=0.0, lora_rank=0)
    before = export_weights(policy, copy=True)
    calls: list[bool] = []

    def refuse() -> None:
        calls.append(all(p.grad is not None for p in policy.model.parameters() if p.requires_grad))
        raise RuntimeError("verdict failed")

    with pytest.raises(RuntimeError, match="verdict failed"):
        optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"), temperature=1.0,
                       token_budget=256, max_grad_norm=1.0, before_update=refuse)
    assert calls == [True], "called once, with the gradients computed"
    after = export_weights(policy)
    assert all(torch.equal(after[k], before[k]) for k in before), "weights changed after before_update raised"
    assert policy.optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in policy.model.parameters())
    passed: list[int] = []
    m = optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"), temperature=1.0,
                       token_budget=256, max_grad_norm=1.0, before_update=lambda: passed.append(1)).metrics
    assert passed == [1] and "skipped" not in m
    moved = export_weights(policy)
    assert any(not torch.equal(moved[k], before[k]) for k in before)


def test_non_finite_weights_are_not_exported_or_saved(
    tiny_model_dir: Path, tmp_path: Path, tokenizer: object
) -> None:
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    name, param = next((n, p) for n, p in policy.model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match="NaN/inf"):
        export_weights(policy)
    with pytest.raises(NonFiniteWeightsError):
        save_checkpoint(policy, tokenizer, tmp_path / "checkpoints" / "step-1",
                        {"step": 1, "policy_version": 1, "next_group_id": 1})
    assert latest_checkpoint(tmp_path) is None
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_check_finite_is_exact_when_a_finite_tensor_sums_to_inf() -> None:

    big = torch.full((4,), 3e38)  # every entry finite; the sum overflows to inf
    check_finite({"big": big, "ok": torch.ones(3)})
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.ones(5)
        t[2] = bad
        with pytest.raises(NonFiniteWeightsError, match="'t'"):
            check_finite({"ok": torch.ones(2), "t": t})

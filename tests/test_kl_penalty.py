"""`train.loss.kl_coef` does something: the k3 penalty to the frozen initial weights changes the
gradient once the policy has moved, and at kl_coef = 0 the gradient is the KL-free one, bit for
bit. With LoRA the reference is the base with adapters disabled; with full fine-tuning a frozen copy."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from harnessrl.loss.config import PpoClipLoss
from harnessrl.loss.losses import loss_fn_for
from harnessrl.train.packing import compute_trainer_logprobs, loss_inputs, pack_rows
from harnessrl.train.policy import load_policy, reference_logprobs
from harnessrl.train.step import optimizer_step
from fakes import opposed_rows


def _grads(policy, kl_coef: float, with_reference: bool) -> list[torch.Tensor]:
    policy.model.zero_grad(set_to_none=True)
    batches = pack_rows(opposed_rows(), 256)
    n = sum(b.num_trained_tokens for b in batches)
    fn = loss_fn_for(PpoClipLoss(kl_coef=kl_coef))
    for batch in batches:
        lp = compute_trainer_logprobs(policy.model, batch, 1.0)
        ref = reference_logprobs(policy, batch, 1.0) if with_reference else None
        fn(loss_inputs(batch, lp, n, ref)).loss.backward()
    return [p.grad.clone() for p in policy.model.parameters() if p.requires_grad and p.grad is not None]


def _move(policy) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_kl_changes_the_gradient_and_zero_is_kl_free(tiny_model_dir: Path, lora_rank: int) -> None:
    if lora_rank:
        pytest.importorskip("peft")
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=lora_rank, reference=True)
    assert (policy.reference is None) == bool(lora_rank), "LoRA keeps no copy: the base is the reference"
    _move(policy)  # the policy leaves the reference (at the reference itself the k3 gradient is 0)
    free = _grads(policy, 0.0, with_reference=False)
    zero = _grads(policy, 0.0, with_reference=True)
    kl = _grads(policy, 0.5, with_reference=True)
    assert all(torch.equal(a, b) for a, b in zip(free, zero)), "kl_coef = 0: bit-identical to no KL"
    diff = sum(float((a - b).abs().sum()) for a, b in zip(free, kl))
    assert diff > 1e-6, "kl_coef > 0 changes the gradient"


def test_reference_stays_the_initial_weights_and_kl_is_reported(tiny_model_dir: Path) -> None:
    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=0.0, lora_rank=0, reference=True)
    initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
    ref = partial(reference_logprobs, policy, temperature=1.0)
    fn = loss_fn_for(PpoClipLoss(kl_coef=0.1))
    first = optimizer_step(policy.model, policy.optimizer, opposed_rows(), fn, temperature=1.0, token_budget=256,
                           max_grad_norm=1.0, reference=ref).metrics
    assert first["kl"] == pytest.approx(0.0, abs=1e-6), "step 1: policy == reference"
    second = optimizer_step(policy.model, policy.optimizer, opposed_rows(), fn, temperature=1.0, token_budget=256,
                            max_grad_norm=1.0, reference=ref).metrics
    assert second["kl"] > 0, "after one update the policy has left the reference"
    for name, tensor in policy.reference.state_dict().items():
        assert torch.equal(tensor, initial[name]), name
    assert not any(p.requires_grad for p in policy.reference.parameters())


def test_kl_without_a_reference_fails_at_the_step(tiny_model_dir: Path) -> None:
    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=0.0, lora_rank=0)
    with pytest.raises(ValueError, match="needs ref_logprobs_T"):
        optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for(PpoClipLoss(kl_coef=0.1)),
                       temperature=1.0, token_budget=256, max_grad_norm=1.0)

"""The trained policy: LoRA weights export under the base names and load into the engine;
checkpoints restore weights, optimizer state and the run position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.loss.losses import loss_fn_for
from harnessrl.train.policy import export_weights, latest_checkpoint, load_policy, restore_checkpoint, save_checkpoint
from harnessrl.train.step import optimizer_step
from fakes import opposed_rows


def test_lora_step_exports_merged_base_weights_the_engine_accepts(tiny_model_dir: Path) -> None:
    pytest.importorskip("peft")
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=0.0, lora_rank=4)
    before = export_weights(policy, copy=True)
    m = optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"),
                       temperature=1.0, token_budget=256, max_grad_norm=1.0).metrics
    assert m["tokens_trained"] == 20
    after = export_weights(policy)
    assert set(after) == set(before) and not any("lora_" in k or "base_layer" in k for k in after)
    # only the LoRA-adapted linear layers move; embeddings are frozen
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed and all("proj" in k for k in changed), changed
    with EmbeddedEngine(tiny_model_dir, num_threads=1) as engine:
        engine.load_weights(after, 1)
        assert engine.policy_version == 1


def test_checkpoint_round_trip(tiny_model_dir: Path, tmp_path: Path, tokenizer: object) -> None:
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"),
                   temperature=1.0, token_budget=256, max_grad_norm=1.0)
    save_checkpoint(policy, tokenizer, tmp_path / "checkpoints" / "step-1", {"step": 1, "policy_version": 1, "next_group_id": 3})
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-1"
    fresh = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    state = restore_checkpoint(fresh, tmp_path / "checkpoints" / "step-1")
    assert state == {"step": 1, "policy_version": 1, "next_group_id": 3}
    for (k, a), b in zip(policy.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert fresh.optimizer.state_dict()["state"].keys() == policy.optimizer.state_dict()["state"].keys()

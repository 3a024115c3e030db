"""The WeightSync seam: the in-process sync makes the engine serve the trainer's weights as the
published version; `param_delta_l2` is the norm of the update itself (no weight copy kept)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from harnessrl.engine.config import EmbeddedEngineConfig
from harnessrl.engine.select import SyncSettings, make_weight_sync
from harnessrl.engine.weight_sync import InProcessWeightSync, WeightSync
from harnessrl.errors import ConfigError
from harnessrl.loss.losses import loss_fn_for
from harnessrl.train.policy import load_policy
from harnessrl.train.step import optimizer_step, update_l2
from fakes import opposed_rows


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _distance(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((p.detach() - before[k]).pow(2).sum()) for k, p in model.named_parameters()))


@pytest.mark.parametrize("chunk", [1 << 16, 7])  # 7: every parameter spans chunks, most end in a partial one
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_param_delta_l2_is_the_norm_of_the_update(tiny_model_dir: Path, weight_decay: float, chunk: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import harnessrl.train.step as step_mod

    monkeypatch.setattr(step_mod, "UPDATE_CHUNK", chunk)
    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=weight_decay, lora_rank=0)
    for _ in range(2):  # the second step has bias-corrected moments from two gradients
        before = _snapshot(policy.model)
        m = optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"),
                           temperature=1.0, token_budget=256, max_grad_norm=1.0).metrics
        want = _distance(policy.model, before)
        assert want > 0
        assert m["param_delta_l2"] == pytest.approx(want, rel=1e-4)


def test_update_measured_after_the_step_equals_the_weights_moved(tiny_model_dir: Path) -> None:
    """`measure_update=False` (the loop measures after the weight sync): the parameters it
    returns give `update_l2` the distance the weights moved, after `zero_grad` cleared them."""
    from harnessrl.train.step import update_l2

    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=0.1, lora_rank=0)
    for _ in range(2):
        before = _snapshot(policy.model)
        result = optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"),
                                temperature=1.0, token_budget=256, max_grad_norm=1.0, measure_update=False)
        assert "param_delta_l2" not in result.metrics and result.updated
        assert all(p.grad is None for p in policy.model.parameters())
        want = _distance(policy.model, before)
        assert want > 0 and update_l2(policy.optimizer, result.updated) == pytest.approx(want, rel=1e-4)
        assert update_l2(policy.optimizer) == 0.0  # without the list: no parameter has a gradient


def test_param_delta_l2_with_lora_is_the_adapters_update(tiny_model_dir: Path) -> None:
    pytest.importorskip("peft")
    policy = load_policy(tiny_model_dir, learning_rate=1e-2, weight_decay=0.0, lora_rank=4)
    before = _snapshot(policy.model)
    m = optimizer_step(policy.model, policy.optimizer, opposed_rows(), loss_fn_for("ppo_clip"),
                       temperature=1.0, token_budget=256, max_grad_norm=1.0).metrics
    want = _distance(policy.model, before)  # only the adapter matrices move
    assert want > 0 and m["param_delta_l2"] == pytest.approx(want, rel=1e-4)


def test_update_l2_rejects_other_optimizers() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="AdamW"):
        update_l2(torch.optim.SGD([p], lr=0.1))


def test_in_process_sync_serves_the_published_version(tiny_model_dir: Path) -> None:
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.types import Sampling

    policy = load_policy(tiny_model_dir, learning_rate=1e-1, weight_decay=0.0, lora_rank=0)
    greedy = Sampling(temperature=0.0, max_tokens=4)
    with EmbeddedEngine(tiny_model_dir, num_threads=1) as engine:
        sync = make_weight_sync(EmbeddedEngineConfig(), engine, SyncSettings(canary=False))
        assert isinstance(sync, WeightSync) and isinstance(sync, InProcessWeightSync)
        prompt = list(range(100, 120))
        first = engine.generate_blocking(prompt, greedy, timeout_s=60)
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p))
        report = sync.publish(policy, 1)
        assert report.version == 1 and engine.policy_version == 1
        n_params = sum(t.numel() for t in policy.model.state_dict().values())
        assert report.bytes == 4 * n_params, "fp32 weights, every tensor of the state dict"
        assert report.seconds > 0 and set(report.as_metrics()) == {"sync/seconds", "sync/bytes"}
        served = engine._model.state_dict()
        for name, tensor in policy.model.state_dict().items():
            assert torch.equal(served[name], tensor), name
        after = engine.generate_blocking(prompt, greedy, timeout_s=60)
        assert after.policy_version == 1 and first.policy_version == 0
        assert after.completion_logprobs != first.completion_logprobs


def test_unknown_engine_kind_has_no_sync() -> None:
    with pytest.raises(ConfigError, match="engine.kind='sglang'"):
        make_weight_sync(SimpleNamespace(kind="sglang", dtype="float32"), object())  # type: ignore[arg-type]

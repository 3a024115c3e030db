"""`train.autocast = "bfloat16"`: mixed precision in the trainer (forward under torch.autocast,
weights and optimizer state float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.errors import ConfigError
from harnessrl.loss.losses import loss_fn_for
from harnessrl.train.packing import compute_trainer_logprobs, pack_rows
from harnessrl.train.policy import load_policy
from harnessrl.train.step import autocast_context, optimizer_step, sampler_parity
from harnessrl.types import Row


def _faithful_rows(model: torch.nn.Module) -> list[Row]:
    """Rows whose sampler logprobs are the float32 model's own (as at step 0), opposite advantages."""
    ids = tuple(range(200, 248))
    mask = tuple([0] * 32 + [1] * 16)
    rows = []
    for k, (seq, adv) in enumerate(((ids, 1.0), (ids[::-1], -1.0))):
        probe = Row(seq, mask, tuple([0.0] * 48), tuple([-1] * 32 + [0] * 16), f"r{k}", 0, adv)
        with torch.no_grad():
            lp_T = compute_trainer_logprobs(model, pack_rows([probe], 256)[0], 1.0)
        lps = tuple(float(x) if m else 0.0 for x, m in zip(lp_T.tolist(), mask))
        rows.append(Row(seq, mask, lps, probe.policy_versions, f"r{k}", 0, adv))
    return rows


def test_autocast_logprobs_are_bf16_close_and_float32(tiny_model_dir: Path) -> None:
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    batch = pack_rows(_faithful_rows(policy.model), 256)[0]
    with torch.no_grad():
        full = compute_trainer_logprobs(policy.model, batch, 1.0)
        with autocast_context(policy.model, "bfloat16"):
            mixed = compute_trainer_logprobs(policy.model, batch, 1.0)
        with autocast_context(policy.model, "off"):
            same = compute_trainer_logprobs(policy.model, batch, 1.0)
    assert mixed.dtype == torch.float32
    assert torch.equal(same, full)
    diff = (mixed - full)[batch.mask_T].abs()
    assert 0 < float(diff.max()) < 0.1  # bfloat16 matmuls: different, but close


def test_autocast_step_keeps_float32_weights_and_moves_them(tiny_model_dir: Path) -> None:
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    rows = _faithful_rows(policy.model)
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    off = sampler_parity(policy.model, rows, temperature=1.0, token_budget=256)
    on = sampler_parity(policy.model, rows, temperature=1.0, token_budget=256, autocast="bfloat16")
    assert off is not None and on is not None and off < 1e-5 < on < 0.1
    m = optimizer_step(policy.model, policy.optimizer, rows, loss_fn_for("ppo_clip"), temperature=1.0,
                       token_budget=256, max_grad_norm=1.0, autocast="bfloat16").metrics
    assert not m.get("skipped") and m["grad_norm"] > 0
    assert m["ratio_abs_dev"] == pytest.approx(on, rel=1e-3)  # the step saw the bf16 logprobs
    for name, p in policy.model.named_parameters():
        assert p.dtype == torch.float32, name
    moved = sum(float((p.detach() - before[k]).abs().sum()) for k, p in policy.model.named_parameters())
    assert moved > 0
    for state in policy.optimizer.state.values():
        assert state["exp_avg"].dtype == torch.float32


def test_autocast_unknown_name_is_refused(tiny_model_dir: Path) -> None:
    from harnessrl.config import load_config

    with pytest.raises(ConfigError, match="autocast"):
        load_config(None, ['train.autocast="float16"'])
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    with pytest.raises(ValueError, match="float16"):
        autocast_context(policy.model, "float16")


@pytest.mark.parametrize("native", [False, True])
def test_bfloat16_on_a_cpu_without_it_warns(native: bool, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """bfloat16 settings on a CPU that emulates bfloat16 are named in a warning; float32 and a
    CPU with native bfloat16 get none."""
    import logging

    from harnessrl.config import load_config
    from harnessrl.train import step
    from harnessrl.train.setup import check_training

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert step.native_cpu_bfloat16() is native
    with caplog.at_level(logging.WARNING, logger="harnessrl.train.setup"):
        check_training(load_config(None, ['train.autocast="bfloat16"', 'engine.dtype="bfloat16"']))
        check_training(load_config(None, []))
    warned = [r.getMessage() for r in caplog.records if "native bfloat16" in r.getMessage()]
    if native:
        assert warned == []
    else:
        assert len(warned) == 1
        assert warned[0].startswith('train.autocast and engine.dtype = "bfloat16"')

"""The trained policy: loading (full or LoRA), the optimizer, weight export, checkpoints.

Responsibility: everything about the trainer's copy of the model that is not the loss: build it
from the same HF directory the engine serves, export full weights for the engine after each
step (LoRA adapters merged), keep the KL reference (the initial weights, frozen) and give its
logprobs, and save / restore checkpoints in HF `save_pretrained` format plus
`trainer_state.pt` (optimizer, step, policy version, data position).

`Policy` is the `WeightSource` the engine's weight syncs read (`engine/weight_sync.py`); the
check for NaN/inf weights (`check_finite`, `NonFiniteWeightsError`) is the seam's, imported here.

What it does not do: compute losses (`loss/losses.py`), move weights to the engine
(`engine/weight_sync.py`) or decide when to sync (`train/loop.py`).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harnessrl.engine.weight_sync import check_finite
from harnessrl.errors import ConfigError
from harnessrl.train.distributed import (
    SINGLE,
    Ranks,
    full_optimizer_state,
    full_state_dict,
    load_full_state,
    wrap_model,
)
from harnessrl.train.packing import compute_trainer_logprobs, pack_rows
from harnessrl.types import Row

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`train.dtype` names and their torch dtypes."""


@dataclass
class Policy:
    model: torch.nn.Module
    """The HF causal LM being trained (a peft model when `lora_rank > 0`)."""
    optimizer: torch.optim.Optimizer
    lora: bool
    reference: torch.nn.Module | None = None
    """Full fine-tuning with a KL penalty: a frozen copy of the initial weights (eval mode, no
    gradient). None otherwise (with LoRA the reference is the base with adapters disabled)."""
    has_reference: bool = False
    """Whether `reference_logprobs` may be called (`load_policy(reference=True)`)."""
    wrapped: torch.nn.Module | None = None
    """The module training forwards run on (`optimizer_step`): a `DistributedDataParallel`
    around `model` (ddp), `model` itself sharded in place (fsdp2), None on one process."""
    ranks: Ranks = SINGLE
    """The trainer's processes (`train/distributed.py`); one process by default."""

    @property
    def trained(self) -> torch.nn.Module:
        """The module to pass to `optimizer_step`: `wrapped` when distributed, else `model`."""
        return self.wrapped if self.wrapped is not None else self.model

    # the `WeightSource` a weight sync reads (engine/weight_sync.py)

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded over ranks (fsdp2)."""
        return self.ranks.sharded

    def export_weights(self) -> dict[str, torch.Tensor]:
        """`export_weights(self)`: full merged weights, detached (the live parameters of full
        fine-tuning).

        Raises:
            NonFiniteWeightsError: a weight is NaN or inf.
        """
        return export_weights(self)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors (state-dict names holding `lora_`); `{}` without LoRA."""
        return {k: v for k, v in self.model.state_dict().items() if "lora_" in k} if self.lora else {}

    def save_adapter(self, directory: Path) -> None:
        """The LoRA adapter in peft's format (`save_pretrained`) in `directory`."""
        self.model.save_pretrained(str(directory))

    def vocab_size(self) -> int:
        """Rows of the input embeddings."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def sequence_logprobs(self, ids: Sequence[int]) -> list[float]:
        """Logprobs at temperature 1 of `ids[1:]` given the ids before each (nats, len(ids) - 1
        floats), through `packing.compute_trainer_logprobs`, the loss's own path, in eval mode
        without gradient (under fsdp2 a collective forward every rank joins,
        `TrainerGroup.follow`)."""
        n = len(ids)
        row = Row(input_ids=tuple(ids), completion_mask=(0,) + (1,) * (n - 1), sampler_logprobs=(0.0,) * n,
                  policy_versions=(-1,) * n, rollout_id="canary", group_id=-1)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                (batch,) = pack_rows([row], token_budget=max(n, 64), share_prefixes=False)
                lp_T = compute_trainer_logprobs(self.model, batch, temperature=1.0)
        finally:
            self.model.train(was_training)
        return lp_T[1:].tolist()


def reference_logprobs(policy: Policy, packed: Any, temperature: float) -> torch.Tensor:
    """The reference policy's logprobs of `packed`'s trained tokens (float32 [T], no gradient):
    the initial weights, frozen. With LoRA the base model with its adapters disabled (no extra
    memory); with full fine-tuning the frozen copy `policy.reference`.

    Raises:
        ConfigError: the policy was loaded without a reference.
    """
    if not policy.has_reference:
        raise ConfigError("reference_logprobs: the policy was loaded without a reference (train.loss.kl_coef = 0)")
    with torch.no_grad():
        if policy.lora:
            with policy.model.disable_adapter():  # type: ignore[operator]
                return compute_trainer_logprobs(policy.model, packed, temperature)
        assert policy.reference is not None
        return compute_trainer_logprobs(policy.reference, packed, temperature)


def load_policy(model_dir: Path, *, learning_rate: float, weight_decay: float, lora_rank: int,
                reference: bool = False, dtype: str = "float32", ranks: Ranks = SINGLE) -> Policy:
    """Load the policy (train mode) in `dtype` (`DTYPES`) on `ranks.device` with AdamW
    (Loshchilov & Hutter 2019); with several ranks, wrapped per `ranks.strategy`
    (`distributed.wrap_model`; the optimizer is built on the wrapped, possibly sharded,
    parameters).

    `reference`: keep the initial weights as the KL reference (`reference_logprobs`). Free with
    LoRA (the frozen base is the reference); with full fine-tuning one more copy of the
    model (4 bytes per parameter in float32: 0.54 GB for 135M) kept frozen for the whole run,
    whole on every rank (not sharded).

    Raises:
        ConfigError: `lora_rank > 0` but peft is not installed; LoRA with `fsdp2`; an unknown
            `dtype`.
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers, heavy; not needed at import

    if dtype not in DTYPES:
        raise ConfigError(f"train.dtype={dtype!r} is not one of {sorted(DTYPES)}")
    if lora_rank > 0 and ranks.sharded:
        raise ConfigError("train.lora_rank > 0 with train.strategy='fsdp2' is not supported: use "
                          "train.strategy='ddp' (adapters are small; nothing to shard)")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).to(ranks.device)
    lora = lora_rank > 0
    if lora:
        try:
            from peft import LoraConfig, get_peft_model  # lazy: peft, heavy; not needed at import
        except ImportError as exc:
            raise ConfigError("train.lora_rank > 0 needs peft (pip install 'harnessrl[lora]')") from exc
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                 target_modules="all-linear", lora_dropout=0.0))
    frozen = None
    if reference and not lora:
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    wrapped = wrap_model(model, ranks) if ranks.distributed else None
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel over all parameters (on CPU ~3x faster than the per-tensor loop)
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=True)
    return Policy(model=model, optimizer=optimizer, lora=lora, reference=frozen, has_reference=reference,
                  wrapped=wrapped, ranks=ranks)


def export_weights(policy: Policy, copy: bool = False) -> dict[str, torch.Tensor]:
    """Full (merged) weights under the base model's parameter names, detached.

    Without `copy` the tensors of full fine-tuning are the live parameters: hand them only to
    a consumer that copies them before the next optimizer step (the in-process `WeightSync`,
    `EmbeddedEngine.load_weights`, does, synchronously). LoRA exports are always fresh tensors
    (adapters merged out of place: the live base weights are not touched).

    Sharded (fsdp2): the full weights are gathered to CPU on rank 0; every rank must call it
    (collective) and the others get `{}`.

    Raises:
        NonFiniteWeightsError: a weight is NaN or inf (never handed to the engine).
    """
    if policy.ranks.sharded:
        out = full_state_dict(policy.model, policy.ranks)
        if policy.ranks.is_main:
            check_finite(out)
        return out
    if not policy.lora:
        out = {k: (v.detach().clone() if copy else v.detach()) for k, v in policy.model.state_dict().items()}
        check_finite(out)
        return out
    out = _merged_lora_weights(policy.model)
    check_finite(out)
    return out


def _merged_lora_weights(peft_model: Any) -> dict[str, torch.Tensor]:
    """Base weights with the active LoRA deltas added, as fresh tensors under the base names.

    Plain LoRA linear layers (what `load_policy` makes) are merged out of place,
    `W + get_delta_weight()`, the value peft's in-place merge gives, so the live base weights
    are never touched (merging then unmerging in place leaves them off by rounding, and ranks
    that did not export would drift apart). Other adapter kinds go through peft's
    `merge_adapter` / `unmerge_adapter`.
    """
    from peft.tuners.lora import Linear as LoraLinear  # lazy: peft, heavy; not needed at import
    from peft.tuners.lora import LoraLayer  # lazy: peft, heavy; not needed at import

    base = peft_model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    plain = all(type(m) is LoraLinear and not m.lora_variant and not any(m.lora_bias.values())
                for m in layers.values())
    if not plain:
        peft_model.merge_adapter()
        try:
            return {key.replace(".base_layer", ""): value.detach().clone()
                    for key, value in base.state_dict().items() if "lora_" not in key}
        finally:
            peft_model.unmerge_adapter()
    out = {key.replace(".base_layer", ""): value.detach().clone()
           for key, value in base.state_dict().items() if "lora_" not in key}
    with torch.no_grad():
        for name, layer in layers.items():
            weight = out[f"{name}.weight"]
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A and not layer.merged:
                    weight += layer.get_delta_weight(adapter)
    return out


def save_checkpoint(policy: Policy, tokenizer: Any, directory: Path, state: dict[str, Any]) -> None:
    """Write `directory` (HF `save_pretrained` model + tokenizer, `trainer_state.pt`) atomically.

    Several ranks: rank 0 writes. Sharded (fsdp2): every rank must call it (the full weights
    and optimizer state are gathered on rank 0, collective); the optimizer state is then saved
    keyed by parameter names (`"optimizer_format": "full_state_dict"`). Other ranks return.

    Raises:
        NonFiniteWeightsError: a weight is NaN or inf (nothing is written).
    """
    ranks = policy.ranks
    full = full_state_dict(policy.model, ranks) if ranks.sharded else None
    optimizer_state = full_optimizer_state(policy.model, policy.optimizer, ranks) if ranks.sharded else None
    if not ranks.is_main:
        return
    check_finite(full if full is not None else dict(policy.model.state_dict()))

    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():  # left by a process killed while saving
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model: Any = policy.model
    if policy.lora:
        model.save_pretrained(str(tmp / "adapter"))
        merged = export_weights(policy)
        base = model.get_base_model()
        base.save_pretrained(str(tmp), state_dict=merged, safe_serialization=True)
    else:
        model.save_pretrained(str(tmp), state_dict=full, safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if optimizer_state is not None:
        torch.save({"optimizer": optimizer_state, "optimizer_format": "full_state_dict", **state}, tmp / STATE_FILE)
    else:
        torch.save({"optimizer": policy.optimizer.state_dict(), **state}, tmp / STATE_FILE)
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint directory (`step-<N>` holding its state file) with the highest
    step under `run_dir/checkpoints`, if any; a `step-<N>.tmp` left by a process killed while
    saving is ignored."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step-*") if re.fullmatch(r"step-\d+", p.name)
             and (p / STATE_FILE).exists() and (p / "state.json").exists()] if root.exists() else []
    return max(found, key=lambda p: int(p.name.split("-")[1])) if found else None


def restore_checkpoint(policy: Policy, directory: Path) -> dict[str, Any]:
    """Load weights and optimizer state from `directory`; returns the saved state dict
    (step, policy_version, next_group_id, ...). Several ranks: every rank calls it and reads
    the same files.

    Raises:
        ConfigError: the checkpoint's weights do not match the model, or its optimizer state
            was saved by a sharded (fsdp2) run and this one is not, or the reverse.
    """
    from safetensors.torch import load_file  # lazy: safetensors, heavy; not needed at import

    weights = load_file(str(directory / "model.safetensors"))
    model: Any = policy.model
    saved = torch.load(directory / STATE_FILE, weights_only=False)
    full_format = saved.pop("optimizer_format", None) == "full_state_dict"
    if full_format != policy.ranks.sharded:
        raise ConfigError(f"checkpoint {directory}: its optimizer state was saved "
                          f"{'sharded (train.strategy=fsdp2)' if full_format else 'unsharded'}; resume "
                          f"it with {'train.strategy=fsdp2 on several ranks' if full_format else 'ddp or one process'}")
    if policy.ranks.sharded:
        load_full_state(model, policy.optimizer, weights, saved.pop("optimizer"), policy.ranks)
        return saved
    if policy.lora:
        from peft import set_peft_model_state_dict  # lazy: peft, heavy; not needed at import
        from peft.utils import load_peft_weights  # lazy: peft, heavy; not needed at import

        set_peft_model_state_dict(model, load_peft_weights(str(directory / "adapter")))
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        real_missing = [k for k in missing if "lm_head" not in k]
        if real_missing or unexpected:
            raise ConfigError(f"checkpoint {directory} does not match the model: missing {real_missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
    policy.optimizer.load_state_dict(saved.pop("optimizer"))
    return saved

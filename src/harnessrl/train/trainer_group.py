"""The trainer on all ranks: rank 0 calls an operation, every rank runs it.

Responsibility: keep the trainer's processes in step. `harnessrl train` on rank 0 owns the
runtime and calls `TrainerGroup` methods (load, step, parity, publish, save, restore, stop) on
its trainer thread; a method that needs every rank first broadcasts a command `(name, args)`
from rank 0, and the other ranks, waiting in `follow()`, run the same operation, so their
collectives (gradient all-reduce, FSDP2 gathers, full-weight gathers) meet. A step's rows travel in its command
(`broadcast_object_list`); every rank then takes its share (`distributed.split_by_tokens`).

Operations that need no other rank are not broadcast: the sampler-parity check, the weight
export and the checkpoint of unsharded (ddp) weights run on rank 0 alone; under fsdp2 they are
collective. Nothing rank 0 does alone changes its weights (LoRA exports merge out of place), so
the ranks' weights stay bit-identical.

What the other ranks hold: the trainer's settings (`config.TrainerSettings`, from the same
command line), the
model directory (sent by rank 0 in `load`: one path every rank can read), the policy, its
optimizer, the loss and the KL reference. No proxy, engine, sandbox, file or console.

One process (`ranks.distributed` false): every method just runs the operation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harnessrl.engine.canary import policy_probe, probe_half
from harnessrl.loss.losses import loss_fn_for
from harnessrl.train.distributed import SINGLE, Ranks, broadcast_object, inner_module
from harnessrl.train.policy import (
    load_policy,
    reference_logprobs,
    restore_checkpoint,
    save_checkpoint,
)
from harnessrl.train.schedule import lr_factor
from harnessrl.train.step import optimizer_step, sampler_parity, update_norm

if TYPE_CHECKING:
    from harnessrl.config import TrainerSettings
    from harnessrl.engine.weight_sync import SyncReport, WeightSync
    from harnessrl.train.policy import Policy
    from harnessrl.train.step import StepResult
    from harnessrl.types import Row

log = logging.getLogger(__name__)


class TrainerGroup:
    """The policy and its training operations, on one or several ranks (module docstring).

    Rank 0 calls the public methods; other ranks call `follow()` and return from it when rank 0
    calls `stop()`. Methods are blocking and must be called from one thread per process.
    """

    def __init__(self, settings: TrainerSettings, ranks: Ranks = SINGLE) -> None:
        self.settings = settings
        self.ranks = ranks
        self.policy: Policy | None = None
        self._loss_fn = loss_fn_for(settings.loss)
        self._reference: Any = None
        self._updated: list[Any] | None = None  # the last step's updated parameters (update_norm)

    # --- operations (rank 0 calls them; the other ranks run them from `follow`)

    def load(self, model_dir: Path) -> Policy:
        """Load the policy from `model_dir` on every rank (`policy.load_policy`)."""
        self._send("load", str(model_dir))
        return self._load(str(model_dir))

    def step(self, rows: Sequence[Row], step: int | None = None,
             before_update: Callable[[], object] | None = None, policy_version: int | None = None) -> StepResult:
        """One optimizer step on `rows` across every rank (`step.optimizer_step`), at the
        learning rate of training step `step` (1-based; `train.lr_schedule`, `schedule.py`).
        `step=None` keeps the optimizer's current learning rate. `before_update` runs on rank 0
        after the gradients, before the weights change (`optimizer_step`'s; the loop passes the
        wait for the last publish's canary verdict there); an error from it ends the step with
        the weights untouched. `policy_version`: the version of the weights the trainer holds,
        for the diagnostics by staleness (`optimizer_step`'s)."""
        self._send("step", list(rows), step, None, policy_version)
        return self._step(list(rows), step, before_update, policy_version)

    def update_norm(self) -> float | None:
        """`param_delta_l2` of the last `step` (`step.update_l2`), measured after it so that the
        weight sync need not wait for it; None when that step updated nothing. Call it before
        the next `step` (collective under fsdp2)."""
        if self.ranks.sharded:
            self._send("update_norm")
        return self._update_norm()

    def parity(self, rows: Sequence[Row]) -> float | None:
        """`step.sampler_parity` on `rows` (collective under fsdp2, rank 0 alone otherwise)."""
        if self.ranks.sharded:
            self._send("parity", list(rows))
        return self._parity(list(rows))

    def publish(self, sync: WeightSync, version: int) -> SyncReport:
        """Publish the full weights through `sync` from rank 0 (under fsdp2 gathered from every
        rank: the other ranks call `policy.export_weights` once, a collective, so `sync.publish`
        must call it exactly once too; every `WeightSync` here does; with `train.sync_canary` they
        then join the canary's forward, `engine/canary.CanarySync`)."""
        if self.ranks.sharded:
            self._send("export")
        return sync.publish(self._policy(), version)

    def save(self, tokenizer: Any, directory: Path, state: dict[str, Any]) -> None:
        """Write a checkpoint from rank 0 (`policy.save_checkpoint`; collective under fsdp2)."""
        if self.ranks.sharded:
            self._send("save", str(directory), state)
        self._save(tokenizer, str(directory), state)

    def restore(self, directory: Path) -> dict[str, Any]:
        """Restore weights and optimizer state on every rank (`policy.restore_checkpoint`)."""
        self._send("restore", str(directory))
        return self._restore(str(directory))

    def stop(self) -> None:
        """Release the other ranks from `follow()` (no-op on one process)."""
        self._send("stop")

    # --- the other ranks

    def follow(self) -> None:
        """Run rank 0's commands until it sends `stop` (ranks other than 0).

        Raises:
            RuntimeError: called on rank 0, or an unknown command; a collective error when
                rank 0 dies (its connection closes).
        """
        if self.ranks.is_main:
            raise RuntimeError("TrainerGroup.follow runs on ranks other than 0")
        while True:
            name, args = broadcast_object(None, self.ranks)
            log.debug("rank %d: %s", self.ranks.rank, name)
            match name:
                case "stop":
                    return
                case "load":
                    self._load(*args)
                case "step":
                    self._step(*args)
                case "parity":
                    self._parity(*args)
                case "update_norm":
                    self._update_norm()
                case "export":
                    policy = self._policy()
                    policy.export_weights()
                    if self.ranks.sharded and self.settings.sync_canary:
                        # the canary's trainer forward after the publish (`CanarySync`): collective
                        half = probe_half(self.settings.dtype, self.settings.engine_dtype)
                        policy.sequence_logprobs(policy_probe(policy, half))
                case "save":
                    self._save(None, *args)
                case "restore":
                    self._restore(*args)
                case _:
                    raise RuntimeError(f"unknown trainer command {name!r} from rank 0")

    # --- what each operation does on every rank

    def _send(self, name: str, *args: Any) -> None:
        if self.ranks.distributed and self.ranks.is_main:
            broadcast_object((name, args), self.ranks)

    def _policy(self) -> Policy:
        if self.policy is None:
            raise RuntimeError("TrainerGroup: load() the policy first")
        return self.policy

    def _load(self, model_dir: str) -> Policy:
        t = self.settings
        self.policy = load_policy(Path(model_dir), learning_rate=t.learning_rate, weight_decay=t.weight_decay,
                                  lora_rank=t.lora_rank, reference=t.loss.kl_coef > 0, dtype=t.dtype,
                                  ranks=self.ranks)
        # KL penalty: the reference is the initial weights, frozen (before any checkpoint is
        # restored); its logprobs are computed per micro-batch on the trainer thread
        self._reference = (partial(reference_logprobs, self.policy, temperature=t.temperature)
                           if t.loss.kl_coef > 0 else None)
        return self.policy

    def _step(self, rows: list[Row], step: int | None = None,
              before_update: Callable[[], object] | None = None, policy_version: int | None = None) -> StepResult:
        policy, t = self._policy(), self.settings
        if step is not None:
            lr = t.learning_rate * lr_factor(t.lr_schedule, step - 1, t.steps, t.warmup_steps)
            for param_group in policy.optimizer.param_groups:
                param_group["lr"] = lr
        result = optimizer_step(policy.trained, policy.optimizer, rows, self._loss_fn,
                                temperature=t.temperature, token_budget=t.token_budget,
                                max_grad_norm=t.max_grad_norm, reference=self._reference, ranks=self.ranks,
                                measure_update=False, autocast=t.autocast, before_update=before_update,
                                policy_version=policy_version)
        self._updated = result.updated
        result.metrics["lr"] = float(policy.optimizer.param_groups[0]["lr"])
        return result

    def _update_norm(self) -> float | None:
        updated, self._updated = self._updated, None
        if updated is None:
            return None
        return update_norm(self._policy().optimizer, updated, self.ranks)

    def _parity(self, rows: list[Row]) -> float | None:
        policy = self._policy()
        # unsharded: the plain model (a DDP forward is not needed; rank 0 runs this alone)
        model = policy.trained if self.ranks.sharded else inner_module(policy.trained)
        t = self.settings
        return sampler_parity(model, rows, temperature=t.temperature, token_budget=t.token_budget,
                              autocast=t.autocast)

    def _save(self, tokenizer: Any, directory: str, state: dict[str, Any]) -> None:
        save_checkpoint(self._policy(), tokenizer, Path(directory), state)

    def _restore(self, directory: str) -> dict[str, Any]:
        return restore_checkpoint(self._policy(), Path(directory))

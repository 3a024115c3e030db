"""The `WeightSync` seam: publish the trainer's weights to the engine as a policy version.

Responsibility: move the weights of one optimizer step from the trainer to whatever serves
rollouts, and make the engine serve them as version `version`. The training loop calls
`publish(policy, version)` after each update and knows nothing of the transport; an engine
brings its own implementation (made by `engine/select.make_weight_sync`):

* `InProcessWeightSync` (the embedded engine): export the full weights (LoRA adapters merged)
  and copy them into the engine's model between two decode steps (`EmbeddedEngine.load_weights`,
  which blocks until the copy is done, so the live parameters may change right after).
* vLLM servers (`engine/vllm/sync.py`, picked by `engine.weight_sync`): safetensors in a shared
  directory the servers reload (`directory`), LoRA adapters loaded per version (`lora`), or
  full weights in memory through vLLM's weight-transfer API, over gloo on CPUs (`gloo`) or NCCL
  on GPU machines (`nccl`; `engine/vllm/transfer.py`).

What `publish` promises: when it returns, every request the engine admits from then on is
sampled from the published weights and reports `policy_version == version` on its
`Completion`; a request admitted before keeps the version it was admitted under (its tokens
after the swap come from the new weights; the staleness rule counts the older version).

The `policy_version` rule for a server that cannot report a version per request (e.g. an HTTP
server whose responses carry no weight version): the sync must make the version at admission
knowable by the engine adapter, one of:
  1) pause admission during a swap: stop sending new requests, wait for the in-flight ones to
     finish (or abort them), swap, set the adapter's version, resume; every response then
     belongs to the version current when its request was sent; or
  2) a version returned with each response: the server stamps the weight version it admitted
     the request under (a response header or field) and the adapter copies it to
     `Completion.policy_version`.
Guessing a version from wall-clock times is not allowed: a wrong version silently breaks the
staleness bound (DESIGN.md §1).

What it does not do: decide when to sync (the loop does, after each applied update) or
compute how far the weights moved (`train.step` measures the update itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from harnessrl.errors import HarnessRLError

if TYPE_CHECKING:
    import torch


class NonFiniteWeightsError(HarnessRLError):
    """The trainer's weights hold a NaN or inf: they are neither pushed to the engine nor saved."""


def check_finite(weights: dict[str, torch.Tensor]) -> None:
    """Raise `NonFiniteWeightsError` naming the first tensors (up to 3) holding a NaN or inf.

    Exact and cheap: a tensor whose sum is finite holds no NaN or inf (either would make the
    sum NaN or inf), which one reduction shows; only a tensor whose sum is not finite (a NaN or
    inf in it, or a finite overflow) is checked element by element. `isfinite(t).all()` on
    every tensor took 2-3 s per call on the 135M model (1 thread), the sums 0.2 s.
    """
    import torch  # lazy: torch, heavy; not needed at import

    bad = [name for name, t in weights.items()
           if t.is_floating_point() and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteWeightsError(
            f"trainer weights hold NaN/inf in {len(bad)} tensor(s), e.g. {bad[:3]}: not pushed to the "
            "engine, not saved; resume from the last checkpoint (lower train.learning_rate)")


class WeightSource(Protocol):
    """What a sync reads from the trainer: implemented by the trainer's policy
    (`train.policy.Policy`), so the engine side never imports the trainer."""

    @property
    def lora(self) -> bool:
        """Whether the policy trains LoRA adapters (`train.lora_rank > 0`)."""
        ...

    @property
    def sharded(self) -> bool:
        """Whether its weights are sharded over ranks (fsdp2): `export_weights` and
        `sequence_logprobs` are then collectives every rank joins."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights (LoRA merged) under the base model's parameter names, detached; `{}`
        on a rank other than 0 when sharded.

        Raises:
            NonFiniteWeightsError: a weight is NaN or inf.
        """
        ...

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors (names holding `lora_`); `{}` without LoRA."""
        ...

    def save_adapter(self, directory: Path) -> None:
        """Write the LoRA adapter in peft's format (`adapter_config.json`,
        `adapter_model.safetensors`) into `directory`."""
        ...

    def vocab_size(self) -> int:
        """Rows of the input embeddings."""
        ...

    def sequence_logprobs(self, ids: Sequence[int]) -> list[float]:
        """Logprobs at temperature 1 of `ids[1:]`, each given the ids before it (len(ids) - 1
        floats, nats), through the loss's own forward."""
        ...


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What one `publish` did."""

    version: int
    """The policy version the engine now serves."""
    seconds: float
    """Wall seconds of the publish (export + transfer + swap)."""
    bytes: int
    """Bytes of tensor data handed to the engine."""
    pause_seconds: float | None = None
    """Wall seconds the engine admitted no new token (server paused); None when the sync
    does not pause the engine the same way (the in-process swap waits for one decode step)."""
    canary_abs_dev: float | None = None
    """Max |trainer - engine| per-token logprob (nats) over the canary's probe and every
    replica, after the publish (`engine/canary.py`); None when the canary is off."""
    canary_seconds: float | None = None
    """Wall seconds of the canary (both sides' scoring, after the publish; not in `seconds`);
    None when off."""
    pending_canary: Future[tuple[float, float]] | None = None
    """A deferred canary's verdict (`engine/canary.CanarySync` with `defer`): completes with
    `(canary_abs_dev, canary_seconds)` or holds its `CanaryError`; None when the canary is off
    or was awaited (then the two fields above hold it)."""

    def as_metrics(self) -> dict[str, float]:
        """`sync/seconds` and `sync/bytes` (and `sync/pause_seconds`, `sync/canary_abs_dev`,
        `sync/canary_seconds` when measured), for the step metrics."""
        out = {"sync/seconds": self.seconds, "sync/bytes": float(self.bytes)}
        if self.pause_seconds is not None:
            out["sync/pause_seconds"] = self.pause_seconds
        if self.canary_abs_dev is not None:
            out["sync/canary_abs_dev"] = self.canary_abs_dev
        if self.canary_seconds is not None:
            out["sync/canary_seconds"] = self.canary_seconds
        return out


@runtime_checkable
class WeightSync(Protocol):
    """Publishes the trainer's weights to the engine as a policy version."""

    def publish(self, policy: WeightSource, version: int) -> SyncReport:
        """Make the engine serve `policy`'s current weights as `version` (module docstring).

        Blocking; called from the trainer thread. `version` increases by one per call.

        Raises:
            NonFiniteWeightsError: a weight is NaN or inf (nothing is published).
            EngineError: the engine rejected the weights or is stopped.
        """
        ...


@runtime_checkable
class StartsPublish(Protocol):
    """A sync whose publish comes in two calls, so the trainer can read (not change) its
    weights while the engine takes them (`InProcessWeightSync.start_publish`)."""

    def start_publish(self, policy: WeightSource, version: int) -> Callable[[], SyncReport]: ...


class InProcessWeights(Protocol):
    """An engine in this process that copies tensors into its model between decode steps."""

    def submit_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Future[None]: ...


class InProcessWeightSync:
    """The embedded engine's sync: full weights copied between decode steps, no serialisation.

    The exported tensors of full fine-tuning are the live parameters (no copy): the engine
    copies them before `load_weights` returns.
    """

    def __init__(self, engine: InProcessWeights) -> None:
        self._engine = engine

    def publish(self, policy: WeightSource, version: int) -> SyncReport:
        return self.start_publish(policy, version)()

    def start_publish(self, policy: WeightSource, version: int) -> Callable[[], SyncReport]:
        """Export the weights and queue their copy into the engine; returns the function that
        waits until the engine serves them and gives the report (`publish` is the two at once).
        Until it returns, the policy's weights must not change (they may be read: the canary's
        trainer forward runs meanwhile, `engine/canary.CanarySync`); anything sent to the engine
        after `start_publish` returns is served from the new weights.

        Raises:
            NonFiniteWeightsError: a weight is NaN or inf (nothing is published).
            EngineError: the engine rejected the weights or is stopped (from either call).
        """
        t0 = time.perf_counter()
        weights = policy.export_weights()
        applied = self._engine.submit_weights(weights, version)
        size = sum(t.numel() * t.element_size() for t in weights.values())

        def finish() -> SyncReport:
            applied.result()
            return SyncReport(version=version, seconds=time.perf_counter() - t0, bytes=size)

        return finish


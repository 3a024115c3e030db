"""The `WeightSync` seam: publish the trainer's weights to the engine as a policy version.

Responsibility: move the weights of one optimizer step from the trainer to whatever serves
rollouts, and make the engine serve them as version `version`. The training loop calls
`publish(policy, version)` after each update and knows nothing of the transport; an engine
brings its own implementation (made by `make_weight_sync`):

* `InProcessWeightSync` (the embedded engine): export the full weights (LoRA adapters merged)
  and copy them into the engine's model between two decode steps (`EmbeddedEngine.load_weights`,
  which blocks until the copy is done, so the live parameters may change right after).
* Others plug in here without touching the loop: NCCL broadcast into a vLLM server's workers,
  a safetensors file in a shared directory the server reloads, or LoRA adapters only (a few MB).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harnessrl.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from harnessrl.train.policy import Policy


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What one `publish` did."""

    version: int
    """The policy version the engine now serves."""
    seconds: float
    """Wall seconds of the publish (export + transfer + swap)."""
    bytes: int
    """Bytes of tensor data handed to the engine."""

    def as_metrics(self) -> dict[str, float]:
        """`sync/seconds` and `sync/bytes`, for the step metrics."""
        return {"sync/seconds": self.seconds, "sync/bytes": float(self.bytes)}


@runtime_checkable
class WeightSync(Protocol):
    """Publishes the trainer's weights to the engine as a policy version."""

    def publish(self, policy: Policy, version: int) -> SyncReport:
        """Make the engine serve `policy`'s current weights as `version` (module docstring).

        Blocking; called from the trainer thread. `version` increases by one per call.

        Raises:
            NonFiniteWeightsError: a weight is NaN or inf (nothing is published).
            EngineError: the engine rejected the weights or is stopped.
        """
        ...


class InProcessWeights(Protocol):
    """An engine in this process that copies tensors into its model between decode steps."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...


class InProcessWeightSync:
    """The embedded engine's sync: full weights copied between decode steps, no serialisation.

    The exported tensors of full fine-tuning are the live parameters (no copy): the engine
    copies them before `load_weights` returns.
    """

    def __init__(self, engine: InProcessWeights) -> None:
        self._engine = engine

    def publish(self, policy: Policy, version: int) -> SyncReport:
        from harnessrl.train.policy import export_weights

        t0 = time.perf_counter()
        weights = export_weights(policy)
        self._engine.load_weights(weights, version)
        size = sum(t.numel() * t.element_size() for t in weights.values())
        return SyncReport(version=version, seconds=time.perf_counter() - t0, bytes=size)


def make_weight_sync(engine_kind: str, engine: Any) -> WeightSync:
    """The sync of engine kind `engine_kind` (`engine.kind` in the run config) for `engine`.

    Raises:
        ConfigError: no sync is known for that engine kind.
    """
    match engine_kind:
        case "embedded":
            return InProcessWeightSync(engine)
        case _:
            raise ConfigError(f"engine.kind={engine_kind!r} has no weight sync")

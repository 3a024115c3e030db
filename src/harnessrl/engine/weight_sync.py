"""The `WeightSync` seam: publish the trainer's weights to the engine as a policy version.

Responsibility: move the weights of one optimizer step from the trainer to whatever serves
rollouts, and make the engine serve them as version `version`. The training loop calls
`publish(policy, version)` after each update and knows nothing of the transport; an engine
brings its own implementation (made by `make_weight_sync`):

* `InProcessWeightSync` (the embedded engine): export the full weights (LoRA adapters merged)
  and copy them into the engine's model between two decode steps (`EmbeddedEngine.load_weights`,
  which blocks until the copy is done, so the live parameters may change right after).
* vLLM servers (`engine/vllm_sync.py`, picked by `engine.weight_sync`): safetensors in a shared
  directory the servers reload (`directory`), LoRA adapters loaded per version (`lora`), or
  NCCL broadcast through vLLM's weight-transfer API on GPU machines (`nccl`).

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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harnessrl.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from harnessrl.config import RunConfig
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
    pause_seconds: float | None = None
    """Wall seconds the engine admitted no new token (server paused); None when the sync
    does not pause the engine the same way (the in-process swap waits for one decode step)."""
    canary_abs_dev: float | None = None
    """Max |trainer - engine| per-token logprob (nats) over the canary's probe and every
    replica, after the publish (`engine/canary.py`); None when the canary is off."""
    canary_seconds: float | None = None
    """Wall seconds of the canary (both sides' scoring, after the publish; not in `seconds`);
    None when off."""

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


def make_weight_sync(engine_kind: str, engine: Any, *, config: RunConfig | None = None,
                     run_dir: Path | None = None, model_dir: Path | None = None) -> WeightSync:
    """The sync of engine kind `engine_kind` (`engine.kind` in the run config) for `engine`.

    `embedded`: `InProcessWeightSync`. `vllm` (needs `config`, `run_dir` and `model_dir`, the
    trainer's model directory): the sync named
    by `engine.weight_sync` (`engine/vllm_sync.py`): `directory` writes into
    `engine.sync_dir` (default `<run_dir>/weights`), `lora` keeps `train.max_staleness + 1`
    adapters loaded, `nccl` needs CUDA. With `config.train.sync_canary` (the default) the
    sync is wrapped in the weight-sync canary (`engine/canary.py`: after every publish the
    trainer and each replica score a fixed sequence; a deviation above the bound stops the run).

    Raises:
        ConfigError: no sync is known for that engine kind; the canary is on and the engine
            cannot score a sequence; `engine.weight_sync = "lora"` with
            `train.lora_rank = 0` or `train.lora_rank > engine.max_lora_rank`; `nccl` without CUDA.
        ValueError: `vllm` without `config` or `run_dir`.
    """
    sync: WeightSync
    match engine_kind:
        case "embedded":
            sync = InProcessWeightSync(engine)
        case "vllm":
            if config is None or run_dir is None or model_dir is None:
                raise ValueError("make_weight_sync('vllm', ...) needs config=, run_dir= and model_dir=")
            sync = _vllm_sync(engine, config, Path(run_dir), Path(model_dir))
        case _:
            raise ConfigError(f"engine.kind={engine_kind!r} has no weight sync")
    if config is not None and config.train.sync_canary:
        from harnessrl.engine.canary import with_canary

        sync = with_canary(sync, engine, trainer_dtype=config.train.dtype, engine_dtype=config.engine.dtype)
    return sync


def check_vllm_sync(config: RunConfig) -> None:
    """The checks of `make_weight_sync` that need no engine, for config time.

    Raises:
        ConfigError: `engine.weight_sync = "lora"` with `train.lora_rank = 0`, or with
            `train.lora_rank > engine.max_lora_rank`, or with `engine.max_loras` below
            `train.max_staleness + 1` on launched servers.
    """
    eng, train = config.engine, config.train
    if getattr(eng, "weight_sync", None) != "lora":
        return
    if train.lora_rank <= 0:
        raise ConfigError("engine.weight_sync = 'lora' needs train.lora_rank > 0 (got train.lora_rank = "
                          f"{train.lora_rank}): set train.lora_rank, or engine.weight_sync = 'directory'")
    if train.lora_rank > eng.max_lora_rank:
        raise ConfigError(f"train.lora_rank = {train.lora_rank} exceeds engine.max_lora_rank = "
                          f"{eng.max_lora_rank}: the servers would refuse the adapter")
    launched = eng.url is None and not eng.urls
    if launched and train.max_staleness + 1 > eng.max_loras:
        raise ConfigError(f"engine.max_loras = {eng.max_loras} is below train.max_staleness + 1 = "
                          f"{train.max_staleness + 1} (the adapter versions kept loaded): raise engine.max_loras")


def _vllm_sync(engine: Any, config: RunConfig, run_dir: Path, model_dir: Path) -> WeightSync:
    from harnessrl.engine import vllm_sync

    check_vllm_sync(config)
    eng = config.engine
    sync_dir = Path(eng.sync_dir) if eng.sync_dir else run_dir / "weights"
    match eng.weight_sync:
        case "directory":
            # launched servers start from `serving_dir` (untied embeddings); an attached one from
            # whatever its owner gave it (tied or not: the head is written either way, `write_weights`)
            served = model_dir if eng.attached else vllm_sync.serving_dir(model_dir)
            return vllm_sync.DirectoryWeightSync(engine, sync_dir, model_dir=served)
        case "lora":
            return vllm_sync.LoraWeightSync(engine, sync_dir, keep=config.train.max_staleness + 1)
        case "nccl":
            return vllm_sync.NcclWeightSync(engine)
    raise ConfigError(f"engine.weight_sync={eng.weight_sync!r} is not one of directory, lora, nccl")

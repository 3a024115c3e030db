"""Which weight sync a run gets: one `match` on `engine.kind` (and `engine.weight_sync`).

Responsibility: build the `WeightSync` for the engine a run started, from the engine's own
config and the slice of the training config a sync needs (`SyncSettings`), and wrap it in the
weight-sync canary when that is on. It mirrors `sandbox/select.py`: the seam's module
(`engine/weight_sync.py`) knows no implementation; this one knows them all.

What it does not do: start engines (`runtime.start_engine`) or decide when to publish (the
training loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from harnessrl.engine.canary import with_canary
from harnessrl.engine.vllm import sync as vllm_sync
from harnessrl.engine.vllm import transfer
from harnessrl.engine.weight_sync import (
    InProcessWeights,
    InProcessWeightSync,
    WeightSync,
)
from harnessrl.errors import ConfigError

if TYPE_CHECKING:
    from harnessrl.engine.config import EngineConfig, VllmEngineConfig
    from harnessrl.engine.vllm.client import VllmEngine


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """What a weight sync needs from the training config (`train.*`), not the whole run config."""

    canary: bool = True
    """`train.sync_canary`: check every publish with the canary (`engine/canary.py`)."""
    trainer_dtype: str = "float32"
    """`train.dtype`: with the engine's dtype, the canary's bound (`canary.canary_bound`)."""
    lora_rank: int = 0
    """`train.lora_rank`: a LoRA sync needs adapters (> 0, at most `engine.max_lora_rank`)."""
    keep_versions: int = 2
    """`train.max_staleness + 1`: LoRA adapter versions kept loaded (rollouts in flight may
    still sample from the oldest)."""
    defer_canary: bool = False
    """The canary's verdict comes after `publish` returns, in `SyncReport.pending_canary`
    (`canary.CanarySync`'s `defer`): for a caller that awaits it before the next update, as the
    training loop does."""


def make_weight_sync(engine_config: EngineConfig, engine: object,
                     settings: SyncSettings = SyncSettings(), *, run_dir: Path | None = None,
                     model_dir: Path | None = None) -> WeightSync:
    """The sync of `engine_config.kind` for `engine`.

    `embedded`: `InProcessWeightSync`. `vllm` (needs `run_dir` and `model_dir`, the trainer's
    model directory): the sync named by `engine.weight_sync` (`engine/vllm/sync.py`):
    `directory` writes into `engine.sync_dir` (default `<run_dir>/weights`), `lora` keeps
    `settings.keep_versions` adapters loaded, `gloo` and `nccl` move the weights in memory to one
    server (`engine/vllm/transfer.py`; `nccl` needs CUDA). With `settings.canary` the
    sync is wrapped in the weight-sync canary (`engine/canary.py`: after every publish the
    trainer and each replica score a fixed sequence; a deviation above the bound stops the run).

    Raises:
        ConfigError: no sync is known for that engine kind (`scripted`); the canary is on and the engine
            cannot score a sequence; `engine.weight_sync = "lora"` with `lora_rank = 0` or
            above `engine.max_lora_rank`; `nccl` without CUDA.
        ValueError: `vllm` without `run_dir` or `model_dir`.
    """
    sync: WeightSync
    match engine_config.kind:
        case "embedded":
            sync = InProcessWeightSync(cast(InProcessWeights, engine))
        case "vllm":
            if run_dir is None or model_dir is None:
                raise ValueError("make_weight_sync for engine.kind = 'vllm' needs run_dir= and model_dir=")
            sync = _vllm_sync(cast("VllmEngine", engine), engine_config, settings, Path(run_dir), Path(model_dir))
        case other:
            raise ConfigError(f"engine.kind={other!r} has no weight sync")
    if settings.canary:
        sync = with_canary(sync, engine, trainer_dtype=settings.trainer_dtype, engine_dtype=engine_config.dtype,
                           defer=settings.defer_canary)
    return sync


def check_vllm_sync(eng: VllmEngineConfig, settings: SyncSettings) -> None:
    """The checks of `make_weight_sync` that need no engine, for config time.

    Raises:
        ConfigError: `engine.weight_sync = "lora"` with `train.lora_rank = 0`, or with
            `train.lora_rank > engine.max_lora_rank`, or with `engine.max_loras` below
            `train.max_staleness + 1` on launched servers.
    """
    if eng.weight_sync != "lora":
        return
    if settings.lora_rank <= 0:
        raise ConfigError("engine.weight_sync = 'lora' needs train.lora_rank > 0 (got train.lora_rank = "
                          f"{settings.lora_rank}): set train.lora_rank, or engine.weight_sync = 'directory'")
    if settings.lora_rank > eng.max_lora_rank:
        raise ConfigError(f"train.lora_rank = {settings.lora_rank} exceeds engine.max_lora_rank = "
                          f"{eng.max_lora_rank}: the servers would refuse the adapter")
    launched = eng.url is None and not eng.urls
    if launched and settings.keep_versions > eng.max_loras:
        raise ConfigError(f"engine.max_loras = {eng.max_loras} is below train.max_staleness + 1 = "
                          f"{settings.keep_versions} (the adapter versions kept loaded): raise engine.max_loras")


def _vllm_sync(engine: VllmEngine, eng: VllmEngineConfig, settings: SyncSettings, run_dir: Path,
               model_dir: Path) -> WeightSync:
    check_vllm_sync(eng, settings)
    sync_dir = Path(eng.sync_dir) if eng.sync_dir else run_dir / "weights"
    match eng.weight_sync:
        case "directory":
            # launched servers start from `serving_dir` (untied embeddings); an attached one from
            # whatever its owner gave it (tied or not: the head is written either way, `write_weights`)
            served = model_dir if eng.attached else vllm_sync.serving_dir(model_dir)
            return vllm_sync.DirectoryWeightSync(engine, sync_dir, model_dir=served)
        case "lora":
            return vllm_sync.LoraWeightSync(engine, sync_dir, keep=settings.keep_versions)
        case "gloo":
            return transfer.WeightTransferSync(engine, transfer.GlooTransport(eng.sync_address, eng.sync_port))
        case "nccl":
            return transfer.WeightTransferSync(engine, transfer.NcclTransport(eng.sync_address, eng.sync_port))
    raise ConfigError(f"engine.weight_sync={eng.weight_sync!r} is not one of directory, lora, gloo, nccl")

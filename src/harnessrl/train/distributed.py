"""The trainer on several processes: ranks, the row split, model wrapping, full state on rank 0.

Responsibility: the torch-distributed primitives the trainer needs and nothing of the loop.
`harnessrl train` launched by `torchrun` / `accelerate launch` finds `WORLD_SIZE`, `RANK` and
`LOCAL_RANK` in its environment; `init_ranks` joins the process group (gloo on CPU, NCCL on
CUDA) and says which rank this process is. Rank 0 owns the runtime (proxy, engine, orchestrator,
files); every rank trains (`train/trainer_group.py` runs each trainer operation on all ranks).

The split. A step's rows are assigned whole to ranks, balanced by tokens (`split_by_tokens`:
longest first to the rank with the fewest tokens so far; deterministic, so every rank computes
the same split from the same rows). The loss normaliser is the global trained-token count
(all-reduced), and the strategies' gradient averaging is undone by scaling each rank's loss by
the world size, so N ranks sum exactly the gradient one process computes on the same rows (up
to float summation order). A rank with fewer micro-batches than another runs zero-contribution
passes (`zero_contribution`: a forward and backward of loss 0) so that every rank joins the same
collectives.

Strategies (`train.strategy`):
  * `"ddp"`: `DistributedDataParallel`: full parameters and optimizer state on every rank,
    gradients all-reduced once per step (micro-batches before the last run under `no_sync`).
  * `"fsdp2"`: `torch.distributed.fsdp.fully_shard` on each decoder layer and the root:
    parameters, gradients and AdamW state are sharded (DTensors); forward all-gathers, backward
    reduce-scatters. Full weights for `WeightSync` and checkpoints are gathered on rank 0
    (`full_state_dict`, collective). Runs on CPU with gloo (torch 2.13) as well as on CUDA.

What it does not do: pick what to train (`loop.py`), the step (`step.py`), or the commands that
keep ranks in step (`trainer_group.py`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from harnessrl.errors import ConfigError

STRATEGIES = ("ddp", "fsdp2")

COLLECTIVE_TIMEOUT = timedelta(hours=6)
"""Process-group timeout: ranks other than 0 wait in a collective while rank 0 collects a step's
rollouts, which may take long; a rank that dies is seen at once (its connection closes)."""


@dataclass(frozen=True, slots=True)
class Ranks:
    """Where this process stands among the trainer's processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    strategy: str = "ddp"
    """`train.strategy`; used only when `distributed`."""
    launched: bool = False
    """Started by a launcher (`WORLD_SIZE` set): a process group exists even at one rank."""

    @property
    def is_main(self) -> bool:
        """Rank 0: owns the runtime, the files and the console."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """In a process group: several ranks, or one under a launcher (`torchrun
        --nproc-per-node 1` runs the same wrapped, collective path as N ranks)."""
        return self.world_size > 1 or self.launched

    @property
    def sharded(self) -> bool:
        """Parameters are FSDP2 shards: forwards, full-weight exports and checkpoints are
        collective (every rank must take part)."""
        return self.distributed and self.strategy == "fsdp2"


SINGLE = Ranks()
"""One process, no process group."""


def launched_ranks(environ: Mapping[str, str] = os.environ) -> tuple[int, int, int]:
    """`(rank, world_size, local_rank)` from the launcher's environment (`torchrun`,
    `accelerate launch`); `(0, 1, 0)` when `WORLD_SIZE` is unset.

    Raises:
        ConfigError: a variable that is not an integer, or a rank outside `[0, WORLD_SIZE)`.
    """
    if "WORLD_SIZE" not in environ:
        return 0, 1, 0
    values: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = environ.get(name, "0")
        try:
            values[name] = int(raw)
        except ValueError:
            raise ConfigError(f"environment {name}={raw!r} is not an integer (set by torchrun / "
                              f"accelerate launch)") from None
    rank, world, local = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ConfigError(f"environment RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}: need "
                          f"WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE, LOCAL_RANK >= 0")
    return rank, world, local


def init_ranks(device: str = "cpu", strategy: str = "ddp", environ: Mapping[str, str] = os.environ) -> Ranks:
    """Join the launcher's process group (when `WORLD_SIZE` is set, even to 1) and return this
    process's place.

    `device`: `"cpu"` (backend gloo) or `"cuda"` (backend NCCL, device `cuda:LOCAL_RANK`).
    One process without a launcher (`WORLD_SIZE` unset) starts no process group.

    Raises:
        ConfigError: an unknown `device` or `strategy`, CUDA asked for but unavailable, or a
            bad launcher environment (`launched_ranks`).
    """
    import torch.distributed as dist  # lazy: torch.distributed, absent from some torch builds

    if strategy not in STRATEGIES:
        raise ConfigError(f"train.strategy={strategy!r} is not one of {STRATEGIES}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"train.device={device!r} is not 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but torch sees no CUDA device")
    rank, world, local = launched_ranks(environ)
    launched = "WORLD_SIZE" in environ
    where = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(where)
    if launched and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT,
                                rank=rank, world_size=world)
    return Ranks(rank=rank, world_size=world, local_rank=local, device=where, strategy=strategy, launched=launched)


def close_ranks(ranks: Ranks) -> None:
    """Leave the process group (no-op for one process or when already left)."""
    import torch.distributed as dist  # lazy: torch.distributed, absent from some torch builds

    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()


def split_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of the rows each rank trains: whole rows, balanced by tokens.

    Longest row first, each to the rank with the fewest tokens so far (lowest rank on ties);
    each rank's indices ascending. Deterministic: every rank computes the same split. A rank
    gets no row when there are fewer rows than ranks.

    Raises:
        ValueError: `world_size < 1`.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    load = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        parts[r].append(i)
        load[r] += lengths[i]
    return [sorted(p) for p in parts]


def broadcast_object(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's `obj` on every rank (pickled; `torch.distributed.broadcast_object_list`)."""
    if not ranks.distributed:
        return obj
    import torch.distributed as dist  # lazy: torch.distributed, absent from some torch builds

    box = [obj if ranks.is_main else None]
    dist.broadcast_object_list(box, src=0, device=ranks.device if ranks.device.type == "cuda" else None)
    return box[0]


def gather_objects(obj: Any, ranks: Ranks) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (`all_gather_object`)."""
    if not ranks.distributed:
        return [obj]
    import torch.distributed as dist  # lazy: torch.distributed, absent from some torch builds

    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce(values: Sequence[float], ranks: Ranks, op: str = "sum") -> list[float]:
    """Element-wise `sum` or `max` of `values` over ranks (float64; same length on every rank).

    Raises:
        ValueError: an unknown `op`.
    """
    if op not in ("sum", "max"):
        raise ValueError(f"op={op!r} is not 'sum' or 'max'")
    if not ranks.distributed:
        return [float(v) for v in values]
    import torch.distributed as dist  # lazy: torch.distributed, absent from some torch builds

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def wrap_model(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """The module to run training forwards on: `model` itself for one process, a
    `DistributedDataParallel` around it (`"ddp"`), or `model` sharded in place by `fully_shard`
    on each of its `_no_split_modules` layers and on the root (`"fsdp2"`).

    DDP does not broadcast buffers on each forward (the model's buffers, rotary tables, are
    constants), so a forward is not a collective under DDP; under FSDP2 it is.

    Raises:
        ConfigError: FSDP2 on a model that names no `_no_split_modules` (no layer to shard by).
    """
    if not ranks.distributed:
        return model
    if ranks.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # lazy: torch.distributed, absent from some torch builds

        ids = [ranks.device.index] if ranks.device.type == "cuda" else None
        # torch >= 2.13 names it forward_sync_buffers (broadcast_buffers is deprecated there)
        no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                   else "broadcast_buffers")
        return DistributedDataParallel(model, device_ids=ids, **{no_sync: False})
    from torch.distributed.fsdp import fully_shard  # lazy: torch.distributed, absent from some torch builds

    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"train.strategy='fsdp2': {type(model).__name__} names no _no_split_modules "
                          f"layers to shard; use train.strategy='ddp'")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a `DistributedDataParallel` wrapper (itself otherwise)."""
    from torch.nn.parallel import DistributedDataParallel  # lazy: torch.distributed, absent from some torch builds

    return model.module if isinstance(model, DistributedDataParallel) else model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor  # lazy: torch.distributed, absent from some torch builds

    return t.to_local() if isinstance(t, DTensor) else t


def zero_contribution(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A forward of two tokens through `model` whose loss is 0: call `.backward()` on it where
    this rank has no micro-batch left, so that it joins the other ranks' collectives (FSDP2
    all-gathers and reduce-scatters, DDP's all-reduce) while adding nothing to any gradient."""
    out = model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device),
                position_ids=torch.arange(2, device=device)[None], use_cache=False, logits_to_keep=1)
    return out.logits.float().sum() * 0.0


def full_state_dict(model: torch.nn.Module, ranks: Ranks) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights under the model's names, on CPU on rank 0; `{}` on other
    ranks. Collective under FSDP2 (every rank must call it); the live state dict otherwise."""
    if not ranks.sharded:
        return dict(inner_module(model).state_dict())
    # lazy: torch.distributed, absent from some torch builds
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> dict[str, Any]:
    """FSDP2: the full optimizer state keyed by parameter names, on rank 0 (collective).

    Raises:
        ValueError: called when the parameters are not sharded (use `optimizer.state_dict()`).
    """
    if not ranks.sharded:
        raise ValueError("full_optimizer_state is for sharded (fsdp2) parameters")
    # lazy: torch.distributed, absent from some torch builds
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any] | None, ranks: Ranks) -> None:
    """FSDP2: shard full `weights` (and a `full_optimizer_state`) given on every rank into the
    model and optimizer.

    Raises:
        ValueError: called when the parameters are not sharded.
    """
    if not ranks.sharded:
        raise ValueError("load_full_state is for sharded (fsdp2) parameters")
    # lazy: torch.distributed, absent from some torch builds
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)

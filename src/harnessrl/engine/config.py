"""The engine's configuration: one typed model per `engine.kind`, a discriminated union.

Responsibility: the `[engine]` table validated at config load without importing torch or the
engine (`runtime.make_engine` builds the engine from it). Each kind accepts only its own keys;
a later kind (a vLLM server) adds its model to the union.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EmbeddedEngineConfig(BaseModel):
    """In-process transformers model with continuous batching (`engine/embedded/engine.py`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["embedded"] = "embedded"
    model: str = "smollm2-135m"
    """`smollm2-135m`, `tiny-random`, a local HF directory, or a hub id in the offline cache."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the engine's weights and KV cache live (`cuda`: the current CUDA device); sampling
    stays on the CPU (the logits of a step are copied back)."""
    num_threads: int = Field(default=1, ge=1)
    """torch intra-op threads of the engine's decode thread."""
    max_batch_size: int = Field(default=16, ge=1)
    """Most sequences decoded together in one step."""
    max_context_tokens: int = Field(default=4096, ge=64)
    """Largest prompt + completion length served. Unset in a run config: the harness's need,
    at least 4096 (`harnessrl harness options NAME` shows it)."""
    prefix_cache_tokens: int = Field(default=32768, ge=0)
    """Memory bound of the prefix cache in token positions (LRU; 45 KiB each for SmolLM2-135M
    float32, about 1.4 GiB at the default); 0 turns it off. Cleared on every weight swap."""
    prefill_chunk_tokens: int = Field(default=512, ge=1)
    """Most prompt tokens prefilled between two decode steps (chunked prefill)."""
    max_rows_per_session: int = Field(default=4, ge=1)
    """Most rows of the decode batch one rollout's session holds at once; its further calls wait
    while other sessions' calls are admitted (admission is round robin by session), so one
    rollout flooding the engine cannot hold its siblings' calls back."""
    pack_weights: bool = True
    """Decode steps multiply through oneDNN-packed copies of the projections and LM head (float32
    on the CPU; elsewhere it does nothing): faster decoding for one more copy of the decode
    weights in memory, rebuilt after each weight sync (`engine/embedded/decode_step.py`)."""


class VllmEngineConfig(BaseModel):
    """vLLM server(s) over HTTP (`engine/vllm/client.py`): attached (`url` / `urls`) or launched and
    owned by harnessrl (`engine/vllm/server.py`; `harnessrl engine install vllm` first).

    The chat layer renders with the tokenizer of `model`, which must be the model the servers
    serve (an attached server's model is checked against it by name only when it is a path).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["vllm"] = "vllm"
    model: str = "smollm2-135m"
    """`smollm2-135m`, `tiny-random`, a local HF directory, or a hub id in the offline cache:
    the tokenizer of the chat layer and, when launching, the weights the servers load."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """`--dtype` of launched servers; token-faithful checks need float32 on CPU."""
    url: str | None = None
    """Base URL of one running server (`http://127.0.0.1:8000`); attach, launch nothing."""
    urls: list[str] = Field(default_factory=list)
    """Base URLs of several running servers (replicas); attach to all."""
    replicas: int = Field(default=1, ge=1)
    """Servers to launch when no `url`/`urls` is given."""
    max_context_tokens: int = Field(default=4096, ge=64)
    """Largest prompt + completion length (`--max-model-len` of launched servers; an attached
    server's own limit must be at least this)."""
    weight_sync: Literal["directory", "lora", "gloo", "nccl"] = "directory"
    """How new weights reach the servers: `directory` (safetensors in a shared directory),
    `lora` (adapters; `engine/vllm/sync.py`), `gloo` (in memory over TCP, CPU servers, one
    server) or `nccl` (in memory, GPU machines, one server; `engine/vllm/transfer.py`)."""
    sync_address: str = "127.0.0.1"
    """`gloo`/`nccl`: the trainer's address as the server dials it for the weight-transfer
    rendezvous (the trainer host's own address when they are on different hosts)."""
    sync_port: int = Field(default=29555, ge=1, le=65535)
    """`gloo`/`nccl`: the TCP port of that rendezvous on `sync_address`."""
    sync_dir: str | None = None
    """Shared directory of the `directory` sync; None: `<run dir>/weights`."""
    max_lora_rank: int = Field(default=16, ge=1)
    """`--max-lora-rank` of launched servers when `weight_sync = "lora"`."""
    max_loras: int = Field(default=3, ge=1)
    """`--max-loras` and `--max-cpu-loras` of launched servers when `weight_sync = "lora"`:
    adapters batched together. At least `train.max_staleness + 1` (the versions a sync keeps
    loaded), or requests under different adapters would not share a batch."""
    threads: str | None = None
    """`VLLM_CPU_OMP_THREADS_BIND` of a launched CPU server (`0-1`); None: every core of the
    machine, split evenly across replicas."""
    kv_cache_gib: int = Field(default=2, ge=1)
    """`VLLM_CPU_KVCACHE_SPACE` (whole GiB of KV cache; vLLM refuses a fraction at start) of a
    launched CPU server."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """`--gpu-memory-utilization` of a launched GPU server."""
    enforce_eager: bool = True
    """`--enforce-eager` (always on CPU: torch.compile costs minutes per start and gains nothing)."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line flags for launched servers, passed as given."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for a launched server's `/health` (a CPU start takes 30-50 s)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one completion; past it the turn is an error turn."""
    max_connections: int = Field(default=256, ge=1)
    """Keep-alive connections per replica of the client session."""

    @model_validator(mode="after")
    def _one_source(self) -> VllmEngineConfig:
        if self.url is not None and self.urls:
            raise ValueError("engine.url and engine.urls are exclusive: give one server as url, several as urls")
        for name, value in [("url", self.url)] + [(f"urls[{i}]", u) for i, u in enumerate(self.urls)]:
            if value is not None and not value.startswith(("http://", "https://")):
                raise ValueError(f"engine.{name}={value!r} must start with http:// or https://")
        if self.attached and self.replicas != 1:
            raise ValueError("engine.replicas launches servers; with engine.url/urls give the servers instead")
        return self

    @property
    def attached(self) -> bool:
        """True when the servers are given (`url`/`urls`), False when harnessrl launches them."""
        return self.url is not None or bool(self.urls)

    @property
    def server_urls(self) -> tuple[str, ...]:
        """The attached servers' base URLs without a trailing `/` (empty when launching)."""
        given = [self.url] if self.url is not None else self.urls
        return tuple(u.rstrip("/") for u in given)


class ScriptedEngineConfig(BaseModel):
    """A scripted policy instead of a model (`engine/scripted.py`): records demonstrations
    through a real agent and the real proxy, for `harnessrl sft`. Only `harnessrl rollout`
    runs it (nothing to train)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["scripted"] = "scripted"
    model: str = "smollm2-135m"
    """The model whose tokenizer and chat template the demonstrations are written in (its
    weights are not loaded)."""
    policy: str = "harnessrl.recipes.demos:lookup_bash"
    """`module:function` (or `file.py:function`) taking the prompt's text and returning the
    reply's text (`engine.scripted.ScriptedPolicy`)."""
    max_context_tokens: int = Field(default=16384, ge=64)
    """Largest prompt + reply length served."""

    @property
    def dtype(self) -> Literal["float32"]:
        """No weights are loaded; what checks that ask for the engine's dtype are told."""
        return "float32"


EngineConfig = Annotated[EmbeddedEngineConfig | VllmEngineConfig | ScriptedEngineConfig, Field(discriminator="kind")]
"""`[engine]`: the engine named by `kind` (default `embedded`) with its own keys."""

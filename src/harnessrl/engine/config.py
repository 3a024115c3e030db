"""The engine's configuration: one typed model per `engine.kind`, a discriminated union.

Responsibility: the `[engine]` table validated at config load without importing torch or the
engine (`runtime.make_engine` builds the engine from it). Each kind accepts only its own keys;
a later kind (a vLLM server) adds its model to the union.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class EmbeddedEngineConfig(BaseModel):
    """In-process transformers model with continuous batching (`engine/embedded.py`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["embedded"] = "embedded"
    model: str = "smollm2-135m"
    """`smollm2-135m`, `tiny-random`, a local HF directory, or a hub id in the offline cache."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
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


EngineConfig = Annotated[EmbeddedEngineConfig, Field(discriminator="kind")]
"""`[engine]`: the engine named by `kind` (default `embedded`) with its own keys."""

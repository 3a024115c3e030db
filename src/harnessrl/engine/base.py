"""The `Engine` seam: token ids in, token ids and logprobs out.

An engine never sees text or messages (the chat layer, `chat/layer.py`, renders those).
Invariant: `Completion.prompt_ids` is exactly the input it was given and
`completion_logprobs[i]` is the log-probability of `completion_ids[i]` under the
distribution it was actually drawn from (temperature, top-p, top-k applied), so a trainer
computing `log_softmax(logits / T)` on the same ids reproduces it when nothing was truncated.
`policy_version` is the weight version when the request was admitted (a server engine: when it
was sent), and `straddled` says the version changed while it was in flight.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from harnessrl.engine.stats import EngineStats
from harnessrl.types import Completion, Sampling


@dataclass(slots=True)
class CallProgress:
    """How far an engine got with one call: what a timeout reports of the calls it cut
    (`types.CallInFlight`) and what the console shows of a long prefill.

    The caller (the proxy) creates it and makes it current (`CALL_PROGRESS`) around
    `Engine.generate`; an engine that tracks progress sets `prefilled_tokens` and
    `decoded_tokens` to 0 when it takes the call and advances them from its own thread (read
    elsewhere without a lock: a snapshot may lag by one chunk or one decode step). An engine
    that does not (a vLLM server) leaves them None: only the prompt size and the time are known.
    """

    prompt_tokens: int
    started_s: float = field(default_factory=time.perf_counter)
    """`time.perf_counter()` when the call arrived."""
    prefilled_tokens: int | None = None
    """Prompt tokens whose KV is computed (prefix-cache hits included); None: not reported."""
    decoded_tokens: int | None = None
    """Completion tokens sampled so far; None: not reported."""
    prefilled_s: float | None = None
    """`time.perf_counter()` when the whole prompt was prefilled (decoding began); None: not yet
    or not reported."""


CALL_PROGRESS: contextvars.ContextVar[CallProgress | None] = contextvars.ContextVar("CALL_PROGRESS", default=None)
"""The `CallProgress` of the call the current task is making (`Engine.generate` reads it when
the call is taken; None: nobody asks)."""


@runtime_checkable
class Engine(Protocol):
    """Generates completions for prompt ids. New weights reach it through its `WeightSync`
    (`engine/weight_sync.py`), not through this interface."""

    @property
    def policy_version(self) -> int:
        """Version of the weights currently served."""
        ...

    @property
    def max_context_tokens(self) -> int:
        """Largest `len(prompt_ids) + max_tokens` the engine accepts."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids a completion stops on (the model's generation config)."""
        ...

    def stats(self) -> EngineStats | None:
        """A snapshot of the engine's counters (prefix cache, batching, busy seconds) for the
        step metrics; None for an engine that keeps none (a vLLM server's are its own)."""
        ...

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *,
                       affinity: str | None = None, cache_scope: str | None = None) -> Completion:
        """Generate one completion.

        `affinity` groups requests that should be served by the same replica (the proxy passes
        the rollout's session id, so a multi-replica engine reuses that replica's prefix cache
        turn after turn); the embedded engine also admits sessions round robin by it.
        `cache_scope` (the proxy passes the rollout's group) confines prefix-cache reuse: a
        request reuses only KV that requests of the same scope computed, so a session cannot
        time another group's prompts through the cache. An engine that tracks its calls'
        progress advances the current `CALL_PROGRESS` (when set) as it prefills and decodes.

        Raises:
            ContextLengthError: the prompt leaves no room for a completion.
            EngineError: the engine is stopped or failed.
        """
        ...

    def forget(self, affinity: str) -> None:
        """The session `affinity` ended: cancel its calls still in flight (each fails with
        `EngineError`; no more tokens are generated for them) and drop what routes it (a
        multi-replica engine's choice of replica)."""
        ...

    def close(self) -> None:
        """Stop background work; idempotent."""
        ...

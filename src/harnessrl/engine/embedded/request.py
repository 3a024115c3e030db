"""A generation request inside the embedded engine: what the caller asked and what it got so far.

Responsibility: the per-request state shared by the prefill scheduler (`engine/embedded/prefill.py`) and
the decode loop (`engine/embedded/engine.py`): the prompt, the sampling parameters, where the result
goes, and the ids and logprobs sampled so far; when a request is finished (`Request.record`);
and sampling a batch of requests so that one that fails fails alone (`sample_requests`). Owned
by the decode thread once queued (only `cancelled` is set from other threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

import torch

from harnessrl.engine.base import CallProgress
from harnessrl.engine.embedded.sampler import RowSampling, sample_next
from harnessrl.engine.embedded.stop import StopWatcher
from harnessrl.errors import EngineError
from harnessrl.types import Completion, Sampling

log = logging.getLogger(__name__)

Deliver = Callable[[Completion | BaseException], None]
"""Hands the request's result (or its error) back to the caller; called once, on the decode thread."""


@dataclass(slots=True)
class Request:
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    max_new_tokens: int
    deliver: Deliver
    row: RowSampling
    stop: StopWatcher | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    affinity: str | None = None
    """The caller's session (the proxy's session id): admission is fair between sessions and a
    session's rows in the batch are bounded (`prefill.fair_order`); `EmbeddedEngine.forget`
    cancels them. None: a session of its own."""
    cache_scope: str | None = None
    """Whose prefix-cache entries this request may read and write (the proxy's rollout group):
    a prompt never reuses KV another scope computed, so its latency tells nothing of what
    another scope sent (`prefix_cache.py`)."""
    generator: torch.Generator | None = None
    """Set at admission (from `sampling.seed`, or drawn from the engine's seed generator)."""
    policy_version: int = -1
    """The weight version at admission (what `Completion.policy_version` reports)."""
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    progress: CallProgress | None = None
    """The caller's progress record (`engine.base.CALL_PROGRESS` at `generate`): prompt tokens
    prefilled (`note_prefilled`) and ids sampled (`record`) are written to it."""

    def note_prefilled(self, tokens: int) -> None:
        """`tokens` of the prompt now have their KV (a chunk of a long prompt is done)."""
        if self.progress is not None:
            self.progress.prefilled_tokens = tokens

    def record(self, tok: int, lp: float, eos_token_ids: Collection[int]) -> bool:
        """Record one sampled id; deliver the completion and return True when it is finished:
        `stop` on an EOS id or a completed stop string (even as the last id the cap allows),
        else `length` once `max_new_tokens` ids are sampled."""
        self.completion_ids.append(tok)
        self.logprobs.append(lp)
        if (progress := self.progress) is not None:
            if progress.prefilled_s is None:  # the first id follows the prompt's last chunk
                progress.prefilled_s, progress.prefilled_tokens = time.perf_counter(), len(self.prompt_ids)
            progress.decoded_tokens = len(self.completion_ids)
        reason: Literal["stop", "length"] | None = None
        hit_stop = self.stop.push(tok) if self.stop is not None else False
        if tok in eos_token_ids or hit_stop:  # the model stopped, even on its last allowed id
            reason = "stop"
        elif len(self.completion_ids) >= self.max_new_tokens:
            reason = "length"
        if reason is None:
            return False
        self.deliver(
            Completion(
                prompt_ids=self.prompt_ids,
                completion_ids=tuple(self.completion_ids),
                completion_logprobs=tuple(self.logprobs),
                finish_reason=reason,
                policy_version=self.policy_version,
            )
        )
        return True


def sample_requests(logits_B_V: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[float], list[int]]:
    """Sample every row of `logits_B_V` `[B, V]` for `reqs` (`sampler.sample_next`); returns (ids,
    logprobs, failed rows). When the batch cannot be sampled, rows are sampled one by one and
    each row that fails is delivered its error alone (its id is a placeholder 0): one bad request
    never stops the others. (Rows that succeed on the retry draw a fresh uniform, so their seeded
    stream shifts by one.)
    """
    logits_B_V = logits_B_V.cpu()  # the rows' generators are CPU generators (a no-op on the CPU)
    rows = [r.row for r in reqs]
    gens = [r.generator for r in reqs]
    try:
        ids, lps = sample_next(logits_B_V, rows, gens)  # type: ignore[arg-type]
        return ids, lps, []
    except Exception:  # noqa: BLE001 - find the rows at fault below
        log.warning("sampling a batch of %d rows failed; sampling them one by one", len(reqs), exc_info=True)
    ids, lps, failed = [], [], []
    for b, req in enumerate(reqs):
        try:
            (tok,), (lp,) = sample_next(logits_B_V[b:b + 1], [req.row], [req.generator])  # type: ignore[list-item]
        except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
            tok, lp = 0, 0.0
            failed.append(b)
            req.deliver(EngineError(f"sampling failed for this request ({req.row}): {exc!r}"))
        ids.append(tok)
        lps.append(lp)
    return ids, lps, failed

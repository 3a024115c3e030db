"""The embedded engine: an in-process transformers model served with continuous batching.

Responsibility: turn concurrent `generate(prompt_ids, sampling)` calls (from any thread or
event loop) into batched decode steps on one model copy the engine owns, and return the
sampled ids with their logprobs and the weight version at admission.

How it works. One decode thread owns the model, the KV batch (`engine/embedded/batch.py`), the prefix
cache (`engine/embedded/prefix_cache.py`), the prefill scheduler (`engine/embedded/prefill.py`) and all
per-request state (`engine/embedded/request.py`). Requests and weight loads reach it through a queue.
Each loop iteration:
  1) drain the queue (new requests wait; a weight load is applied now, between steps);
  2) prefill, at most `prefill_chunk_tokens` prompt tokens per iteration (chunked prefill;
     `PrefillScheduler.run`): waiting requests are admitted in order, up to `max_batch_size`
     rows, each from the longest prefix of its prompt in the prefix cache; those whose new
     tokens fit the budget are prefilled together in one forward, a longer one in chunks
     between decode steps. Each prompt done has its KV stored in the prefix cache, its first
     id sampled, and its KV copied into a free slot of the batch (`KVBatch.add_rows`);
  3) one decode step: a single forward over `[B, 1]` ids (per-row position ids, each row's
     key/value written at its own column, a mask of its valid length; `engine/embedded/decode_step.py`
     for Llama-family models, the model's forward otherwise), sample every row (`engine/embedded/request.py`
     `sample_requests`), finish rows that hit max_tokens, an EOS id or a stop string (`Request.record`),
     store a finished row's KV (prompt + completion) in the prefix cache, drop it from the batch.
A request arriving mid-generation therefore joins at the next step; a finished one leaves.
An agent's next turn (previous prompt + reply + tool output) and the other rollouts of a group
(same task prompt; they are prefilled one after another, so the second finds the first's KV)
prefill only the ids not already cached. A prompt wholly cached still computes its last id
(its logits are needed); the reused KV equals what a full prefill computes up to float
rounding of the different matmul shapes (`tests/test_prefix_cache.py`: logprobs within 1e-5).
Results go back through an asyncio future (`loop.call_soon_threadsafe`) or a
`concurrent.futures.Future` for `generate_blocking`.

Why not transformers' own continuous batching (`generate_batch` / `ContinuousBatchingManager`,
5.x): it has one `do_sample` switch for all requests and draws from the global RNG (no
per-request greedy/sampled mix, no per-request seed), no stop strings, no hook to swap
weights between its steps, and its paged-attention cache targets accelerators. The loop here
is small and keeps token faithfulness under our control.

Weight swaps (DESIGN §3.6): `load_weights` blocks the caller until the decode thread has
copied the tensors into the model between two steps, so the caller may reuse its tensors
afterwards (`submit_weights` queues the copy and returns a future instead, so the caller can
work meanwhile without changing the tensors: the sync's canary runs the trainer's forward
then); the decode step's packed weight copies (`DecodeStep.refresh_parts`) are then rebuilt
from the model before the next step (about 0.5-0.8 s for SmolLM2-135M on this CPU, which
the caller does not wait for), one layer at a time: a `prompt_logprobs` (the weight-sync
canary's) queued meanwhile is scored between two layers, not after the rebuild. Requests in flight continue with the new weights from the next step; their
`Completion.policy_version` stays the version at admission (dispatch). Requests still
waiting when the swap happens are admitted under the new version. A swap clears the prefix
cache, entries carry the version they were computed under and lookups ask for the current one,
a request whose prefill was under way restarts it under the new weights (it is admitted
anew), and a row admitted before the swap is not stored when it finishes (its KV mixes
versions): KV computed with old weights never serves a request admitted under new ones.

Threads: with torch's OpenMP backend (the CPU wheels), `torch.set_num_threads(n)` sets the
calling thread's intra-op count *and* a process default that each thread adopts when it first
runs a parallel torch op; a thread already initialised keeps its own count (checked with torch
2.13: a main thread that has run ops keeps 1 after another thread sets 2, one that has not
yet run any adopts 2). The engine therefore calls it first thing in its decode thread, so
decode work uses exactly `num_threads`; a trainer running in another thread should call
`torch.set_num_threads` itself (before or after the engine starts) to keep its own count.

What it deliberately does not do: paged KV memory (the batch and each cache entry hold their
own copies), speculative decoding, GPU streams. A prompt prefilled in chunks runs alone (batch 1).
Invariants: `Completion.prompt_ids` is the input exactly; `len(completion_ids) ==
len(completion_logprobs)`; every logprob finite and <= 0 for finite weights; `finish_reason`
is `stop` when the last id is an EOS id or completes a stop string (even as the last id the
cap allows), else `length` when the (context-clipped) max_tokens cap was reached. A sampling
error fails only its own request; the decode thread goes on (a failed forward pass fails all).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from harnessrl.engine.base import CALL_PROGRESS
from harnessrl.engine.canary import sequence_logprobs
from harnessrl.engine.embedded.batch import KVBatch
from harnessrl.engine.embedded.decode_step import DecodeStep
from harnessrl.engine.embedded.prefill import Prefilled, PrefillScheduler
from harnessrl.engine.embedded.prefix_cache import PrefixCache
from harnessrl.engine.embedded.request import Deliver, Request, sample_requests
from harnessrl.engine.embedded.sampler import RowSampling, effective_temperature
from harnessrl.engine.embedded.stop import StopWatcher
from harnessrl.engine.model_store import load_causal_lm, load_tokenizer
from harnessrl.engine.stats import EngineStats, zero_counters
from harnessrl.errors import ContextLengthError, EngineError
from harnessrl.types import Completion, Sampling

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT_TOKENS = 8192
DEFAULT_PREFIX_CACHE_TOKENS = 32768
DEFAULT_PREFILL_CHUNK_TOKENS = 512
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["EmbeddedEngine", "EngineStats"]


@dataclass(frozen=True, slots=True)
class _WeightLoad:
    state_dict: dict[str, torch.Tensor]
    version: int
    done: concurrent.futures.Future[None]


@dataclass(frozen=True, slots=True)
class _Score:
    ids: tuple[int, ...]
    done: concurrent.futures.Future[list[float]]


@dataclass(frozen=True, slots=True)
class _Forget:
    affinity: str


_STOP = object()


class EmbeddedEngine:
    """In-process engine over a local HF model directory (implements `engine.base.Engine`)."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int | None = None,
        max_batch_size: int = 32,
        max_context_tokens: int | None = None,
        seed: int = 0,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        fast_decode: bool = True,
        pack_weights: bool = True,
        share_prompts: bool = True,
        max_rows_per_session: int | None = None,
    ) -> None:
        """Load the model and tokenizer from `model_dir` and start the decode thread.

        Args:
            model_dir: local HF directory (see `model_store.resolve_model`).
            dtype: `float32` (default), `bfloat16` or `float16`.
            device: `cpu` (default) or `cuda` (the current CUDA device): where the weights, the
                KV cache and the forward run; logits are copied to the CPU for sampling.
            num_threads: torch intra-op threads of the decode thread; None leaves torch's default.
            max_batch_size: most sequences decoded together; more requests wait.
            max_context_tokens: cap on `len(prompt) + completion`; default the model's
                `max_position_embeddings`, capped at 8192.
            seed: seeds the generator that seeds requests without their own `seed`.
            prefix_cache_tokens: memory bound of the prefix cache, in token positions (LRU;
                one position costs `2 * layers * kv_heads * head_dim * dtype bytes`, 45 KiB
                for SmolLM2-135M in float32, so the default 32768 is about 1.4 GiB); 0 turns
                the cache off.
            prefill_chunk_tokens: most prompt tokens prefilled between two decode steps.
            fast_decode: run decode steps through `engine/embedded/decode_step.py` when the model's
                architecture is one it handles (the same logits, less overhead per step);
                False, or another architecture: the model's own forward.
            pack_weights: with `fast_decode`, on the CPU in float32, multiply through
                oneDNN-packed copies of the weights (faster decode steps for one more copy of
                the decode weights in memory; rebuilt after each `load_weights`).
            share_prompts: identical prompts waiting together are computed once (a group's
                rollouts sending their task prompt at once, `engine/embedded/prefill.py`);
                False computes each, for comparison (`bench/engine.py --workload group`).
            max_rows_per_session: most rows of the batch one session (`generate`'s `affinity`)
                holds at once; its further calls wait while other sessions' calls are admitted
                (round robin, `prefill.fair_order`). None: a quarter of `max_batch_size`, at least 1.

        Raises:
            EngineError: unknown dtype or device, `cuda` without a CUDA device, or non-positive sizes.
        """
        if dtype not in _DTYPES:
            raise EngineError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        if device not in ("cpu", "cuda"):
            raise EngineError(f"device={device!r} is not 'cpu' or 'cuda'")
        if device == "cuda" and not torch.cuda.is_available():
            raise EngineError("device='cuda' but torch sees no CUDA device")
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size={max_batch_size} must be >= 1")
        if num_threads is not None and num_threads < 1:
            raise EngineError(f"num_threads={num_threads} must be >= 1")
        if prefix_cache_tokens < 0:
            raise EngineError(f"prefix_cache_tokens={prefix_cache_tokens} must be >= 0")
        if prefill_chunk_tokens < 1:
            raise EngineError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1")
        if max_rows_per_session is not None and max_rows_per_session < 1:
            raise EngineError(f"max_rows_per_session={max_rows_per_session} must be >= 1")
        self._device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self._model = load_causal_lm(Path(model_dir), dtype=dtype).to(self._device)
        self._step = DecodeStep.for_model(self._model, pack_weights=pack_weights) if fast_decode else None
        self._additive_mask = getattr(self._model.config, "_attn_implementation", "sdpa") != "sdpa"
        self._tokenizer = load_tokenizer(Path(model_dir))
        config = self._model.config
        model_ctx = min(
            int(getattr(config, "max_position_embeddings", DEFAULT_MAX_CONTEXT_TOKENS)), DEFAULT_MAX_CONTEXT_TOKENS
        )
        if max_context_tokens is not None and max_context_tokens < 2:
            raise EngineError(f"max_context_tokens={max_context_tokens} must be >= 2")
        self._max_context_tokens = max_context_tokens if max_context_tokens is not None else model_ctx
        self._vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self._eos_token_ids = _eos_ids(self._model)
        self._num_threads = num_threads
        self._max_batch_size = max_batch_size
        self._seed_gen = torch.Generator().manual_seed(seed)
        self._version = 0
        self._packs_stale = False  # a weight load since the decode step's packed copies were made (never without a step)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._active: list[Request] = []
        self._batch = KVBatch(self._device)
        self._prefix_cache = PrefixCache(prefix_cache_tokens)
        self._stats = zero_counters()
        self._prefill = PrefillScheduler(self._model, self._prefix_cache, prefill_chunk_tokens, self._stats,
                                         admit=self._admit, share_prompts=share_prompts,
                                         max_rows_per_session=max_rows_per_session or max(1, max_batch_size // 4))
        self._closed = False
        self._failure: BaseException | None = None
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="harnessrl-engine", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context_tokens(self) -> int:
        return self._max_context_tokens

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def tokenizer(self) -> object:
        """The model directory's tokenizer (used for stop strings; handy for callers)."""
        return self._tokenizer

    def stats(self) -> EngineStats:
        """A snapshot of the counters (cache gauges read without a lock: approximate while busy)."""
        return EngineStats(
            **{
                **self._stats,
                "prefix_cache_tokens": self._prefix_cache.num_tokens,
                "prefix_cache_evictions": self._prefix_cache.evictions,
            }
        )

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *,
                       affinity: str | None = None, cache_scope: str | None = None) -> Completion:
        """Generate one completion; concurrent calls are decoded in one batch. `affinity` (the
        caller's session) makes admission fair between sessions and bounds the session's rows
        (`max_rows_per_session`); `forget(affinity)` cancels its calls. `cache_scope` (the
        rollout group) is the only prefix-cache scope the request reads and writes.

        Raises:
            ContextLengthError: `len(prompt_ids) >= max_context_tokens`.
            EngineError: empty prompt, an id outside `[0, vocab)`, or the engine is closed/failed.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Completion] = loop.create_future()

        def deliver(result: Completion | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(_resolve_async, fut, result)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                log.debug("dropping a result for a closed event loop")

        request = self._make_request(prompt_ids, sampling, deliver)
        request.affinity, request.cache_scope = affinity, cache_scope
        if (progress := CALL_PROGRESS.get()) is not None:  # the caller follows this call's progress
            progress.prefilled_tokens, progress.decoded_tokens = 0, 0
            request.progress = progress
        fut.add_done_callback(lambda f: request.cancelled.set() if f.cancelled() else None)
        self._submit(request)
        return await fut

    def generate_blocking(
        self, prompt_ids: list[int], sampling: Sampling, timeout_s: float | None = None
    ) -> Completion:
        """Like `generate`, for callers without an event loop (never call it on the decode thread).

        Raises:
            EngineError: as `generate`, or no result within `timeout_s` (the request is cancelled).
        """
        fut: concurrent.futures.Future[Completion] = concurrent.futures.Future()

        def deliver(result: Completion | BaseException) -> None:
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)

        request = self._make_request(prompt_ids, sampling, deliver)
        self._submit(request)
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            request.cancelled.set()
            raise EngineError(f"generation did not finish within timeout_s={timeout_s}") from None

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the engine's model between decode steps; blocks until applied
        (`submit_weights(...).result()`).

        Raises:
            EngineError: an unknown key, a shape mismatch, or the engine is closed/failed.
        """
        self.submit_weights(state_dict, version).result()

    def submit_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> concurrent.futures.Future[None]:
        """Queue a copy of `state_dict` into the engine's model between decode steps; the
        future completes when it is applied (or holds the `EngineError` of a failed copy). The
        caller must not change the tensors until then. Anything queued after it (a request, a
        `prompt_logprobs`) sees the new weights.

        Keys are the model's own `state_dict()` names; a subset updates only those tensors.
        Requests in flight continue with the new weights from the next step and keep their
        admission version.

        Raises:
            EngineError: an unknown key, a shape mismatch, or the engine is closed/failed.
        """
        own = self._model.state_dict()
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise EngineError(f"load_weights: unknown parameter names {unknown[:5]} (of {len(unknown)})")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise EngineError(
                    f"load_weights: {name} has shape {tuple(tensor.shape)}, model has {tuple(own[name].shape)}"
                )
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_WeightLoad(state_dict, version, done))
        return done

    replica_names = ("embedded",)
    """One replica (the weight-sync canary names it in errors)."""

    def prompt_logprobs(self, ids: Sequence[int], replica: int = 0) -> list[float]:
        """Logprob at temperature 1 of `ids[t]` given `ids[:t]`, t = 1..len(ids)-1, under the
        weights served now: one forward of the engine's model on the decode thread, between two
        steps and after every weight load queued before (`canary.sequence_logprobs`). Blocking.

        Raises:
            EngineError: an id outside the vocabulary, fewer than 2 ids, or the engine is closed.
        """
        prompt = self._check_prompt(list(ids))
        if len(prompt) < 2:
            raise EngineError("prompt_logprobs needs at least 2 ids")
        done: concurrent.futures.Future[list[float]] = concurrent.futures.Future()
        self._submit(_Score(prompt, done))
        return done.result()

    def forget(self, affinity: str) -> None:
        """The session `affinity` ended: its calls still waiting or decoding are cancelled at
        the next step (each fails with `EngineError`), so nothing is generated for a turn that
        is never recorded. Returns at once; a closed engine ignores it."""
        with self._close_lock:
            if not self._closed and self._failure is None:
                self._queue.put(_Forget(affinity))

    def close(self) -> None:
        """Stop the decode thread and fail requests still pending; idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- caller side --------------------------------------------------------------------

    def _make_request(self, prompt_ids: list[int], sampling: Sampling, deliver: Deliver) -> Request:
        prompt = self._check_prompt(prompt_ids)
        max_new = min(sampling.max_tokens, self._max_context_tokens - len(prompt))
        stop = StopWatcher(self._tokenizer, sampling.stop) if sampling.stop else None
        row = RowSampling(effective_temperature(sampling.temperature), sampling.top_p, sampling.top_k)
        return Request(prompt, sampling, max_new, deliver, row, stop)

    def _check_prompt(self, prompt_ids: list[int]) -> tuple[int, ...]:
        if not prompt_ids:
            raise EngineError("prompt_ids is empty")
        for i, tok in enumerate(prompt_ids):
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < self._vocab_size:
                raise EngineError(f"prompt_ids[{i}]={tok!r} is not a token id in [0, {self._vocab_size})")
        if len(prompt_ids) >= self._max_context_tokens:
            raise ContextLengthError(
                f"len(prompt_ids)={len(prompt_ids)} leaves no room for a completion "
                f"(max_context_tokens={self._max_context_tokens})"
            )
        return tuple(prompt_ids)

    def _submit(self, item: object) -> None:
        # Under the lock, so nothing is queued after `_STOP` or after the failure drain.
        with self._close_lock:
            if self._failure is not None:
                raise EngineError(f"engine failed: {self._failure!r}")
            if self._closed:
                raise EngineError("engine is closed")
            self._queue.put(item)

    # -- decode thread ------------------------------------------------------------------

    def _run(self) -> None:
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)  # per-thread setting, see module docstring
        try:
            with torch.inference_mode():
                while self._drain_queue():
                    if self._packs_stale and not self._refresh_step():
                        break
                    t0 = time.perf_counter()
                    self._drop_cancelled()
                    prefilled = self._prefill.run(self._max_batch_size - len(self._active), self._version,
                                                  self._active)
                    worked = bool(prefilled) or self._prefill.busy  # a prompt (or a chunk of one) ran
                    if prefilled:
                        self._join(prefilled)
                    if self._active:
                        self._decode_step()
                        worked = True
                    if worked:
                        self._stats["busy_seconds"] += time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a failed forward fails every request, then the engine
            log.exception("embedded engine decode thread failed")
            with self._close_lock:
                self._failure = exc
            self._fail_all(EngineError(f"engine failed: {exc!r}"))
            return
        self._fail_all(EngineError("engine is closed"))

    def _drain_queue(self, block: bool = True) -> bool:
        """Take queued items (blocking when idle and `block`); False once asked to stop."""
        idle = block and not self._active and not self._prefill.busy
        items = [self._queue.get()] if idle else []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        keep_running = True
        for item in items:
            if item is _STOP:
                keep_running = False
            elif isinstance(item, _WeightLoad):
                self._apply_weights(item)
            elif isinstance(item, _Score):
                _score(self._model, item)
            elif isinstance(item, _Forget):
                self._cancel_session(item.affinity)
            else:
                assert isinstance(item, Request), f"unexpected queue item {item!r}"
                if keep_running:
                    self._prefill.waiting.append(item)
                else:
                    item.deliver(EngineError("engine is closed"))
        return keep_running

    def _apply_weights(self, load: _WeightLoad) -> None:
        try:
            own = self._model.state_dict()
            for name, tensor in load.state_dict.items():
                own[name].copy_(tensor)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, who sent the tensors
            load.done.set_exception(EngineError(f"load_weights failed: {exc!r}"))
        else:
            self._version = load.version
            self._prefix_cache.clear()
            self._prefill.restart()  # a prompt mid-prefill has KV of the old weights: admitted anew
            self._stats["weight_loads"] += 1
            load.done.set_result(None)
        self._packs_stale = self._step is not None  # the decode step's copies no longer follow the model

    def _refresh_step(self) -> bool:
        """Rebuild the decode step's packed weight copies, which do not follow the model's
        weights; False once asked to stop. Done after the caller of `load_weights` is released
        (they are read from the model, not from the caller's tensors), before the next decode
        step, one layer at a time (`DecodeStep.refresh_parts`) with the queue taken between
        layers: a canary's `prompt_logprobs` sent right after the load is scored then, with the
        model's own forward, instead of after the whole rebuild (0.5-0.8 s for SmolLM2-135M), and a
        newer load starts the rebuild over. Requests that arrive wait for the rebuild."""
        step = self._step
        assert step is not None, "only an engine with a decode step has packed copies to rebuild"
        while self._packs_stale:
            self._packs_stale = False
            try:
                for _ in step.refresh_parts():
                    if not self._drain_queue(block=False):
                        return False
                    if self._packs_stale:  # weights loaded mid-rebuild: the copies made are stale
                        break
            except Exception:  # noqa: BLE001 - without its copies the step multiplies the model's weights
                log.warning("rebuilding the packed decode weights failed; decode steps use F.linear", exc_info=True)
        return True

    def _cancel_session(self, affinity: str) -> None:
        """Cancel and fail every request of session `affinity` (dropped by `_drop_cancelled`)."""
        error = EngineError(f"the session {affinity} ended; its call was cancelled")
        for req in [*self._active, *self._prefill.requests()]:
            if req.affinity == affinity and not req.cancelled.is_set():
                req.cancelled.set()
                self._stats["cancelled_requests"] += 1
                req.deliver(error)

    def _drop_cancelled(self) -> None:
        self._prefill.drop_cancelled()
        gone = [b for b, r in enumerate(self._active) if r.cancelled.is_set()]
        if gone:
            self._batch.remove(gone)
            self._active = [r for r in self._active if not r.cancelled.is_set()]

    def _admit(self, req: Request) -> bool:
        """A request leaves the queue: its version and generator; False when that failed."""
        req.policy_version = self._version
        try:
            seed = req.sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
            req.generator = torch.Generator().manual_seed(seed)
        except Exception as exc:  # noqa: BLE001 - e.g. a seed torch refuses; only this request fails
            req.deliver(EngineError(f"prefill failed for this request: {exc!r}"))
            return False
        return True

    def _join(self, prefilled: list[Prefilled]) -> None:
        """Sample the first id of each prefilled prompt; those not finished by it join the batch."""
        reqs = [p.req for p in prefilled]
        logits_B_V = torch.stack([p.logits_V for p in prefilled])
        toks, lps, failed = sample_requests(logits_B_V, reqs)
        joined = []
        for i, (p, req) in enumerate(zip(prefilled, reqs, strict=True)):
            if i in failed or self._append(req, toks[i], lps[i]):
                continue
            joined.append((p.kv, len(req.prompt_ids), toks[i]))
            self._active.append(req)
        self._batch.add_rows(joined)

    def _decode_step(self) -> None:
        batch = self._batch
        if self._step is not None:
            inputs = batch.step_inputs()
            assert batch.cache is not None
            logits_B_V = self._step(batch.last_ids_B, batch.positions_B, inputs["attention_mask"],  # type: ignore[arg-type]
                                    batch.cache.layers)
        else:  # eager attention adds the mask to its scores; sdpa takes it as bool
            inputs = batch.step_inputs(additive_mask=self._model.dtype if self._additive_mask else None)
            logits_B_V = self._model(**inputs, use_cache=True).logits[:, -1, :]
        ids, lps, failed = sample_requests(logits_B_V, self._active)
        batch.commit_step(ids)
        B = len(self._active)
        self._stats["decode_steps"] += 1
        self._stats["batched_steps"] += int(B > 1)
        self._stats["max_batch_size_seen"] = max(self._stats["max_batch_size_seen"], B)
        gone = set(failed)
        finished = [b for b, req in enumerate(self._active) if b in gone or self._append(req, ids[b], lps[b])]
        if finished:
            self._cache_finished([b for b in finished if b not in gone])
            self._batch.remove(finished)
            done = set(finished)
            self._active = [r for b, r in enumerate(self._active) if b not in done]

    def _cache_finished(self, rows: list[int]) -> None:
        """Store finished rows' KV (prompt + completion ids fed so far) in the prefix cache.
        Rows admitted under an older weight version are skipped (their KV mixes versions)."""
        if not self._prefix_cache.enabled:
            return
        for b in rows:
            req = self._active[b]
            if req.policy_version != self._version:
                continue
            kv = self._batch.row_kv(b)
            n = kv[0][0].shape[-2]
            ids = (req.prompt_ids + tuple(req.completion_ids))[:n]
            self._prefix_cache.insert(ids, self._version, kv, scope=req.cache_scope)

    def _append(self, req: Request, tok: int, lp: float) -> bool:
        """Record one sampled id; True when the request finished (and was delivered)."""
        self._stats["generated_tokens"] += 1
        return req.record(tok, lp, self._eos_token_ids)

    def _fail_all(self, error: EngineError) -> None:
        for req in [*self._active, *self._prefill.take_all()]:
            req.deliver(error)
        self._active = []
        self._batch = KVBatch(self._device)
        self._prefix_cache.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Request):
                item.deliver(error)
            elif isinstance(item, (_WeightLoad, _Score)):
                item.done.set_exception(error)


def _score(model: torch.nn.Module, item: _Score) -> None:
    try:
        item.done.set_result(sequence_logprobs(model, item.ids))
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        item.done.set_exception(EngineError(f"prompt_logprobs failed: {exc!r}"))


def _resolve_async(fut: asyncio.Future[Completion], result: Completion | BaseException) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def _eos_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """EOS ids from the generation config (int or list), else the model config."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))

"""The embedded engine: an in-process transformers model served with continuous batching.

Responsibility: turn concurrent `generate(prompt_ids, sampling)` calls (from any thread or
event loop) into batched decode steps on one model copy the engine owns, and return the
sampled ids with their logprobs and the weight version at admission.

How it works. One decode thread owns the model, the KV batch (`engine/batch.py`), the prefix
cache (`engine/prefix_cache.py`) and all per-request state. Requests and weight loads reach it
through a queue. Each loop iteration:
  1) drain the queue (new requests wait; a weight load is applied now, between steps);
  2) prefill, at most `prefill_chunk_tokens` prompt tokens per iteration (chunked prefill):
     waiting requests are admitted in order, up to `max_batch_size` rows; each starts from
     the longest prefix of its prompt found in the prefix cache (only its new tokens are
     computed). Requests whose new tokens fit in the budget together are prefilled in one
     batched forward (one pass over the weights instead of one per prompt: on CPU a forward
     costs about as much for 8 short prompts as for one); a request that would recompute more
     than a block of a group member's new tokens waits for the next group, where it finds them
     in the prefix cache (the G rollouts of a group share the task prompt that way). A prompt
     that does not fit is prefilled in chunks in its own batch-1 cache, and the rows already
     decoding take a step between its chunks. When a prompt is done its KV is stored in the
     prefix cache, its first id is sampled and its KV merged into the left-padded batch;
  3) one decode step: a single forward over `[B, 1]` ids (per-row position ids and padding
     mask), sample every row (`engine/sampler.py`), finish rows that hit max_tokens, an EOS id
     or a stop string, store a finished row's KV (prompt + completion) in the prefix cache, and
     drop it from the batch.
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
afterwards. Requests in flight continue with the new weights from the next step; their
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
import collections
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from harnessrl.engine.batch import BufferedLayer, KVBatch
from harnessrl.engine.model_store import load_causal_lm, load_tokenizer
from harnessrl.engine.prefix_cache import PrefixCache
from harnessrl.engine.sampler import RowSampling, effective_temperature, sample_next
from harnessrl.engine.stop import StopWatcher
from harnessrl.errors import ContextLengthError, EngineError
from harnessrl.types import Completion, Sampling

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT_TOKENS = 8192
DEFAULT_PREFIX_CACHE_TOKENS = 32768
DEFAULT_PREFILL_CHUNK_TOKENS = 512
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Deliver = Callable[[Completion | BaseException], None]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of the decode thread (a snapshot)."""

    decode_steps: int
    """Batched forward passes over `[B, 1]` ids."""
    batched_steps: int
    """Decode steps that ran with B > 1."""
    max_batch_size_seen: int
    prefills: int
    generated_tokens: int
    weight_loads: int
    prefill_tokens: int
    """Prompt tokens run through the model in prefill (what the prefix cache saves on)."""
    prefix_hit_tokens: int
    """Prompt tokens whose KV came from the prefix cache instead."""
    prefix_hits: int
    """Prefills that started from a cached prefix."""
    prefill_chunks: int
    """Forward passes of prefill (a prompt takes ceil(new tokens / chunk) of them)."""
    prefix_cache_tokens: int = 0
    """Token positions held in the prefix cache now."""
    prefix_cache_evictions: int = 0
    prefill_batches: int = 0
    """Prefill forwards that ran several prompts together (counted in `prefill_chunks` too)."""

    def step_metrics(self, previous: EngineStats | None = None, prefix: str = "engine/") -> dict[str, float]:
        """Flat metrics of the work done since `previous` (a snapshot taken earlier; None: since
        start): each counter's increase as `engine/<name>`, the gauge `engine/prefix_cache_tokens`
        as it is now, `engine/prefix_hit_frac` = reused / (reused + computed) prompt tokens and
        `engine/mean_batch_size` = generated tokens per decode step (0 when none)."""
        out: dict[str, float] = {}
        for name in EngineStats.__slots__:  # type: ignore[attr-defined]
            value = getattr(self, name)
            if name not in ("prefix_cache_tokens", "max_batch_size_seen") and previous is not None:
                value -= getattr(previous, name)
            out[prefix + name] = float(value)
        prompt = out[prefix + "prefill_tokens"] + out[prefix + "prefix_hit_tokens"]
        out[prefix + "prefix_hit_frac"] = out[prefix + "prefix_hit_tokens"] / prompt if prompt else 0.0
        steps = out[prefix + "decode_steps"]
        decoded = out[prefix + "generated_tokens"] - out[prefix + "prefills"]  # one id per prefill is not a step's
        out[prefix + "mean_batch_size"] = max(decoded, 0.0) / steps if steps else 0.0
        return out


@dataclass(slots=True)
class _Request:
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    max_new_tokens: int
    deliver: Deliver
    row: RowSampling
    stop: StopWatcher | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator | None = None
    policy_version: int = -1
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Prefill:
    """A request being prefilled: its batch-1 cache holds the KV of `prompt_ids[:done]`."""

    req: _Request
    cache: DynamicCache
    done: int


@dataclass(frozen=True, slots=True)
class _WeightLoad:
    state_dict: dict[str, torch.Tensor]
    version: int
    done: concurrent.futures.Future[None]


_STOP = object()


class EmbeddedEngine:
    """In-process engine over a local HF model directory (implements `engine.base.Engine`)."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        dtype: str = "float32",
        num_threads: int | None = None,
        max_batch_size: int = 32,
        max_context_tokens: int | None = None,
        seed: int = 0,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    ) -> None:
        """Load the model and tokenizer from `model_dir` and start the decode thread.

        Args:
            model_dir: local HF directory (see `model_store.resolve_model`).
            dtype: `float32` (default), `bfloat16` or `float16`.
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

        Raises:
            EngineError: unknown dtype or non-positive sizes.
        """
        if dtype not in _DTYPES:
            raise EngineError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size={max_batch_size} must be >= 1")
        if num_threads is not None and num_threads < 1:
            raise EngineError(f"num_threads={num_threads} must be >= 1")
        if prefix_cache_tokens < 0:
            raise EngineError(f"prefix_cache_tokens={prefix_cache_tokens} must be >= 0")
        if prefill_chunk_tokens < 1:
            raise EngineError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1")
        self._model = load_causal_lm(Path(model_dir), dtype=dtype)
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
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: list[_Request] = []
        self._prefilling: _Prefill | None = None
        self._batch = KVBatch()
        self._prefix_cache = PrefixCache(prefix_cache_tokens)
        self._chunk_tokens = prefill_chunk_tokens
        self._stats = dict.fromkeys(EngineStats.__slots__, 0)  # type: ignore[attr-defined]
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
                       affinity: str | None = None) -> Completion:
        """Generate one completion; concurrent calls are decoded in one batch (`affinity` is
        ignored: one replica).

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
        """Copy `state_dict` into the engine's model between decode steps; blocks until applied.

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
        done.result()

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

    def _make_request(self, prompt_ids: list[int], sampling: Sampling, deliver: Deliver) -> _Request:
        prompt = self._check_prompt(prompt_ids)
        max_new = min(sampling.max_tokens, self._max_context_tokens - len(prompt))
        stop = StopWatcher(self._tokenizer, sampling.stop) if sampling.stop else None
        row = RowSampling(effective_temperature(sampling.temperature), sampling.top_p, sampling.top_k)
        return _Request(prompt, sampling, max_new, deliver, row, stop)

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
                    self._drop_cancelled()
                    self._prefill_some()
                    if self._active:
                        self._decode_step()
        except Exception as exc:  # noqa: BLE001 - a failed forward fails every request, then the engine
            log.exception("embedded engine decode thread failed")
            with self._close_lock:
                self._failure = exc
            self._fail_all(EngineError(f"engine failed: {exc!r}"))
            return
        self._fail_all(EngineError("engine is closed"))

    def _drain_queue(self) -> bool:
        """Take queued items (blocking when idle); False once asked to stop."""
        idle = not self._active and not self._waiting and self._prefilling is None
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
            else:
                assert isinstance(item, _Request), f"unexpected queue item {item!r}"
                if keep_running:
                    self._waiting.append(item)
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
            return
        self._version = load.version
        self._prefix_cache.clear()
        if self._prefilling is not None:  # its partial KV is from the old weights: admit it anew
            self._waiting.appendleft(self._prefilling.req)
            self._prefilling = None
        self._stats["weight_loads"] += 1
        load.done.set_result(None)

    def _drop_cancelled(self) -> None:
        if self._prefilling is not None and self._prefilling.req.cancelled.is_set():
            self._prefilling = None
        self._waiting = collections.deque(r for r in self._waiting if not r.cancelled.is_set())
        gone = [b for b, r in enumerate(self._active) if r.cancelled.is_set()]
        if gone:
            self._batch.remove(gone)
            self._active = [r for r in self._active if not r.cancelled.is_set()]

    def _prefill_some(self) -> None:
        """Prefill up to `prefill_chunk_tokens` prompt tokens, admitting waiting requests in turn:
        several whose new tokens fit in the budget together in one forward, a longer one in chunks."""
        budget = self._chunk_tokens
        while budget > 0:
            if self._prefilling is None:
                if not self._waiting or len(self._active) >= self._max_batch_size:
                    return
                group, overflow = self._admit_group(budget)
                if len(group) > 1 or (group and overflow is not None):
                    budget -= self._prefill_together(group)
                    self._prefilling = overflow
                    continue
                self._prefilling = group[0] if group else overflow  # alone: in chunks, below
                if self._prefilling is None:
                    continue
            p = self._prefilling
            n = min(budget, len(p.req.prompt_ids) - p.done)
            try:
                out = self._model(
                    input_ids=torch.tensor([p.req.prompt_ids[p.done : p.done + n]], dtype=torch.long),
                    position_ids=torch.arange(p.done, p.done + n).unsqueeze(0),
                    cache=p.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            except Exception as exc:  # noqa: BLE001 - this request's prefill failed; the others go on
                log.warning("prefill of a request failed", exc_info=True)
                self._prefilling = None
                p.req.deliver(EngineError(f"prefill failed for this request: {exc!r}"))
                continue
            p.done += n
            budget -= n
            self._stats["prefill_tokens"] += n
            self._stats["prefill_chunks"] += 1
            if p.done == len(p.req.prompt_ids):
                self._prefilling = None
                self._finish_prefill(p, out.logits[:, -1, :])

    def _admit_group(self, budget: int) -> tuple[list[_Prefill], _Prefill | None]:
        """Admit waiting requests, in order, whose new tokens fit in `budget` together (the
        group prefilled in one forward), and the first one that does not fit (prefilled in
        chunks next), within `max_batch_size` rows. A request that shares more than a block of
        a group member's new tokens waits, so that it finds them in the prefix cache instead."""
        group: list[_Prefill] = []
        tokens = 0
        block = self._prefix_cache.block_tokens if self._prefix_cache.enabled else 0
        while self._waiting and len(self._active) + len(group) < self._max_batch_size:
            prompt = self._waiting[0].prompt_ids
            if block and any(_shares_beyond(prompt, g.req.prompt_ids, g.done + block) for g in group):
                break
            p = self._start_prefill(self._waiting.popleft())
            if p is None:
                continue
            new = len(p.req.prompt_ids) - p.done
            if tokens + new > budget:
                return group, p
            group.append(p)
            tokens += new
        return group, None

    def _prefill_together(self, group: list[_Prefill]) -> int:
        """Prefill the rest of every prompt of `group` in one forward; returns the tokens computed.

        Layout `[B, Lc + m]`: row i's cached prefix (c_i ids, from the prefix cache) right-aligned
        in the first Lc columns, its n_i new ids from column Lc on, then padding (masked; the
        padding queries come after the row's real ids, so every query sees at least one key).
        Row i's KV is then the contiguous columns `[Lc - c_i, Lc + n_i)`.
        """
        reqs = [p.req for p in group]
        c = [p.done for p in group]
        n = [len(r.prompt_ids) - d for r, d in zip(reqs, c, strict=True)]
        B, Lc, m = len(group), max(c), max(n)
        if Lc == 0:
            cache: Cache = DynamicCache(config=self._model.config)
        else:
            layers = []
            some = next(p for p in group if p.done)
            for layer, ly in enumerate(some.cache.layers):
                k_buf = ly.keys.new_zeros((B, ly.keys.shape[1], Lc + m, ly.keys.shape[3]))
                v_buf = ly.values.new_zeros((B, ly.values.shape[1], Lc + m, ly.values.shape[3]))
                for i, p in enumerate(group):
                    if c[i]:
                        k_buf[i, :, Lc - c[i] : Lc] = p.cache.layers[layer].keys[0]
                        v_buf[i, :, Lc - c[i] : Lc] = p.cache.layers[layer].values[0]
                layers.append(BufferedLayer(k_buf, v_buf, Lc))
            cache = Cache(layers=layers)
        ids = torch.zeros((B, m), dtype=torch.long)
        mask = torch.zeros((B, Lc + m), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : n[i]] = torch.tensor(r.prompt_ids[c[i] :], dtype=torch.long)
            mask[i, Lc - c[i] : Lc + n[i]] = 1
        positions = torch.tensor(c, dtype=torch.long).unsqueeze(1) + torch.arange(m).unsqueeze(0)
        keep = sorted(set(k - 1 for k in n))
        try:
            out = self._model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                              use_cache=True, logits_to_keep=torch.tensor(keep))
        except Exception as exc:  # noqa: BLE001 - these requests' prefill failed; the others go on
            log.warning("prefill of %d requests failed", B, exc_info=True)
            for r in reqs:
                r.deliver(EngineError(f"prefill failed for this request: {exc!r}"))
            return sum(n)
        logits_B_V = out.logits[torch.arange(B), torch.tensor([keep.index(k - 1) for k in n])]
        self._stats["prefill_tokens"] += sum(n)
        self._stats["prefill_chunks"] += 1
        self._stats["prefill_batches"] += 1
        self._stats["prefills"] += B
        row_kv = [
            [(ly.keys[i : i + 1, :, Lc - c[i] : Lc + n[i]], ly.values[i : i + 1, :, Lc - c[i] : Lc + n[i]])
             for ly in cache.layers]
            for i in range(B)
        ]
        if self._prefix_cache.enabled:
            for r, kv in zip(reqs, row_kv, strict=True):  # copies: a view would keep the whole batch alive
                self._prefix_cache.insert(r.prompt_ids, self._version, [(k.clone(), v.clone()) for k, v in kv])
        toks, lps, failed = self._sample(logits_B_V, reqs)
        joined = []
        for i, r in enumerate(reqs):
            if i in failed or self._append(r, toks[i], lps[i]):
                continue
            joined.append((row_kv[i], len(r.prompt_ids), toks[i]))
            self._active.append(r)
        self._batch.add_rows(joined)
        return sum(n)

    def _start_prefill(self, req: _Request) -> _Prefill | None:
        """Admit `req`: its version, generator, and a cache seeded from the prefix cache."""
        req.policy_version = self._version
        try:
            seed = req.sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
            req.generator = torch.Generator().manual_seed(seed)
        except Exception as exc:  # noqa: BLE001 - e.g. a seed torch refuses; only this request fails
            req.deliver(EngineError(f"prefill failed for this request: {exc!r}"))
            return None
        cache = DynamicCache(config=self._model.config)
        hit = self._prefix_cache.lookup(req.prompt_ids, self._version, max_length=len(req.prompt_ids) - 1)
        if hit is None:
            return _Prefill(req, cache, 0)
        for layer, (k, v) in enumerate(hit.kv):
            cache.update(k, v, layer)
        self._stats["prefix_hits"] += 1
        self._stats["prefix_hit_tokens"] += hit.length
        return _Prefill(req, cache, hit.length)

    def _finish_prefill(self, p: _Prefill, logits_1_V: torch.Tensor) -> None:
        req = p.req
        self._stats["prefills"] += 1
        self._prefix_cache.insert(req.prompt_ids, self._version, [(ly.keys, ly.values) for ly in p.cache.layers])
        (tok,), (lp,), failed = self._sample(logits_1_V, [req])
        if failed or self._append(req, tok, lp):
            return
        self._batch.add(p.cache, len(req.prompt_ids), tok)
        self._active.append(req)

    def _decode_step(self) -> None:
        inputs = self._batch.step_inputs()
        out = self._model(**inputs, use_cache=True)
        ids, lps, failed = self._sample(out.logits[:, -1, :], self._active)
        self._batch.commit_step(inputs["attention_mask"], ids)  # type: ignore[arg-type]
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
            self._prefix_cache.insert(ids, self._version, kv)

    def _sample(self, logits_B_V: torch.Tensor, reqs: list[_Request]) -> tuple[list[int], list[float], list[int]]:
        """Sample every row; returns (ids, logprobs, failed rows). When the batch cannot be
        sampled, rows are sampled one by one and each row that fails is delivered its error
        alone (its id is a placeholder 0): one bad request never stops the others. (Rows
        that succeed on the retry draw a fresh uniform, so their seeded stream shifts by one.)
        """
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

    def _append(self, req: _Request, tok: int, lp: float) -> bool:
        """Record one sampled id; deliver and return True when the request is finished."""
        req.completion_ids.append(tok)
        req.logprobs.append(lp)
        self._stats["generated_tokens"] += 1
        reason: Literal["stop", "length"] | None = None
        hit_stop = req.stop.push(tok) if req.stop is not None else False
        if tok in self._eos_token_ids or hit_stop:  # the model stopped, even on its last allowed id
            reason = "stop"
        elif len(req.completion_ids) >= req.max_new_tokens:
            reason = "length"
        if reason is None:
            return False
        req.deliver(
            Completion(
                prompt_ids=req.prompt_ids,
                completion_ids=tuple(req.completion_ids),
                completion_logprobs=tuple(req.logprobs),
                finish_reason=reason,
                policy_version=req.policy_version,
            )
        )
        return True

    def _fail_all(self, error: EngineError) -> None:
        for req in [*self._active, *self._waiting]:
            req.deliver(error)
        if self._prefilling is not None:
            self._prefilling.req.deliver(error)
            self._prefilling = None
        self._active, self._waiting = [], collections.deque()
        self._batch = KVBatch()
        self._prefix_cache.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Request):
                item.deliver(error)
            elif isinstance(item, _WeightLoad):
                item.done.set_exception(error)


def _shares_beyond(a: tuple[int, ...], b: tuple[int, ...], k: int) -> bool:
    """Whether `a` and `b` have the same first `k` ids (both at least that long)."""
    return len(a) >= k and len(b) >= k and a[:k] == b[:k]


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

"""Prefill scheduling of the embedded engine: which waiting prompts run through the model next, how.

Responsibility: own the engine's waiting requests and the one prompt being prefilled in
chunks; each `run(free_rows, version)` computes at most `chunk_tokens` prompt tokens and returns
the requests whose prompt is now fully prefilled (`Prefilled`: the prompt's KV and the logits
of its last position). The decode loop (`engine/embedded/engine.py`) samples their first ids and adds
them to the running batch (`engine/embedded/batch.py`).

Policy. Waiting requests are admitted round-robin by session (`Request.affinity`, the proxy's
session id; `fair_order`): a session's k-th waiting request ranks after every other session's
(k-1)-th, counting the rows it already holds in the batch, and a session holding
`max_rows_per_session` rows admits no more until one finishes. First in, first out, one
session's many long calls would hold every sibling's call back until all of them were admitted
(under RL, the policy's best move against its siblings); here a sibling's call is next once a
row is free, and rows stay free for other sessions. Each starts from the longest prefix of its
prompt found in the prefix cache (`engine/embedded/prefix_cache.py`; only its new tokens are computed;
a prompt wholly cached still computes its last id, whose logits are needed). Requests whose
new tokens fit in the budget together are prefilled in one batched forward (one pass over the
weights instead of one per prompt: on CPU a forward costs about as much for 8 short prompts as
for one). A request whose prompt equals a group member's is not computed again: it
follows that member and gets its KV and last-position logits (the G rollouts of a group send
the same task prompt at once). A request that would otherwise recompute more than a block of a
group member's new tokens waits for the next group, where it finds them in the prefix cache
(a fork's history, a shared system prompt). The first prompt that does not fit is prefilled in chunks in
its own batch-1 cache; the decode loop takes a step between its chunks. Meanwhile, prompts that
fit in an iteration's budget go before its next chunk (a sibling's short call does not wait for a
long prompt to finish), and while other sessions' rows decode, a chunk of a session with n
calls in the engine is at most `chunk_tokens / n` (`_share`): those rows wait behind every
chunk, so a session's parallel long prompts must not take the whole budget step after step. A prompt's KV is stored
in the prefix cache when its prefill is done.

Batched layouts (`group_forward`): fresh prompts (none has a cached prefix) are packed into
one row without padding (`packed_forward`: a block-diagonal causal mask, position ids restarting
per prompt), so the matmuls see only real ids, where a static batch pads each prompt to the
longest. With cached prefixes: `[B, Lc + m]`, row i's cached prefix (c_i ids) right-aligned
in the first Lc columns, its n_i new ids from column Lc on, then padding (masked; padding
queries come after the row's real ids, so every query sees at least one key). Row i's KV is
then the contiguous columns `[Lc - c_i, Lc + n_i)`.

Weight swaps: `restart()` puts the prompt being prefilled back at the head of the queue (its
partial KV is from the old weights); lookups and inserts carry the version `run` is given.
Not thread-safe: owned by the engine's decode thread.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from harnessrl.engine.embedded.batch import BufferedLayer
from harnessrl.engine.embedded.prefix_cache import KV, PrefixCache
from harnessrl.engine.embedded.request import Request
from harnessrl.errors import EngineError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Prefilled:
    """A request whose prompt is fully prefilled."""

    req: Request
    kv: KV
    """Per layer (keys, values) `[1, H_kv, len(prompt), D]` (may be views; copy before keeping)."""
    logits_V: torch.Tensor
    """Logits of the prompt's last position, `[V]`."""


@dataclass(slots=True)
class _InProgress:
    """A request being prefilled: its batch-1 cache holds the KV of `prompt_ids[:done]`."""

    req: Request
    cache: DynamicCache
    done: int
    followers: list[Request] = field(default_factory=list)
    """Admitted requests with the very same prompt, served by this one's forward (their KV
    and last logits are this prompt's: computed once, `_admit_group`)."""


class PrefillScheduler:
    """The waiting queue and the prefill work of the embedded engine (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        prefix_cache: PrefixCache,
        chunk_tokens: int,
        counters: dict[str, int],
        admit: Callable[[Request], bool],
        share_prompts: bool = True,
        max_rows_per_session: int | None = None,
    ) -> None:
        """Args:
            model: the engine's causal LM (forward with `cache=`, `logits_to_keep=`).
            prefix_cache: the engine's prefix cache (looked up at admission, filled after prefill).
            chunk_tokens: most prompt tokens computed per `run`, >= 1.
            counters: the engine's counter dict; `prefills`, `prefill_tokens`, `prefill_chunks`,
                `prefill_batches`, `prefill_shared`, `prefix_hits`, `prefix_hit_tokens` are increased here.
            admit: called once per request as it leaves the queue (sets its version and
                generator); False means it failed and was delivered its error (skipped).
            share_prompts: a waiting request whose prompt equals a group member's follows it
                (computed once, `_admit_group`); False computes every prompt.
            max_rows_per_session: most rows of the running batch (and the prompt being
                prefilled) one session (`Request.affinity`) holds; None: no bound. Requests
                without an affinity are sessions of their own.
        """
        assert chunk_tokens >= 1, f"chunk_tokens={chunk_tokens} must be >= 1"
        self._model = model
        self._cache = prefix_cache
        self._chunk_tokens = chunk_tokens
        self._counters = counters
        self._admit = admit
        self._share_prompts = share_prompts
        self._max_rows = max_rows_per_session
        self.waiting: collections.deque[Request] = collections.deque()
        self._current: _InProgress | None = None

    @property
    def busy(self) -> bool:
        """Whether requests wait or a prompt is being prefilled."""
        return bool(self.waiting) or self._current is not None

    def run(self, free_rows: int, version: int, running: Iterable[Request] = ()) -> list[Prefilled]:
        """Prefill up to `chunk_tokens` prompt tokens, admitting at most `free_rows` requests
        (rows the running batch can still take), in `fair_order` given the batch's `running`
        requests; returns the prompts finished, in order."""
        running = list(running)
        decoding: collections.Counter[str | None] = collections.Counter(r.affinity for r in running)
        calls = collections.Counter(r.affinity for r in self.requests()) + decoding
        held: list[Request] = []
        if len(self.waiting) > 1 or self._max_rows is not None:
            rows = decoding.copy()
            if self._current is not None:
                rows[self._current.req.affinity] += 1
            self.waiting, held = fair_order(self.waiting, rows, self._max_rows)
        try:
            return self._run(free_rows, version, decoding, calls)
        finally:
            self.waiting.extend(held)

    def _run(self, free_rows: int, version: int, decoding: Mapping[str | None, int],
             calls: Mapping[str | None, int]) -> list[Prefilled]:
        budget = self._chunk_tokens
        done: list[Prefilled] = []
        while budget > 0:
            free = free_rows - len(done)
            if self._current is None:
                if not self.waiting or free <= 0:
                    break
                group, overflow = self._admit_group(budget, free, version)
                if len(group) > 1 or (group and (overflow is not None or group[0].followers)):
                    budget -= self._prefill_together(group, version, done)
                    self._current = overflow
                    continue
                self._current = group[0] if group else overflow  # alone: in chunks, below
                if self._current is None:
                    continue
            elif self.waiting and free > 0:  # prompts that fit go before the rest of a long one
                group, _ = self._admit_group(budget, free, version, overflow_ok=False)
                if group:
                    budget -= self._prefill_together(group, version, done)
                    continue
            current = self._current
            assert current is not None
            share = self._share(current.req, [*decoding, *(p.req.affinity for p in done)], calls)
            budget -= self._prefill_chunk(min(budget, share), version, done)
            if self._current is not None:  # a long prompt: its share of this iteration is spent
                break
        return done

    def _share(self, req: Request, decoding: Iterable[str | None], calls: Mapping[str | None, int]) -> int:
        """Prompt tokens `req` may prefill in this iteration: `chunk_tokens`; divided by the
        number of calls its session has in the engine (decoding, waiting, this one) while another
        session has rows decoding (`decoding`: their sessions, those prefilled this iteration too). Those rows wait behind every chunk, so a session's parallel
        long prompts get a share by their number instead of the whole budget step after step;
        a session's single call, or any call while nobody else decodes, prefills at full speed."""
        others = any(a != req.affinity for a in decoding)
        if req.affinity is None or not others:
            return self._chunk_tokens
        return max(1, self._chunk_tokens // max(1, calls.get(req.affinity, 1)))

    def restart(self) -> None:
        """After a weight swap: the prompt being prefilled is admitted anew (its KV is stale)."""
        if self._current is not None:
            self.waiting.appendleft(self._current.req)
            self._current = None

    def drop_cancelled(self) -> None:
        """Forget requests whose caller went away."""
        if self._current is not None and self._current.req.cancelled.is_set():
            self._current = None
        if any(r.cancelled.is_set() for r in self.waiting):
            self.waiting = collections.deque(r for r in self.waiting if not r.cancelled.is_set())

    def requests(self) -> list[Request]:
        """Every request held (waiting or being prefilled), without removing them."""
        return [*self.waiting, *([self._current.req] if self._current is not None else [])]

    def take_all(self) -> list[Request]:
        """Remove and return every request held (waiting or being prefilled)."""
        reqs = list(self.waiting)
        if self._current is not None:
            reqs.append(self._current.req)
        self.waiting, self._current = collections.deque(), None
        return reqs

    # -- one prompt in chunks -----------------------------------------------------------

    def _prefill_chunk(self, budget: int, version: int, done: list[Prefilled]) -> int:
        """Run the next chunk of the prompt in progress; returns the tokens it took from `budget`."""
        p = self._current
        assert p is not None
        n = min(budget, len(p.req.prompt_ids) - p.done)
        try:
            dev = _device(self._model)
            out = self._model(
                input_ids=torch.tensor([p.req.prompt_ids[p.done : p.done + n]], dtype=torch.long, device=dev),
                position_ids=torch.arange(p.done, p.done + n, device=dev).unsqueeze(0),
                cache=p.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        except Exception as exc:  # noqa: BLE001 - this request's prefill failed; the others go on
            log.warning("prefill of a request failed", exc_info=True)
            self._current = None
            p.req.deliver(EngineError(f"prefill failed for this request: {exc!r}"))
            return n
        p.done += n
        p.req.note_prefilled(p.done)
        self._counters["prefill_tokens"] += n
        self._counters["prefill_chunks"] += 1
        if p.done == len(p.req.prompt_ids):
            self._current = None
            kv = [(ly.keys, ly.values) for ly in p.cache.layers]
            self._cache.insert(p.req.prompt_ids, version, kv, scope=p.req.cache_scope)
            self._counters["prefills"] += 1
            done.append(Prefilled(p.req, kv, out.logits[0, -1]))
        return n

    # -- several prompts in one forward -------------------------------------------------

    def _admit_group(self, budget: int, free: int, version: int,
                     overflow_ok: bool = True) -> tuple[list[_InProgress], _InProgress | None]:
        """Admit waiting requests, in order, whose new tokens fit in `budget` together (the
        group prefilled in one forward), and the first one that does not fit (prefilled in
        chunks next), at most `free` in all. A request whose prompt equals a group member's
        joins it as a follower: the prompt is computed once and its KV and last logits serve
        both (the G rollouts of a group send the same task prompt at once; computing it G times
        cost a forward each, 0.2-0.3 s on SmolLM2-135M on one thread, and stalled every decoding
        row meanwhile). A request that shares more than a block of a group member's new tokens
        otherwise waits, so that it finds them in the prefix cache instead. Without
        `overflow_ok` (a prompt is being prefilled in chunks already), admission stops before
        the first prompt whose ids (cached or not) do not fit in what is left of `budget`."""
        group: list[_InProgress] = []
        admitted = 0
        tokens = 0
        block = self._cache.block_tokens if self._cache.enabled else 0
        while self.waiting and admitted < free:
            prompt, scope = self.waiting[0].prompt_ids, self.waiting[0].cache_scope
            leader = next((g for g in group if g.req.prompt_ids == prompt and g.req.cache_scope == scope),
                          None) if self._share_prompts else None
            if leader is not None:
                req = self.waiting.popleft()
                if self._admit(req):
                    leader.followers.append(req)
                    admitted += 1
                continue
            if block and any(g.req.cache_scope == scope and _shares_beyond(prompt, g.req.prompt_ids, g.done + block)
                             for g in group):
                break
            if not overflow_ok and tokens + len(prompt) > budget:
                break
            p = self._start(self.waiting.popleft(), version)
            if p is None:
                continue
            new = len(p.req.prompt_ids) - p.done
            if tokens + new > budget:
                return group, p
            group.append(p)
            admitted += 1
            tokens += new
        return group, None

    def _start(self, req: Request, version: int) -> _InProgress | None:
        """Admit `req` (the engine's `admit`) and seed its cache from the prefix cache."""
        if not self._admit(req):
            return None
        cache = DynamicCache(config=self._model.config)  # type: ignore[attr-defined]
        hit = self._cache.lookup(req.prompt_ids, version, max_length=len(req.prompt_ids) - 1, scope=req.cache_scope)
        if hit is None:
            return _InProgress(req, cache, 0)
        for layer, (k, v) in enumerate(hit.kv):
            cache.update(k, v, layer)
        self._counters["prefix_hits"] += 1
        self._counters["prefix_hit_tokens"] += hit.length
        req.note_prefilled(hit.length)
        return _InProgress(req, cache, hit.length)

    def _prefill_together(self, group: list[_InProgress], version: int, done: list[Prefilled]) -> int:
        """Prefill the rest of every prompt of `group` in one forward; returns the tokens computed."""
        reqs = [p.req for p in group]
        n = [len(r.prompt_ids) - p.done for r, p in zip(reqs, group, strict=True)]
        try:
            row_kv, logits_B_V = group_forward(self._model, [(p.req.prompt_ids, p.done, p.cache) for p in group])
        except Exception as exc:  # noqa: BLE001 - these requests' prefill failed; the others go on
            log.warning("prefill of %d requests failed", len(group), exc_info=True)
            for r in [*reqs, *(f for p in group for f in p.followers)]:
                r.deliver(EngineError(f"prefill failed for this request: {exc!r}"))
            return sum(n)
        self._counters["prefill_tokens"] += sum(n)
        self._counters["prefill_chunks"] += 1
        self._counters["prefill_batches"] += 1
        self._counters["prefills"] += len(group)
        for p, kv, logits_V in zip(group, row_kv, logits_B_V, strict=True):
            if self._cache.enabled:  # copies: a view would keep the whole group's buffers alive
                self._cache.insert(p.req.prompt_ids, version, [(k.clone(), v.clone()) for k, v in kv],
                                   scope=p.req.cache_scope)
            done.append(Prefilled(p.req, kv, logits_V))
            for follower in p.followers:  # the same prompt: the same KV and logits (the batch copies them)
                done.append(Prefilled(follower, kv, logits_V))
            self._counters["prefills"] += len(p.followers)
            self._counters["prefill_shared"] += len(p.followers)
            self._counters["prefix_hit_tokens"] += len(p.req.prompt_ids) * len(p.followers)
        return sum(n)


def group_forward(
    model: torch.nn.Module, rows: list[tuple[tuple[int, ...], int, Cache]]
) -> tuple[list[KV], torch.Tensor]:
    """One forward over several prompts, each with `c` ids already in its batch-1 `cache`
    (right-aligned prefixes, new ids after, padding last); fresh prompts only (every c = 0)
    go through `packed_forward` instead.

    Args:
        model: the causal LM.
        rows: B of (prompt ids, c = ids already cached, that cache: `[1, H, c, D]` per layer).

    Returns:
        (per row its KV over the whole prompt, views `[1, H, len(prompt), D]` into the group's
        buffers; logits of each prompt's last position `[B, V]`).
    """
    c = [done for _, done, _ in rows]
    n = [len(ids) - done for ids, done, _ in rows]
    B, Lc, m = len(rows), max(c), max(n)
    if Lc == 0:
        return packed_forward(model, [ids for ids, _, _ in rows])
    layers = []
    some = next(row_cache for _, done, row_cache in rows if done)
    for layer, ly in enumerate(some.layers):
        k_buf = ly.keys.new_zeros((B, ly.keys.shape[1], Lc + m, ly.keys.shape[3]))
        v_buf = ly.values.new_zeros((B, ly.values.shape[1], Lc + m, ly.values.shape[3]))
        for i, (_, done, row_cache) in enumerate(rows):
            if done:
                k_buf[i, :, Lc - done : Lc] = row_cache.layers[layer].keys[0]
                v_buf[i, :, Lc - done : Lc] = row_cache.layers[layer].values[0]
        layers.append(BufferedLayer(k_buf, v_buf, Lc))
    cache = Cache(layers=layers)
    ids = torch.zeros((B, m), dtype=torch.long)
    mask = torch.zeros((B, Lc + m), dtype=torch.long)
    for i, (prompt, done, _) in enumerate(rows):
        ids[i, : n[i]] = torch.tensor(prompt[done:], dtype=torch.long)
        mask[i, Lc - done : Lc + n[i]] = 1
    positions = torch.tensor(c, dtype=torch.long).unsqueeze(1) + torch.arange(m).unsqueeze(0)
    keep = sorted(set(k - 1 for k in n))
    dev = _device(model)  # built on the CPU, moved once
    out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=positions.to(dev), cache=cache,
                use_cache=True, logits_to_keep=torch.tensor(keep, device=dev))
    logits_B_V = out.logits[torch.arange(B, device=dev), torch.tensor([keep.index(k - 1) for k in n], device=dev)]
    row_kv = [
        [(ly.keys[i : i + 1, :, Lc - c[i] : Lc + n[i]], ly.values[i : i + 1, :, Lc - c[i] : Lc + n[i]])
         for ly in cache.layers]
        for i in range(B)
    ]
    return row_kv, logits_B_V


def packed_forward(model: torch.nn.Module, prompts: list[tuple[int, ...]]) -> tuple[list[KV], torch.Tensor]:
    """One forward over several fresh prompts packed into one row, without padding.

    Layout `[1, sum(n_i)]`: the prompts one after another, position ids restarting at 0 for
    each, a block-diagonal causal mask (a token sees its own prompt's earlier tokens only). A
    static batch pads every prompt to the longest (8 chat prompts of 32-92 ids: 736 rows
    through every matmul for 441 ids); packed, the matmuls see only the real ids.

    Returns: as `group_forward` (row i's KV: views of the packed columns of prompt i).
    """
    n = [len(p) for p in prompts]
    starts = [sum(n[:i]) for i in range(len(n))]
    total = sum(n)
    dev = _device(model)
    ids = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=dev)
    positions = torch.cat([torch.arange(k, device=dev) for k in n]).unsqueeze(0)
    segment = torch.repeat_interleave(torch.arange(len(n), device=dev), torch.tensor(n, device=dev))
    mask = (segment.unsqueeze(1) == segment.unsqueeze(0)) & torch.ones(total, total, dtype=torch.bool, device=dev).tril()
    config = model.config  # type: ignore[attr-defined]
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":  # eager adds the mask to its scores
        dtype = model.dtype  # type: ignore[attr-defined]
        mask = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill(~mask, torch.finfo(dtype).min)
    cache = DynamicCache(config=config)
    last = torch.tensor([s + k - 1 for s, k in zip(starts, n, strict=True)], device=dev)
    out = model(input_ids=ids, attention_mask=mask[None, None], position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=last)
    row_kv = [
        [(ly.keys[:, :, s : s + k], ly.values[:, :, s : s + k]) for ly in cache.layers]
        for s, k in zip(starts, n, strict=True)
    ]
    return row_kv, out.logits[0]


def fair_order(waiting: Iterable[Request], rows: Mapping[str | None, int],
               max_rows: int | None) -> tuple[collections.deque[Request], list[Request]]:
    """Split `waiting` into the requests to admit, in admission order, and those held back.

    A request that is the k-th waiting one (k = 0, 1, ...) of a session holding `rows[session]`
    rows ranks `rows[session] + k`; requests are admitted by rank, then by arrival (round robin
    between sessions, a session's own calls in its order). One whose rank is `max_rows` or more
    is held (its session would hold more than `max_rows` rows). A request without an affinity
    ranks 0 and is never held.

    Args:
        waiting: the waiting requests in arrival order.
        rows: per session (`Request.affinity`), the rows it holds now (batch and prefill).
        max_rows: a session's bound on rows; None: none.

    Returns:
        (admissible requests by rank, held requests in arrival order).
    """
    taken: dict[str, int] = {}
    ranked: list[tuple[int, int, Request]] = []
    held: list[Request] = []
    for i, req in enumerate(waiting):
        rank = 0
        if req.affinity is not None:
            rank = taken.get(req.affinity, rows.get(req.affinity, 0))
            taken[req.affinity] = rank + 1
        if max_rows is not None and rank >= max_rows:
            held.append(req)
        else:
            ranked.append((rank, i, req))
    ranked.sort(key=lambda t: (t[0], t[1]))
    return collections.deque(req for _, _, req in ranked), held


def _shares_beyond(a: tuple[int, ...], b: tuple[int, ...], k: int) -> bool:
    """Whether `a` and `b` have the same first `k` ids (both at least that long)."""
    return len(a) >= k and len(b) >= k and a[:k] == b[:k]


def _device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s weights (where its inputs go)."""
    return next(model.parameters()).device

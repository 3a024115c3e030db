"""Prefix cache of the embedded engine: key/value tensors of token-id sequences already computed.

Responsibility: remember, for sequences of token ids the engine has run through the model
(a prompt after its prefill, a prompt plus its completion when the request finishes), the
per-layer keys/values, so that a later prompt extending one of them prefills only its new
tokens. This is what an agent's turn k needs (its prompt is turn k-1's prompt plus the reply
plus the tool output) and what the G rollouts of a group need (they share the task prompt).

Keying. Entries are indexed by a chain hash of their ids in blocks of `block_tokens`:
`h_j = hash((h_{j-1}, ids[j*bs:(j+1)*bs]))`. `lookup(ids)` walks the prompt's block hashes,
keeps the entry reached by the longest matching chain, then compares ids one by one from the
start (hash collisions cannot serve a wrong prefix) and extends the match past the last full
block, so the reused length is the exact common prefix. Every entry carries the weight
version it was computed under; `lookup` only considers entries of the version asked for, and
the engine calls `clear()` when it swaps weights (KV from old weights never serves new ones).
Every entry also carries a scope (the rollout group of the request that computed it, or None):
`lookup` only considers entries of the scope asked for. A shared cache is a timing channel: a
prompt served from another session's entry comes back several times faster than one computed
afresh, so one session could read what another sent, bit by bit; within a group the rollouts share the task prompt, which is what the cache is for.

Memory bound: `max_tokens` cached token positions in total (a position costs
`2 * layers * kv_heads * head_dim * dtype_size` bytes; `bytes_per_token` reports it once an
entry is stored); least-recently-used entries are evicted first. An entry that is a prefix of
a newer one is dropped when the newer one is stored (it would never be the longest match).

Shapes: an entry holds, per layer, keys and values `[1, H_kv, n, D]` (batch 1). `lookup`
returns views of the first `m` columns; callers must not write into them (a transformers
`DynamicLayer` concatenates into new tensors, which is safe).
Not thread-safe: owned by the engine's decode thread. What it does not do: share memory
between entries (paged blocks), or keep entries across weight versions.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each `[1, H_kv, n, D]`."""


@dataclass(slots=True)
class _Entry:
    key: int
    ids: tuple[int, ...]
    version: int
    kv: KV
    hashes: list[int]
    scope: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A reusable prefix: the first `length` ids of the prompt, and their keys/values."""

    length: int
    kv: KV
    """Per layer (keys, values) views `[1, H_kv, length, D]`."""


class PrefixCache:
    """LRU cache of per-layer KV keyed by token-id prefixes and weight version."""

    def __init__(self, max_tokens: int, block_tokens: int = 16) -> None:
        """Args:
            max_tokens: most token positions held over all entries; 0 disables the cache.
            block_tokens: granularity of the hash index (ids per block), >= 1.

        Raises:
            ValueError: a negative `max_tokens` or `block_tokens` < 1.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 0")
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} must be >= 1")
        self.max_tokens = max_tokens
        self.block_tokens = block_tokens
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # LRU order
        self._index: dict[int, dict[int, None]] = {}  # block-chain hash -> entry keys
        self._next_key = itertools.count()
        self._tokens = 0
        self.bytes_per_token = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @property
    def num_tokens(self) -> int:
        """Token positions held now."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, ids: tuple[int, ...], version: int, scope: str | None) -> list[int]:
        bs = self.block_tokens
        h = hash(("harnessrl-prefix", version, scope))
        out = []
        for j in range(len(ids) // bs):
            h = hash((h, ids[j * bs : (j + 1) * bs]))
            out.append(h)
        return out

    def lookup(self, ids: tuple[int, ...], version: int, max_length: int | None = None, *,
               scope: str | None = None) -> PrefixHit | None:
        """The longest cached prefix of `ids` computed under weights `version` in `scope`, at most
        `max_length` ids (default `len(ids)`); None when no full block matches.
        A hit moves its entry to the most-recently-used end."""
        if not self._entries:
            return None
        limit = len(ids) if max_length is None else min(max_length, len(ids))
        best: _Entry | None = None
        for h in self._chain(ids[:limit], version, scope):
            keys = self._index.get(h)
            if not keys:
                break
            best = self._entries[next(reversed(keys))]
        if best is None or best.version != version or best.scope != scope:
            return None
        n = min(limit, len(best.ids))
        m = 0
        while m < n and best.ids[m] == ids[m]:
            m += 1
        if m == 0:
            return None
        self._entries.move_to_end(best.key)
        return PrefixHit(m, [(k[:, :, :m], v[:, :, :m]) for k, v in best.kv])

    def insert(self, ids: tuple[int, ...], version: int, kv: KV, *, scope: str | None = None) -> bool:
        """Store the KV of `ids` (each tensor `[1, H_kv, len(ids), D]`) for `scope`; True when stored.

        Not stored: a disabled cache, fewer ids than one block, more ids than `max_tokens`,
        or `ids` already covered by an entry of the same version. Entries that are prefixes of
        `ids` are dropped; then LRU entries are evicted until the bound holds.
        """
        n = len(ids)
        if not self.enabled or n < self.block_tokens or n > self.max_tokens:
            return False
        assert all(k.shape[-2] == n and v.shape[-2] == n for k, v in kv), "KV length differs from len(ids)"
        covered = self.lookup(ids, version, scope=scope)
        if covered is not None and covered.length == n:
            return False
        hashes = self._chain(ids, version, scope)
        for j, h in enumerate(hashes):  # entries whose ids are a prefix of `ids` end in block j
            for key in list(self._index.get(h, {})):
                old = self._entries[key]
                if (len(old.hashes) == j + 1 and len(old.ids) <= n and old.scope == scope
                        and ids[: len(old.ids)] == old.ids):
                    self._drop(key)
        entry = _Entry(next(self._next_key), ids, version, kv, hashes, scope)
        self._entries[entry.key] = entry
        for h in hashes:
            self._index.setdefault(h, {})[entry.key] = None
        self._tokens += n
        if not self.bytes_per_token:
            self.bytes_per_token = sum(k[0, :, :1].numel() * k.element_size() * 2 for k, _ in kv)
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        return True

    def clear(self) -> None:
        """Drop every entry (the engine calls this when it swaps weights)."""
        self._entries.clear()
        self._index.clear()
        self._tokens = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._tokens -= len(entry.ids)
        for h in entry.hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._index[h]

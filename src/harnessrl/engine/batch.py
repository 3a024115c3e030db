"""The decode batch: a left-padded KV cache of B sequences, their attention mask and positions.

Responsibility: hold the per-layer key/value tensors of every active sequence in one batch so
that a decode step is one forward over `[B, 1]` new ids; let a freshly prefilled sequence join
(`add`) and finished ones leave (`remove`) between steps.

Layout (shapes per layer): keys/values `[B, H_kv, L, D]`, left-padded: row b's real tokens
occupy the last `n_b` columns; `mask_B_L[b, j]` is 1 on real columns, 0 on padding;
`positions_B[b]` is the position id of row b's next input (= its number of real tokens), so
each row sees the same position ids as it would alone, and padding is invisible to attention.
The buffers keep spare room along L (amortised doubling), so a decode step writes the new
key/value column in place instead of re-concatenating the whole cache (what `DynamicLayer`
does each step, an O(B*L) copy per layer per step).

What it deliberately does not do: paged/blocked memory, prefix sharing (the prefix cache,
`engine/prefix_cache.py`, keeps its own copies: `row_kv`), sliding-window layers (only
full-attention `DynamicLayer` models such as Llama/SmolLM2/Qwen2), prefill (the engine
prefills each prompt in its own batch-1 cache, in chunks, and `add`s it).
Invariant: after `trim`, column 0 is real for at least one row (no all-padding columns).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_SPARE_COLS = 64


def _with_room(t_B_H_L_D: torch.Tensor, total_cols: int, batch: int | None = None) -> torch.Tensor:
    """A zeroed buffer `[batch, H, total_cols, D]` shaped like `t` (batch defaults to t's)."""
    b, h, _, d = t_B_H_L_D.shape
    return t_B_H_L_D.new_zeros((batch if batch is not None else b, h, total_cols, d))


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of buffers with spare columns.

    `update` writes the new columns in place (growing the buffer by doubling when full) and
    returns views of the filled part, shape `[B, H, n, D]`.
    """

    def __init__(self, keys_buf: torch.Tensor, values_buf: torch.Tensor, length: int) -> None:
        super().__init__()
        assert keys_buf.shape == values_buf.shape, "keys and values buffers differ in shape"
        self.device = keys_buf.device
        self.is_initialized = True
        self._k_buf, self._v_buf = keys_buf, values_buf
        self.keys = keys_buf[:, :, :length]
        self.values = values_buf[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if n + m > self._k_buf.shape[-2]:
            cols = max(2 * n, n + m + _MIN_SPARE_COLS)
            k_buf, v_buf = _with_room(self._k_buf, cols), _with_room(self._v_buf, cols)
            k_buf[:, :, :n] = self.keys
            v_buf[:, :, :n] = self.values
            self._k_buf, self._v_buf = k_buf, v_buf
        self._k_buf[:, :, n : n + m] = key_states
        self._v_buf[:, :, n : n + m] = value_states
        self.keys = self._k_buf[:, :, : n + m]
        self.values = self._v_buf[:, :, : n + m]
        return self.keys, self.values


class KVBatch:
    """Mutable state of the running batch; owned by one thread (the engine's decode thread)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.cache: Cache | None = None
        self.mask_B_L = torch.zeros((0, 0), dtype=torch.long)
        self.positions_B = torch.zeros((0,), dtype=torch.long)
        self.last_ids_B = torch.zeros((0,), dtype=torch.long)

    @property
    def size(self) -> int:
        return int(self.positions_B.shape[0])

    @property
    def length(self) -> int:
        """L: columns of the cache (longest row, including padding)."""
        return int(self.mask_B_L.shape[1])

    def add(self, prefilled: Cache, prompt_len: int, first_id: int) -> None:
        """Append one prefilled sequence (batch 1, `prompt_len` columns) as a new last row.

        Its next input is `first_id` (the id sampled from the prefill logits) at position
        `prompt_len`. Costs one copy of the whole cache (only at admission).
        """
        kv = []
        for layer in prefilled.layers:
            assert layer.keys is not None and layer.values is not None, "prefill cache has an empty layer"
            kv.append((layer.keys, layer.values))
        self.add_rows([(kv, prompt_len, first_id)])

    def add_rows(self, rows: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]]) -> None:
        """Append prefilled sequences as new last rows, in order, with one copy of the cache.

        Each row is `(kv, prompt_len, first_id)`: per layer (keys, values) `[1, H, prompt_len, D]`
        (views are fine: they are copied), and the id its next step feeds at position `prompt_len`.
        """
        if not rows:
            return
        B, L = self.size, self.length
        new_L = max(L, *(n for _, n, _ in rows))
        cols = new_L + _MIN_SPARE_COLS
        R = len(rows)
        layers: list[BufferedLayer] = []
        for i in range(len(rows[0][0])):
            k0, v0 = rows[0][0][i]
            assert k0.shape[0] == 1, "prefill cache must be batch 1"
            k_buf = _with_room(k0, cols, batch=B + R)
            v_buf = _with_room(v0, cols, batch=B + R)
            if self.cache is not None and B > 0:
                old = self.cache.layers[i]
                k_buf[:B, :, new_L - L : new_L] = old.keys
                v_buf[:B, :, new_L - L : new_L] = old.values
            for r, (kv, n, _) in enumerate(rows):
                k_new, v_new = kv[i]
                assert k_new.shape[-2] == n and v_new.shape[-2] == n, "row KV length differs from its prompt_len"
                k_buf[B + r, :, new_L - n : new_L] = k_new[0]
                v_buf[B + r, :, new_L - n : new_L] = v_new[0]
            layers.append(BufferedLayer(k_buf, v_buf, new_L))
        self.cache = Cache(layers=layers)
        mask = torch.zeros((B + R, new_L), dtype=torch.long)
        mask[:B, new_L - L :] = self.mask_B_L
        for r, (_, n, _) in enumerate(rows):
            mask[B + r, new_L - n :] = 1
        self.mask_B_L = mask
        self.positions_B = torch.cat([self.positions_B, torch.tensor([n for _, n, _ in rows])])
        self.last_ids_B = torch.cat([self.last_ids_B, torch.tensor([t for _, _, t in rows])])

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s real columns per layer: (keys, values), each `[1, H, n, D]`
        with n = the row's tokens fed so far (its position); for the prefix cache."""
        assert self.cache is not None and 0 <= row < self.size, f"no row {row} in a batch of {self.size}"
        n = int(self.positions_B[row])
        L = self.length
        return [
            (layer.keys[row : row + 1, :, L - n :].clone(), layer.values[row : row + 1, :, L - n :].clone())
            for layer in self.cache.layers
        ]

    def step_inputs(self) -> dict[str, torch.Tensor | Cache]:
        """Model kwargs for one decode step: ids `[B, 1]`, mask `[B, L+1]`, positions `[B, 1]`."""
        assert self.cache is not None and self.size > 0, "decode step on an empty batch"
        ones_B_1 = torch.ones((self.size, 1), dtype=torch.long)
        return {
            "input_ids": self.last_ids_B.unsqueeze(-1),
            "attention_mask": torch.cat([self.mask_B_L, ones_B_1], dim=1),
            "position_ids": self.positions_B.unsqueeze(-1),
            "cache": self.cache,
        }

    def commit_step(self, attention_mask_B_L: torch.Tensor, next_ids: list[int]) -> None:
        """Record that the step consumed one column per row and which ids feed the next step."""
        self.mask_B_L = attention_mask_B_L
        self.positions_B = self.positions_B + 1
        self.last_ids_B = torch.tensor(next_ids, dtype=torch.long)

    def remove(self, rows: list[int]) -> None:
        """Drop the given row indices, then trim leading all-padding columns."""
        if not rows:
            return
        keep = [b for b in range(self.size) if b not in set(rows)]
        if not keep:
            self._reset()
            return
        keep_t = torch.tensor(keep, dtype=torch.long)
        mask = self.mask_B_L.index_select(0, keep_t)
        first_real = int(torch.nonzero(mask.any(dim=0))[0, 0])
        new_L = mask.shape[1] - first_real
        assert self.cache is not None, "rows to remove from an empty batch"
        layers: list[BufferedLayer] = []
        for old in self.cache.layers:
            k_buf = _with_room(old.keys, new_L + _MIN_SPARE_COLS, batch=len(keep))
            v_buf = _with_room(old.values, new_L + _MIN_SPARE_COLS, batch=len(keep))
            k_buf[:, :, :new_L] = old.keys.index_select(0, keep_t)[:, :, first_real:]
            v_buf[:, :, :new_L] = old.values.index_select(0, keep_t)[:, :, first_real:]
            layers.append(BufferedLayer(k_buf, v_buf, new_L))
        self.cache = Cache(layers=layers)
        self.mask_B_L = mask[:, first_real:].contiguous()
        self.positions_B = self.positions_B.index_select(0, keep_t)
        self.last_ids_B = self.last_ids_B.index_select(0, keep_t)

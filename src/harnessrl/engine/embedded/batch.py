"""The decode batch: the KV cache of B sequences in slots, their positions and the ids they feed next.

Responsibility: hold the per-layer key/value tensors of every active sequence in one batch so
that a decode step is one forward over `[B, 1]` new ids; let freshly prefilled sequences join
(`add_rows`) and finished ones leave (`remove`) between steps, without copying the others.

Layout (shapes per layer): preallocated buffers keys/values `[S, H_kv, C, D]` (S slots >= B,
C columns, both grown by doubling). Row b holds its n_b tokens in columns `[0, n_b)` of slot b
(right-padded); `positions_B[b] = n_b` is the position id of its next input and the column a
decode step writes that input's key/value into (`SlotLayer.update`, one indexed write per
layer, in place). Attention runs over the first `L = max_b n_b + 1` columns with the mask
`column <= n_b` (`step_mask`), so a row sees exactly its own tokens and the stale or zero
columns past its end are invisible; rotary position ids are applied before the write, so a
row's keys do not depend on where it sits. A row joining writes only its own KV into a free
slot; a row leaving moves the rows after it down one slot (their real columns only); the
buffers shrink when they hold more than twice what the rows need.

What it deliberately does not do: paged/blocked memory, prefix sharing (the prefix cache,
`engine/embedded/prefix_cache.py`, keeps its own copies: `row_kv`), sliding-window layers (only
full-attention `DynamicLayer` models such as Llama/SmolLM2/Qwen2), prefill (the engine
prefills prompts in their own caches, `engine/embedded/prefill.py`, and adds them).
`BufferedLayer` (a left-aligned buffer with spare columns) is the prefill scheduler's layout
for several prompts in one forward.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_SPARE_COLS = 64
_MIN_SLOTS = 4


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


class SlotLayer(DynamicLayer):
    """One layer of a `KVBatch`: `update` writes row b's new key/value at column `positions_B[b]`
    of its slot and returns views `[B, H, L, D]` of the columns a step attends over."""

    def __init__(self, batch: KVBatch, index: int) -> None:
        super().__init__()
        self.is_initialized = True
        self._batch, self._index = batch, index
        self.device = batch._k[index].device
        self.keys, self.values = batch.views(index)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert key_states.shape[-2] == 1, "a KVBatch layer takes one new column per step (decode only)"
        self.keys, self.values = self._batch.write(self._index, key_states, value_states)
        return self.keys, self.values


class KVBatch:
    """Mutable state of the running batch; owned by one thread (the engine's decode thread)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        """Where the KV buffers and the per-row index tensors live (the model's device)."""
        self._reset()

    def _reset(self) -> None:
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self.cache: Cache | None = None
        self.lengths: list[int] = []
        """n_b per row (Python ints: no tensor read per step)."""
        self.positions_B = torch.zeros((0,), dtype=torch.long, device=self.device)
        self.last_ids_B = torch.zeros((0,), dtype=torch.long, device=self.device)
        self._rows_B = torch.zeros((0,), dtype=torch.long, device=self.device)
        self._step_cols = 0

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """Columns holding a real token of some row (the longest row's n_b)."""
        return max(self.lengths, default=0)

    @property
    def capacity(self) -> tuple[int, int]:
        """(slots, columns) of the buffers."""
        return (int(self._k[0].shape[0]), int(self._k[0].shape[2])) if self._k else (0, 0)

    # -- what the layers call -----------------------------------------------------------

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values `[B, H, L, D]` of `layer` over the columns the next step attends to."""
        B, L = self.size, self._step_cols
        return self._k[layer][:B, :, :L], self._v[layer][:B, :, :L]

    def write(self, layer: int, k_B_H_1_D: torch.Tensor, v_B_H_1_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's key/value of every row at its own column; returns `views(layer)`."""
        self._k[layer][self._rows_B, :, self.positions_B] = k_B_H_1_D[:, :, 0]
        self._v[layer][self._rows_B, :, self.positions_B] = v_B_H_1_D[:, :, 0]
        return self.views(layer)

    # -- rows joining and leaving -------------------------------------------------------

    def add_rows(self, rows: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]]) -> None:
        """Append prefilled sequences as new last rows, in order; copies only their KV.

        Each row is `(kv, prompt_len, first_id)`: per layer (keys, values) `[1, H, prompt_len, D]`
        (views are fine: they are copied), and the id its next step feeds at position `prompt_len`.
        """
        if not rows:
            return
        B, R = self.size, len(rows)
        need_cols = max(self.length, *(n for _, n, _ in rows)) + 1
        self._ensure(B + R, need_cols, like=rows[0][0])
        for r, (kv, n, _) in enumerate(rows):
            assert len(kv) == len(self._k), "row KV has another number of layers than the batch"
            for i, (k_new, v_new) in enumerate(kv):
                assert k_new.shape[0] == 1, "prefill cache must be batch 1"
                assert k_new.shape[-2] == n and v_new.shape[-2] == n, "row KV length differs from its prompt_len"
                self._k[i][B + r, :, :n] = k_new[0]
                self._v[i][B + r, :, :n] = v_new[0]
        self.lengths.extend(n for _, n, _ in rows)
        self.positions_B = torch.cat([self.positions_B, self._long([n for _, n, _ in rows])])
        self.last_ids_B = torch.cat([self.last_ids_B, self._long([t for _, _, t in rows])])
        self._rows_B = torch.arange(self.size, device=self.device)

    def remove(self, rows: list[int]) -> None:
        """Drop the given row indices; the rows after them move down (order kept)."""
        if not rows:
            return
        gone = set(rows)
        keep = [b for b in range(self.size) if b not in gone]
        if not keep:
            self._reset()
            return
        moved = [(j, b) for j, b in enumerate(keep) if j != b]
        if moved:
            dst = self._long([j for j, _ in moved])
            src = self._long([b for _, b in moved])
            L = max(self.lengths[b] for _, b in moved)
            for buf in (*self._k, *self._v):
                buf[dst, :, :L] = buf[src, :, :L]  # the right side is gathered first: no overlap
        keep_t = self._long(keep)
        self.lengths = [self.lengths[b] for b in keep]
        self.positions_B = self.positions_B.index_select(0, keep_t)
        self.last_ids_B = self.last_ids_B.index_select(0, keep_t)
        self._rows_B = torch.arange(self.size, device=self.device)
        slots, cols = self.capacity
        if cols > 2 * (self.length + 1) + _MIN_SPARE_COLS or slots > 2 * max(self.size, _MIN_SLOTS):
            self._resize(max(self.size, _MIN_SLOTS), self.length + 1 + _MIN_SPARE_COLS)

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s real columns per layer: (keys, values), each `[1, H, n, D]`
        with n = the row's tokens fed so far (its position); for the prefix cache."""
        assert 0 <= row < self.size, f"no row {row} in a batch of {self.size}"
        n = self.lengths[row]
        return [(k[row : row + 1, :, :n].clone(), v[row : row + 1, :, :n].clone()) for k, v in zip(self._k, self._v)]

    # -- one decode step ----------------------------------------------------------------

    def step_mask(self) -> torch.Tensor:
        """Bool `[B, 1, 1, L]`, True where row b attends column j (j <= n_b); L = longest row + 1."""
        L = self.length + 1
        return (torch.arange(L, device=self.device).unsqueeze(0) <= self.positions_B.unsqueeze(1))[:, None, None, :]

    def step_inputs(self, additive_mask: torch.dtype | None = None) -> dict[str, torch.Tensor | Cache]:
        """Model kwargs for one decode step: ids `[B, 1]`, the 4D bool mask of `step_mask` (or,
        with `additive_mask` a float dtype, 0 where attended and the dtype's min elsewhere, what
        eager attention adds to its scores), positions `[B, 1]`, the cache (writes in place)."""
        assert self.cache is not None and self.size > 0, "decode step on an empty batch"
        need = self.length + 1
        if need > self.capacity[1]:
            self._resize(self.capacity[0], max(2 * self.capacity[1], need + _MIN_SPARE_COLS))
        self._step_cols = need
        mask = self.step_mask()
        if additive_mask is not None:
            mask = torch.zeros(mask.shape, dtype=additive_mask, device=self.device).masked_fill(
                ~mask, torch.finfo(additive_mask).min)
        return {
            "input_ids": self.last_ids_B.unsqueeze(-1),
            "attention_mask": mask,
            "position_ids": self.positions_B.unsqueeze(-1),
            "cache": self.cache,
        }

    def commit_step(self, next_ids: list[int]) -> None:
        """Record that the step consumed one column per row and which ids feed the next step."""
        self.lengths = [n + 1 for n in self.lengths]
        self.positions_B = self.positions_B + 1
        self.last_ids_B = self._long(next_ids)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # -- buffers ------------------------------------------------------------------------

    def _ensure(self, slots: int, cols: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self._k:
            self._k = [_with_room(k, cols + _MIN_SPARE_COLS, batch=max(slots, _MIN_SLOTS)) for k, _ in like]
            self._v = [_with_room(v, cols + _MIN_SPARE_COLS, batch=max(slots, _MIN_SLOTS)) for _, v in like]
            self.cache = Cache(layers=[SlotLayer(self, i) for i in range(len(self._k))])
            return
        have_slots, have_cols = self.capacity
        if slots > have_slots or cols > have_cols:
            self._resize(max(slots, 2 * have_slots if slots > have_slots else have_slots),
                         max(cols + _MIN_SPARE_COLS, 2 * have_cols) if cols > have_cols else have_cols)

    def _resize(self, slots: int, cols: int) -> None:
        """New buffers `[slots, H, cols, D]` holding the rows' real columns."""
        B, L = self.size, self.length
        assert slots >= B and cols > L, f"buffers of {slots}x{cols} cannot hold {B} rows of {L}"
        for bufs in (self._k, self._v):
            for i, old in enumerate(bufs):
                new = _with_room(old, cols, batch=slots)
                new[:B, :, :L] = old[:B, :, :L]
                bufs[i] = new

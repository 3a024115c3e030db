"""Padding-free packing of rows into micro-batches, and the trainer's logprobs on a pack.

Responsibility:
  * `plan_micro_batches` / `pack_rows`: first-fit-decreasing bin packing of rows under a token
    budget; each micro-batch is one sequence `[1, T]` (rows concatenated, no padding) with
    `position_ids` restarting at 0 at every row start.
  * `compute_trainer_logprobs`: `log_softmax(logits / temperature)` at each trained token, in
    float32, from one forward pass over the pack.

Row isolation. The forward passes `position_ids` and no attention mask (and `use_cache=False`).
transformers (>= 4.5x, checked on 5.x for Llama with sdpa and eager) then detects the packed
rows from the position resets (`masking_utils.find_packed_sequence_indices`) and builds a
block-diagonal causal mask, so no token attends across rows. With sdpa/eager that mask is a
dense [T, T] boolean (64 MiB at T = 8192) and attention is computed over all T x T pairs, so
memory and time are quadratic in the pack length. `compute_trainer_logprobs` therefore runs
sdpa models under the segment attention (`SEGMENT_ATTENTION`, `segment_attention`): no mask
is built, and each layer runs causal SDPA once per row segment (segments found from the
position resets), so cost is sum(n_row^2) instead of T^2 and memory is linear in T for a given
row length. Any other call (a 2D padding mask, a KV cache, batch > 1) falls through to plain
sdpa. `tests/test_packing.py` checks that a row's logprobs inside a pack equal those computed
alone, and that segment and dense-mask logprobs agree (1e-5, float32). `flash_attention_2` on
GPU takes the same position ids and runs varlen kernels; models not on sdpa keep their own.

Shared prefixes (`pack_rows(..., share_prefixes=True)`, the default). Rows that start with
the same context (the G rollouts of a group share the task prompt; a FORK row shares its
rollout's history up to the fork) pay for it once: a row whose first `p >= MIN_SHARED_TOKENS`
ids equal the first `p` ids of an earlier row of its pack (the unit's root), and whose first
`p + 1` ids are all context (mask 0), is stored as a *branch*: only `row[p:]`, with position
ids `p..n-1`, attending to the root's first `p` positions and then causally to itself
(`PackedBatch.segments` records `(start, end, ctx_start, ctx_len)` per segment). The shared
positions compute exactly what they compute in the root (same ids, same positions, causal), so
every row's logprobs equal those of the row alone and the gradient equals the sum of the
unshared rows' (the root's positions receive the branches' gradient too); tested to 1e-5 in
float32 (`tests/test_packing.py`). Only the segment attention runs branches natively; a model
on another attention implementation, or `attention="dense"`, gets the pack expanded back to
whole rows first (`unshare`: same values, no saving). Trained tokens are never shared (a
branch's shared part is context in it), so each trained token keeps its row's advantage,
sampler logprob and sequence id.

Oversized rows: a row longer than the budget gets a micro-batch of its own; rows are never
dropped or truncated (a too-long row is the trainer's memory problem to report, not a silent
loss of training signal). `PackPlan.num_oversized` counts them.

Logprob convention: the value at index t is the logprob of `input_ids[t]` given the tokens
before it in its row, i.e. computed from the logits at t-1 (shift by one). Logits are computed
only at the positions that predict a trained token (`logits_to_keep` with an index tensor),
so the vocabulary projection and the log-softmax never run on context-only positions; the
log-softmax and the gather of the sampled ids run as one function with a hand-written backward
(`train/token_logprobs.py`), which keeps one float32 [K, V] tensor where autograd through `logsumexp`
and `gather` filled four.

What this module does not do: choose the budget, run the optimizer, or compute losses.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from harnessrl.loss.losses import LossInputs
from harnessrl.train.distributed import inner_module
from harnessrl.train.samples import common_prefix_len
from harnessrl.train.token_logprobs import token_logprobs
from harnessrl.types import Row


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """One micro-batch: rows concatenated padding-free. Every `_T` tensor has shape [T]."""

    input_ids_T: torch.Tensor
    """int64 token ids."""
    position_ids_T: torch.Tensor
    """int64, 0..len(row)-1 for each row in turn."""
    mask_T: torch.Tensor
    """bool: trained (sampled) tokens."""
    sampler_logprobs_T: torch.Tensor
    """float32: engine logprob per trained token, 0 elsewhere."""
    advantages_T: torch.Tensor
    """float32: the row's advantage on each of its tokens."""
    seq_ids_T: torch.Tensor
    """int64: index (into the rows given to `pack_rows`) of the row each token belongs to."""
    policy_versions_T: torch.Tensor
    """int64: engine weight version of each trained token, -1 elsewhere."""
    row_indices: tuple[int, ...]
    """Indices of the packed rows in the input sequence, in pack order."""
    segments: tuple[tuple[int, int, int, int], ...] = ()
    """`(start, end, ctx_start, ctx_len)` per segment, in pack order: tokens `[start, end)`
    attend to pack positions `[ctx_start, ctx_start + ctx_len)` (a shared prefix; ctx_len 0
    for a whole row) and causally to themselves. Empty: whole rows, found from the position
    resets (`segment_bounds`)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    @property
    def shared_tokens(self) -> int:
        """Context positions not re-forwarded: the sum of the branches' shared prefix lengths."""
        return sum(seg[3] for seg in self.segments)

    @property
    def num_trained_tokens(self) -> int:
        return int(self.mask_T.sum().item())


@dataclass(frozen=True, slots=True)
class PackPlan:
    """Which rows go in which micro-batch."""

    bins: tuple[tuple[int, ...], ...]
    """Row indices per micro-batch."""
    num_oversized: int
    """Rows longer than the budget (each alone in its micro-batch)."""


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> PackPlan:
    """First-fit-decreasing bin packing of row lengths into bins of `token_budget` tokens.

    Rows are placed longest first into the first bin with room (Johnson 1973: at most
    11/9 OPT + 6/9 bins). A row longer than the budget gets its own bin.

    Raises:
        ValueError: `token_budget` < 1 or a length < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    oversized = 0
    for i in order:
        n = lengths[i]
        if n < 1:
            raise ValueError(f"row {i} has length {n}; rows must hold >= 1 token")
        if n > token_budget:
            oversized += 1
            bins.append([i])
            room.append(0)
            continue
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(token_budget - n)
    return PackPlan(tuple(tuple(b) for b in bins), oversized)


MIN_SHARED_TOKENS = 32
"""Shortest shared prefix worth a branch (shorter ones are re-forwarded as whole rows)."""


def pack_rows(rows: Sequence[Row], token_budget: int, *, share_prefixes: bool = True) -> list[PackedBatch]:
    """Pack `rows` into padding-free micro-batches of at most `token_budget` tokens each
    (an oversized row alone in its own). Advantages are read from `Row.advantage`.

    `share_prefixes`: a row sharing a context prefix with a longer row is stored as a branch
    of it (module docstring), so the pack holds the shared ids once; False packs whole rows.

    Raises:
        ValueError: `token_budget` < 1, an empty row, or a row that trains its first token.
    """
    if not share_prefixes:
        plan = plan_micro_batches([len(r.input_ids) for r in rows], token_budget)
        return [_concat(rows, [(i, 0) for i in b]) for b in plan.bins]
    units = _shared_units(rows, token_budget)
    plan = plan_micro_batches([sum(len(rows[i].input_ids) - p for i, p in u) for u in units], token_budget)
    return [_concat(rows, [m for u in b for m in units[u]]) for b in plan.bins]


def _shared_units(rows: Sequence[Row], token_budget: int) -> list[list[tuple[int, int]]]:
    """Rows grouped into units `[(root, 0), (branch, p), ...]`, longest rows first; a row joins
    the unit whose root shares the longest usable prefix with it (>= MIN_SHARED_TOKENS, its
    first p + 1 ids context) when the unit stays within the budget."""
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].input_ids), i))
    units: list[list[tuple[int, int]]] = []
    sizes: list[int] = []
    roots_by_head: dict[tuple[int, ...], list[int]] = {}  # first MIN_SHARED_TOKENS ids -> units
    for i in order:
        ids, n = rows[i].input_ids, len(rows[i].input_ids)
        mask = rows[i].completion_mask
        first_trained = mask.index(1) if 1 in mask else n
        head = tuple(ids[:MIN_SHARED_TOKENS])
        best, best_p = -1, 0
        if first_trained > MIN_SHARED_TOKENS:
            for u in roots_by_head.get(head, ()):
                root_ids = rows[units[u][0][0]].input_ids
                p = min(common_prefix_len(root_ids, ids), first_trained - 1)
                if p >= MIN_SHARED_TOKENS and p > best_p and sizes[u] + n - p <= token_budget:
                    best, best_p = u, p
        if best >= 0:
            units[best].append((i, best_p))
            sizes[best] += n - best_p
            continue
        units.append([(i, 0)])
        sizes.append(n)
        if len(head) == MIN_SHARED_TOKENS:
            roots_by_head.setdefault(head, []).append(len(units) - 1)
    return units


def _concat(rows: Sequence[Row], members: Sequence[tuple[int, int]]) -> PackedBatch:
    """Concatenate `(row index, shared prefix p)` members: p = 0 starts a unit (its root), p > 0
    is a branch of the last root, stored from id p on."""
    ids: list[int] = []
    pos: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    advs: list[float] = []
    seq: list[int] = []
    vers: list[int] = []
    segments: list[tuple[int, int, int, int]] = []
    root_start = 0
    for i, p in members:
        row = rows[i]
        n = len(row.input_ids)
        if n < 1:
            raise ValueError(f"row {i} has length {n}; rows must hold >= 1 token")
        if row.completion_mask and row.completion_mask[0]:
            raise ValueError(f"row {i} trains its first token, which has no left context")
        start = len(ids)
        if p == 0:
            root_start = start
        ids.extend(row.input_ids[p:])
        pos.extend(range(p, n))
        mask.extend(row.completion_mask[p:])
        lps.extend(row.sampler_logprobs[p:])
        advs.extend([row.advantage] * (n - p))
        seq.extend([i] * (n - p))
        vers.extend(row.policy_versions[p:])
        segments.append((start, len(ids), root_start, p))
    return PackedBatch(
        input_ids_T=torch.tensor(ids, dtype=torch.long),
        position_ids_T=torch.tensor(pos, dtype=torch.long),
        mask_T=torch.tensor(mask, dtype=torch.bool),
        sampler_logprobs_T=torch.tensor(lps, dtype=torch.float32),
        advantages_T=torch.tensor(advs, dtype=torch.float32),
        seq_ids_T=torch.tensor(seq, dtype=torch.long),
        policy_versions_T=torch.tensor(vers, dtype=torch.long),
        row_indices=tuple(i for i, _ in members),
        segments=tuple(segments),
    )


def unshare(packed: PackedBatch) -> tuple[PackedBatch, torch.Tensor]:
    """`packed` with every branch expanded back to its whole row (its shared prefix copied in
    front), and the index `[T]` of each of `packed`'s positions in the expanded pack, so that
    `expanded_values[index]` are `packed`'s values. Returns `packed` itself when it has no branch."""
    if not packed.shared_tokens:
        return packed, torch.arange(packed.num_tokens)
    parts: list[torch.Tensor] = []
    owners: list[torch.Tensor] = []
    index: list[torch.Tensor] = []
    new_segments: list[tuple[int, int, int, int]] = []
    length = 0
    for start, end, ctx_start, ctx_len in packed.segments:
        own = torch.arange(start, end)
        parts.append(torch.cat([torch.arange(ctx_start, ctx_start + ctx_len), own]))
        owners.append(torch.cat([torch.full((ctx_len,), start), own]))  # the copied prefix is the branch's
        n = ctx_len + end - start
        index.append(torch.arange(length + ctx_len, length + n))
        new_segments.append((length, length + n, length, 0))
        length += n
    src_T, owner_T = torch.cat(parts), torch.cat(owners)
    context_only = torch.ones(length, dtype=torch.bool)
    context_only[torch.cat(index)] = False  # copied prefixes: context in the branch's row

    def take(t: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        return t[src_T].masked_fill(context_only, fill)

    expanded = PackedBatch(
        input_ids_T=packed.input_ids_T[src_T],
        position_ids_T=packed.position_ids_T[src_T],
        mask_T=take(packed.mask_T, False),
        sampler_logprobs_T=take(packed.sampler_logprobs_T, 0.0),
        advantages_T=packed.advantages_T[owner_T],
        seq_ids_T=packed.seq_ids_T[owner_T],
        policy_versions_T=take(packed.policy_versions_T, -1),
        row_indices=packed.row_indices,
        segments=tuple(new_segments),
    )
    return expanded, torch.cat(index)


SEGMENT_ATTENTION = "harnessrl_segments"
"""transformers attention implementation name of the per-row segment attention."""


def segment_bounds(position_ids_T: torch.Tensor) -> list[tuple[int, int]]:
    """`[start, end)` of each row of a pack: a row starts where the position does not
    continue the previous one (`pos[t] != pos[t-1] + 1`), and at t = 0."""
    T = int(position_ids_T.shape[-1])
    starts = (torch.nonzero(position_ids_T[1:] != position_ids_T[:-1] + 1).flatten() + 1).tolist()
    edges = [0, *starts, T]
    return list(zip(edges[:-1], edges[1:], strict=True))


_PACK_SEGMENTS: contextvars.ContextVar[tuple[tuple[int, int, int, int], ...]] = contextvars.ContextVar(
    "harnessrl_pack_segments", default=()
)
"""The segments of the pack being forwarded (`PackedBatch.segments`), set by `segment_attention`."""


def _segment_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per segment of a packed `[1, H, T, D]` sequence; output `[1, T, H, D]`.
    A branch segment attends to its shared prefix (all of it) and then causally to itself."""
    position_ids = kwargs.get("position_ids")
    if (
        attention_mask is not None
        or position_ids is None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    segments = _PACK_SEGMENTS.get()
    if not segments or segments[-1][1] != query.shape[2]:
        segments = tuple((s, e, s, 0) for s, e in segment_bounds(position_ids.reshape(-1)))
    outs = []
    for s, e, cs, cl in segments:
        with _kernel_for(query.device, cl + e - s):
            outs.append(_one_segment(module, query, key, value, s, e, cs, cl, kwargs))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


MATH_KV_MAX = 128
"""On CPU, a segment attending to at most this many keys runs SDPA's math kernel instead of
the flash one: for short rows its backward is cheaper (the logprobs agree within 1.4e-5 in
float32). The math kernel keeps the [H, n, keys] probabilities for the backward,
at most T x 128 x H floats a layer, so longer segments keep flash's linear memory."""


def _kernel_for(device: torch.device, n_keys: int) -> contextlib.AbstractContextManager[None]:
    if device.type == "cpu" and n_keys <= MATH_KV_MAX:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _one_segment(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 s: int, e: int, cs: int, cl: int, kwargs: dict[str, Any]) -> torch.Tensor:
    """SDPA output `[1, e - s, H, D]` of segment `[s, e)`, after its `cl` context keys at `cs`."""
    if cl == 0:
        return sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, is_causal=True, **kwargs
        )[0]
    n = e - s
    k = torch.cat([key[:, :, cs:cs + cl], key[:, :, s:e]], dim=2)
    v = torch.cat([value[:, :, cs:cs + cl], value[:, :, s:e]], dim=2)
    allowed = torch.ones((n, cl + n), dtype=torch.bool, device=query.device).tril(diagonal=cl)
    return sdpa_attention_forward(module, query[:, :, s:e], k, v, allowed, is_causal=False, **kwargs)[0]


def _segment_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for an unpadded sequence without a cache (segments come from the position ids);
    otherwise sdpa's own mask."""
    if kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get(
        "q_offset"
    ):
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(SEGMENT_ATTENTION, _segment_attention_forward)
AttentionMaskInterface.register(SEGMENT_ATTENTION, _segment_mask)


def runs_segments(model: torch.nn.Module) -> bool:
    """Whether `segment_attention` applies to `model`: a transformers model on `sdpa`, or one
    already inside a `segment_attention` block (the training step holds one around its
    micro-batches, in which `compute_trainer_logprobs` opens its own), seen through a
    `DistributedDataParallel` wrapper."""
    implementation = getattr(getattr(inner_module(model), "config", None), "_attn_implementation", None)
    return implementation in ("sdpa", SEGMENT_ATTENTION)


@contextlib.contextmanager
def segment_attention(
    model: torch.nn.Module, segments: tuple[tuple[int, int, int, int], ...] = ()
) -> Iterator[None]:
    """Run `model` (a transformers model on `sdpa`) with the segment attention inside the block,
    over `segments` (`PackedBatch.segments`; empty: rows from the position resets).

    Blocks nest: an inner block sets its own segments and gives the outer's back on exit.
    Models on another implementation (eager, flash_attention_2, ...) are left as they are.
    Not thread-safe for one model used from two threads at once (it switches the config).
    """
    if not runs_segments(model):
        yield
        return
    config = cast(PretrainedConfig, inner_module(model).config)
    before = config._attn_implementation
    config._attn_implementation = SEGMENT_ATTENTION
    token = _PACK_SEGMENTS.set(segments)
    try:
        yield
    finally:
        _PACK_SEGMENTS.reset(token)
        config._attn_implementation = before


def compute_trainer_logprobs(
    model: torch.nn.Module,
    packed: PackedBatch,
    temperature: float,
    attention: Literal["segments", "dense"] = "segments",
) -> torch.Tensor:
    """Logprobs of the trained tokens of `packed` under `model`, float32, shape [T].

    `lp[t] = log_softmax(logits[t-1] / temperature)[input_ids[t]]` where `mask_T[t]`, else 0;
    computed as `z[target] - logsumexp(z)` with `z = logits.float() / temperature`, only at
    the positions that predict a trained token. Differentiable with respect to the model.
    `temperature <= 0` (greedy) uses 1.0, the distribution whose logprobs the engine reports.
    The model must accept `position_ids`, `use_cache` and `logits_to_keep` (any HF causal LM).
    `attention="segments"` (default) runs an sdpa model under `segment_attention` (memory
    linear in the pack length); `"dense"` keeps transformers' block-diagonal [T, T] mask.

    Raises:
        ValueError: an unknown `attention`.
    """
    if attention not in ("segments", "dense"):
        raise ValueError(f"attention={attention!r} is not 'segments' or 'dense'")
    if packed.shared_tokens and (attention == "dense" or not runs_segments(model)):
        expanded, index_T = unshare(packed)  # only the segment attention runs branches
        lp_T = compute_trainer_logprobs(model, expanded, temperature, attention)
        return lp_T[index_T.to(lp_T.device)]
    device = next(model.parameters()).device
    mask = packed.mask_T.to(device)
    target_idx = torch.nonzero(mask, as_tuple=False).squeeze(-1)
    out = torch.zeros(packed.num_tokens, dtype=torch.float32, device=device)
    if target_idx.numel() == 0:
        return out
    scale = temperature if temperature > 0 else 1.0
    with segment_attention(model, packed.segments) if attention == "segments" else contextlib.nullcontext():
        result = model(
            input_ids=packed.input_ids_T.to(device)[None],
            position_ids=packed.position_ids_T.to(device)[None],
            use_cache=False,
            logits_to_keep=target_idx - 1,
        )
    logits_K_V = result.logits.reshape(-1, result.logits.shape[-1])  # a view: no [1, K, V] copy in backward
    lp_K = token_logprobs(logits_K_V, packed.input_ids_T.to(device)[target_idx], scale)
    return out.scatter(0, target_idx, lp_K)


def loss_inputs(
    packed: PackedBatch,
    trainer_logprobs_T: torch.Tensor,
    num_tokens_global: int,
    ref_logprobs_T: torch.Tensor | None = None,
) -> LossInputs:
    """Assemble the `LossInputs` of one micro-batch (tensors moved to the logprobs' device)."""
    device = trainer_logprobs_T.device
    return LossInputs(
        trainer_logprobs_T=trainer_logprobs_T,
        sampler_logprobs_T=packed.sampler_logprobs_T.to(device),
        advantages_T=packed.advantages_T.to(device),
        mask_T=packed.mask_T.to(device),
        seq_ids_T=packed.seq_ids_T.to(device),
        num_tokens_global=num_tokens_global,
        ref_logprobs_T=ref_logprobs_T,
    )

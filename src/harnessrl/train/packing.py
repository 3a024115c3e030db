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

Oversized rows: a row longer than the budget gets a micro-batch of its own; rows are never
dropped or truncated (a too-long row is the trainer's memory problem to report, not a silent
loss of training signal). `PackPlan.num_oversized` counts them.

Logprob convention: the value at index t is the logprob of `input_ids[t]` given the tokens
before it in its row, i.e. computed from the logits at t-1 (shift by one). Logits are computed
only at the positions that predict a trained token (`logits_to_keep` with an index tensor),
so the vocabulary projection and the log-softmax never run on context-only positions.

What this module does not do: choose the budget, run the optimizer, or compute losses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from harnessrl.train.losses import LossInputs
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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

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


def pack_rows(rows: Sequence[Row], token_budget: int) -> list[PackedBatch]:
    """Pack `rows` into padding-free micro-batches of at most `token_budget` tokens each
    (an oversized row alone in its own). Advantages are read from `Row.advantage`.
    """
    plan = plan_micro_batches([len(r.input_ids) for r in rows], token_budget)
    return [_concat(rows, b) for b in plan.bins]


def _concat(rows: Sequence[Row], indices: Sequence[int]) -> PackedBatch:
    ids: list[int] = []
    pos: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    advs: list[float] = []
    seq: list[int] = []
    vers: list[int] = []
    for i in indices:
        row = rows[i]
        n = len(row.input_ids)
        if row.completion_mask and row.completion_mask[0]:
            raise ValueError(f"row {i} trains its first token, which has no left context")
        ids.extend(row.input_ids)
        pos.extend(range(n))
        mask.extend(row.completion_mask)
        lps.extend(row.sampler_logprobs)
        advs.extend([row.advantage] * n)
        seq.extend([i] * n)
        vers.extend(row.policy_versions)
    return PackedBatch(
        input_ids_T=torch.tensor(ids, dtype=torch.long),
        position_ids_T=torch.tensor(pos, dtype=torch.long),
        mask_T=torch.tensor(mask, dtype=torch.bool),
        sampler_logprobs_T=torch.tensor(lps, dtype=torch.float32),
        advantages_T=torch.tensor(advs, dtype=torch.float32),
        seq_ids_T=torch.tensor(seq, dtype=torch.long),
        policy_versions_T=torch.tensor(vers, dtype=torch.long),
        row_indices=tuple(indices),
    )


SEGMENT_ATTENTION = "harnessrl_segments"
"""transformers attention implementation name of the per-row segment attention."""


def segment_bounds(position_ids_T: torch.Tensor) -> list[tuple[int, int]]:
    """`[start, end)` of each row of a pack: a row starts where the position does not
    continue the previous one (`pos[t] != pos[t-1] + 1`), and at t = 0."""
    T = int(position_ids_T.shape[-1])
    starts = (torch.nonzero(position_ids_T[1:] != position_ids_T[:-1] + 1).flatten() + 1).tolist()
    edges = [0, *starts, T]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _segment_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per row segment of a packed `[1, H, T, D]` sequence; output `[1, T, H, D]`."""
    position_ids = kwargs.get("position_ids")
    if (
        attention_mask is not None
        or position_ids is None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    outs = [
        sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, is_causal=True, **kwargs
        )[0]
        for s, e in segment_bounds(position_ids.reshape(-1))
    ]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


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


@contextlib.contextmanager
def segment_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` (a transformers model on `sdpa`) with the segment attention inside the block.

    Models on another implementation (eager, flash_attention_2, ...) are left as they are.
    Not thread-safe for one model used from two threads at once (it switches the config).
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = SEGMENT_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


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
    device = next(model.parameters()).device
    mask = packed.mask_T.to(device)
    target_idx = torch.nonzero(mask, as_tuple=False).squeeze(-1)
    out = torch.zeros(packed.num_tokens, dtype=torch.float32, device=device)
    if target_idx.numel() == 0:
        return out
    scale = temperature if temperature > 0 else 1.0
    with segment_attention(model) if attention == "segments" else contextlib.nullcontext():
        result = model(
            input_ids=packed.input_ids_T.to(device)[None],
            position_ids=packed.position_ids_T.to(device)[None],
            use_cache=False,
            logits_to_keep=target_idx - 1,
        )
    logits_K_V = result.logits[0].float() / scale
    targets_K = packed.input_ids_T.to(device)[target_idx]
    lp_K = logits_K_V.gather(-1, targets_K[:, None]).squeeze(-1) - torch.logsumexp(logits_K_V, dim=-1)
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

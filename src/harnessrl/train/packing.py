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
block-diagonal causal mask, so no token attends across rows. `tests/test_packing.py` checks
that a row's logprobs inside a pack equal those computed alone (1e-5). With sdpa/eager that
mask is a dense [T, T] boolean (64 MiB at T = 8192); `flash_attention_2` on GPU takes the same
position ids and runs varlen kernels without it.

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


def compute_trainer_logprobs(
    model: torch.nn.Module, packed: PackedBatch, temperature: float
) -> torch.Tensor:
    """Logprobs of the trained tokens of `packed` under `model`, float32, shape [T].

    `lp[t] = log_softmax(logits[t-1] / temperature)[input_ids[t]]` where `mask_T[t]`, else 0;
    computed as `z[target] - logsumexp(z)` with `z = logits.float() / temperature`, only at
    the positions that predict a trained token. Differentiable with respect to the model.
    `temperature <= 0` (greedy) uses 1.0, the distribution whose logprobs the engine reports.
    The model must accept `position_ids`, `use_cache` and `logits_to_keep` (any HF causal LM).
    """
    device = next(model.parameters()).device
    mask = packed.mask_T.to(device)
    target_idx = torch.nonzero(mask, as_tuple=False).squeeze(-1)
    out = torch.zeros(packed.num_tokens, dtype=torch.float32, device=device)
    if target_idx.numel() == 0:
        return out
    scale = temperature if temperature > 0 else 1.0
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

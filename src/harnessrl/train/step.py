"""One optimizer step on a batch of rows: pack → trainer logprobs → loss → backward → clip → step.

Responsibility: the algorithm-blind training step. The loss variant is a function passed in
(`losses.loss_fn_for`); normalisation is the global token mean: every micro-batch's loss is
`sum(loss_t) / num_trained_tokens_of_the_whole_batch`, so gradient accumulation over
micro-batches equals one big batch.

Several processes (`train/distributed.py`): every rank gets the same rows and trains its share
(whole rows, balanced by tokens); the normaliser is the global trained-token count (all-reduced)
and each rank's loss is scaled by the world size against DDP's / FSDP2's gradient averaging, so
the update equals one process's on the same rows (`tests/test_distributed.py`). Ranks with fewer
micro-batches run zero-contribution passes so every rank joins the same collectives.

One forward per micro-batch and one optimizer update per batch: the loss's proximal policy
(`clip_center = "proximal"`) is the weights at the step's start, i.e. the trainer's own
logprobs detached, so the decoupled objective costs no extra forward pass
(`tests/test_offpolicy_diagnostics.py` counts them).

Guard: a non-finite gradient norm (NaN or inf, from a NaN loss or an overflow) skips the
optimizer update instead of writing NaN into every weight (`skipped_nonfinite`).

Metrics it returns: loss, grad_norm (before clipping), `param_delta_l2` (the L2 norm of what
the update changed, from the optimizer's own update: `update_l2`), the loss's ratio and clip statistics
(token-weighted over micro-batches), the `offpolicy/*` diagnostics by staleness
(`loss/diagnostics.py`), and `ratio_abs_dev`: mean |exp(trainer − sampler) − 1| over
trained tokens at the weights *before* the update (at step 0 trainer and sampler hold the same
weights, so this is the sampler/trainer parity check, DESIGN.md §3.2). Besides the metrics,
`StepResult.token_weights`: per trained row, each trained token's loss weight and whether the
clip or the weight's bound stopped it (`loss/token_weights.py`, for the viewer).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from harnessrl.train.distributed import (SINGLE, Ranks, all_reduce, gather_objects, local_tensor,
                                         split_by_tokens, zero_contribution)
from harnessrl.loss.diagnostics import OffPolicyStats, staleness_of
from harnessrl.loss.losses import LossFn
from harnessrl.loss.token_weights import TokenWeightRecord, TokenWeightRecorder
from harnessrl.train.packing import (PackedBatch, compute_trainer_logprobs, loss_inputs, pack_rows,
                                     segment_attention)
from harnessrl.types import Row


@dataclass
class StepResult:
    """What one optimizer step did: whether the update was applied, why not, and its metrics."""

    metrics: dict[str, float | str] = field(default_factory=dict)
    """Numbers of the step; `skip_reason` is the one text value (set when `skipped`)."""
    applied: bool = False
    """Whether the weights changed (False: nothing to train, or a non-finite gradient norm)."""
    nonfinite: bool = False
    """The update was skipped for a NaN / inf gradient norm (`skipped_nonfinite`)."""
    updated: list[torch.nn.Parameter] | None = None
    """With `measure_update=False`: the parameters the update changed, for a later
    `update_l2(optimizer, updated)` (before the next optimizer step)."""
    token_weights: list[TokenWeightRecord] = field(default_factory=list)
    """One record per trained row (every rank's): its trained tokens' loss weights and which
    the clip or the weight's bound stopped (`loss/token_weights.py`; the loop writes them)."""


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Sequence[Row],
    loss_fn: LossFn,
    *,
    temperature: float,
    token_budget: int,
    max_grad_norm: float,
    reference: Callable[[PackedBatch], torch.Tensor] | None = None,
    ranks: Ranks = SINGLE,
    measure_update: bool = True,
    autocast: str = "off",
    before_update: Callable[[], object] | None = None,
    policy_version: int | None = None,
) -> StepResult:
    """Train on `rows` (advantages already stamped) with one optimizer update.

    `measure_update=False` leaves `param_delta_l2` out of the metrics and returns the updated
    parameters in `StepResult.updated`, so the caller can measure the update off its critical
    path (`update_l2(optimizer, updated)`, any time before the next optimizer step; 0.24-0.30 s
    on a 135M model on one thread).

    `reference(batch)` gives the reference policy's logprobs of a micro-batch (float32 [T], no
    gradient) for the loss's KL penalty (`kl_coef > 0` needs it; `policy.reference_logprobs`).

    `autocast="bfloat16"` runs each micro-batch's forward (and the reference's) under
    `torch.autocast` (`autocast_context`); the weights, gradients and optimizer state keep their
    dtype, and the logprobs and the loss are float32.

    Several processes (`ranks.distributed`): every rank passes the same `rows` and its wrapped
    `model` (`distributed.wrap_model`); each trains its share (`split_by_tokens`), the loss
    normaliser is the global trained-token count, and the update equals one process's on the
    same rows. The metrics are the whole step's, the same on every rank.
    `policy_version`: the version of the weights the trainer holds; a token's staleness is it
    minus the token's turn version (the `offpolicy/*` metrics' split; None: totals only).

    `before_update()` runs after the gradients are computed and clipped, right before an
    update is applied (not when none is: no trainable token, a non-finite norm); what it
    raises propagates with the weights and the optimizer state untouched.

    Rows with no trained token must not be passed (the samples builder drops them).
    Returns metrics; `skipped=1` when no update happened: nothing to train, or a NaN / inf
    gradient norm (then also `skipped_nonfinite=1` and `skip_reason`; the gradients are
    dropped and neither the weights nor the optimizer state change).
    """
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    acc = accumulate_gradients(model, rows, loss_fn, temperature=temperature, token_budget=token_budget,
                               reference=reference, ranks=ranks, autocast=autocast, policy_version=policy_version)
    if acc is None:
        return StepResult({"skipped": 1.0, "tokens_trained": 0.0}, applied=False)
    # 4) clip and update; a NaN or inf gradient norm skips the update (weights and optimizer
    # state untouched), counted as `skipped_nonfinite`
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
    finite = math.isfinite(grad_norm)
    delta_l2 = None
    updated = None
    if finite:
        if before_update is not None:
            try:
                before_update()
            except BaseException:
                optimizer.zero_grad(set_to_none=True)
                raise
        optimizer.step()
        if measure_update:
            delta_l2 = update_norm(optimizer, None, ranks)
        else:
            updated = [p for p in params if p.grad is not None]
    optimizer.zero_grad(set_to_none=True)
    metrics: dict[str, float | str] = dict(acc.metrics)
    if not finite:
        metrics.update(skipped=1.0, skipped_nonfinite=1.0,
                       skip_reason=f"non-finite gradient norm ({grad_norm}): update skipped")
    metrics.update(grad_norm=grad_norm, train_s=time.perf_counter() - t0)
    if delta_l2 is not None:
        metrics["param_delta_l2"] = delta_l2
    return StepResult(metrics, applied=finite, nonfinite=not finite, updated=updated, token_weights=acc.token_weights)


def update_norm(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter] | None,
                ranks: Ranks = SINGLE) -> float:
    """`update_l2` of the whole step: under FSDP2 the squares are summed over ranks (every rank
    must call it then, a collective)."""
    squares = update_l2(optimizer, params) ** 2
    return math.sqrt(all_reduce([squares], ranks)[0]) if ranks.sharded else math.sqrt(squares)


@dataclass(frozen=True, slots=True)
class Accumulated:
    """The gradient of one step, accumulated into the parameters' `.grad`."""

    num_trained: int
    """Trained tokens of the whole step (all ranks)."""
    metrics: dict[str, float]
    """loss, ratio_abs_dev, tokens_trained, tokens_packed, micro_batches and the loss's own
    metrics, for the whole step (all ranks)."""
    token_weights: list[TokenWeightRecord] = field(default_factory=list)
    """`TokenWeightRecorder.records` of the step (all ranks)."""


def accumulate_gradients(
    model: torch.nn.Module,
    rows: Sequence[Row],
    loss_fn: LossFn,
    *,
    temperature: float,
    token_budget: int,
    reference: Callable[[PackedBatch], torch.Tensor] | None = None,
    ranks: Ranks = SINGLE,
    autocast: str = "off",
    policy_version: int | None = None,
) -> Accumulated | None:
    """Pack this rank's share of `rows`, run forward and backward on each micro-batch with the
    loss normalised by the whole step's trained tokens, leaving the step's gradient in `.grad`
    (summed over ranks when distributed). None, with no gradient touched, when the step has no
    trained token. Does not zero gradients first. `autocast`, `policy_version`: as in
    `optimizer_step`."""
    # 1) this rank's rows, packed padding-free into micro-batches under the token budget
    mine = split_by_tokens([len(r.input_ids) for r in rows], ranks.world_size)[ranks.rank]
    batches = pack_rows([rows[i] for i in mine], token_budget)
    local_trained = sum(b.num_trained_tokens for b in batches)
    num_trained, num_micro = (int(v) for v in (
        all_reduce([local_trained], ranks)[0], all_reduce([len(batches)], ranks, op="max")[0]))
    if num_trained == 0:
        return None
    # DDP and FSDP2 average gradients over ranks; the loss is a share of the global token
    # mean, so each rank's loss is scaled by the world size to sum them instead
    scale = float(ranks.world_size)
    sums: dict[str, float] = {}
    mins: dict[str, float] = {}
    maxs: dict[str, float] = {}
    abs_dev_sum = 0.0
    loss_total = 0.0
    offpolicy, weights = OffPolicyStats(), TokenWeightRecorder()
    keyed = [(rows[i].rollout_id, rows[i].input_ids) for i in mine]
    with segment_attention(model):  # it sees through a DDP wrapper to the model's config
        for k in range(num_micro):
            sync = k == num_micro - 1 or not isinstance(model, DistributedDataParallel)
            with contextlib.nullcontext() if sync else model.no_sync():  # type: ignore[operator]
                if k >= len(batches):  # no micro-batch left here: join the collectives, add nothing
                    zero_contribution(model, ranks.device).backward()
                    continue
                batch = batches[k]
                with autocast_context(model, autocast):
                    # 2) trainer logprobs of the sampled tokens (same temperature as the sampler)
                    trainer_lp_T = compute_trainer_logprobs(model, batch, temperature)
                    ref_lp_T = reference(batch) if reference is not None else None
                with torch.no_grad():
                    mask = batch.mask_T.to(trainer_lp_T.device)
                    ratio = torch.exp(trainer_lp_T.detach()[mask] - batch.sampler_logprobs_T.to(mask.device)[mask])
                    abs_dev_sum += float(torch.nan_to_num((ratio - 1).abs(), nan=0.0, posinf=0.0).sum())
                # 3) loss, normalised by the whole batch's trained tokens, and backward
                out = loss_fn(loss_inputs(batch, trainer_lp_T, num_trained, ref_lp_T))
                (out.loss * scale if ranks.distributed else out.loss).backward()
            loss_total += float(out.loss.detach())
            offpolicy.add(trainer_lp_T, batch.sampler_logprobs_T, batch.mask_T,
                          staleness_of(batch.policy_versions_T, policy_version), out.clipped_T, out.bounded_T)
            weights.add(keyed, batch.seq_ids_T, batch.mask_T, out.weight_T, out.clipped_T, out.bounded_T)
            _add_metrics(sums, mins, maxs, out.metrics, batch.num_trained_tokens / num_trained)
    sums.update(loss=loss_total, ratio_abs_dev=abs_dev_sum / num_trained,
                tokens_trained=float(local_trained), tokens_packed=float(sum(b.num_tokens for b in batches)),
                micro_batches=float(len(batches)))
    if ranks.distributed:
        sums, mins, maxs = _merge_over_ranks(sums, mins, maxs, ranks)
        offpolicy, weights = _merge_offpolicy(offpolicy, weights, ranks)
    return Accumulated(num_trained, {**sums, **mins, **maxs, **offpolicy.metrics()}, weights.records)


def _add_metrics(sums: dict[str, float], mins: dict[str, float], maxs: dict[str, float],
                 metrics: dict[str, float], weight: float) -> None:
    """One micro-batch's loss metrics into the step's: `_min` / `_max` keys by min / max,
    `_count` and `num_` keys summed, the rest token-weighted (`weight`: its share of tokens)."""
    for key, value in metrics.items():
        if key.endswith("_min"):
            mins[key] = min(mins.get(key, value), value)
        elif key.endswith("_max"):
            maxs[key] = max(maxs.get(key, value), value)
        elif key.endswith("_count") or key.startswith("num_"):
            sums[key] = sums.get(key, 0.0) + value
        else:
            sums[key] = sums.get(key, 0.0) + weight * value


def _merge_offpolicy(mine: OffPolicyStats, weights: TokenWeightRecorder, ranks: Ranks
                     ) -> tuple[OffPolicyStats, TokenWeightRecorder]:
    """Every rank's off-policy sums, added, and token weight records, in rank order (a
    collective)."""
    total, records = OffPolicyStats(), TokenWeightRecorder()
    for part, recs in gather_objects((mine, weights), ranks):
        total.merge(part)
        records.merge(recs)
    return total, records


def _merge_over_ranks(sums: dict[str, float], mins: dict[str, float], maxs: dict[str, float],
                      ranks: Ranks) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The step's metrics from every rank's part: sums added (token-weighted means are sums of
    weighted parts), minima and maxima over ranks; a rank without rows has no loss metrics."""
    total_s: dict[str, float] = {}
    total_min: dict[str, float] = {}
    total_max: dict[str, float] = {}
    for s, lo, hi in gather_objects((sums, mins, maxs), ranks):
        for key, value in s.items():
            total_s[key] = total_s.get(key, 0.0) + value
        for key, value in lo.items():
            total_min[key] = min(total_min.get(key, value), value)
        for key, value in hi.items():
            total_max[key] = max(total_max.get(key, value), value)
    return total_s, total_min, total_max


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the gradient norm under FSDP2), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor  # lazy: torch.distributed, absent from some torch builds

    return t.full_tensor() if isinstance(t, DTensor) else t


def update_l2(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter] | None = None) -> float:
    """`||p_after - p_before||_2` over every parameter the last `optimizer.step()` updated,
    from the update itself: no copy of the weights is kept. Without `params`, call it right
    after the step, before `zero_grad` (a parameter with `grad is None` was not updated and is
    skipped); with `params` (those that had a gradient at the step), any time before the next
    optimizer step.

    For AdamW (`torch.optim.AdamW`, not amsgrad / maximize) the step is
    `p' = p (1 - lr wd) - u` with `u = lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)`
    (Loshchilov & Hutter 2019, torch's formulation), so `p' - p = -(u + lr wd p') / (1 - lr wd)`
    is recomputed from the optimizer state one parameter at a time (temporaries of one
    parameter's size). With LoRA the parameters are the adapter matrices. Under FSDP2 the
    norm is of this rank's shards (the caller sums the squares over ranks).

    Raises:
        TypeError: another optimizer, or AdamW with amsgrad / maximize.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"update_l2 knows torch.optim.AdamW only, got {type(optimizer).__name__}")
    total = 0.0
    chosen = None if params is None else {id(p) for p in params}
    with torch.no_grad():
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise TypeError("update_l2: AdamW with amsgrad or maximize is not supported")
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            beta1, beta2 = (float(b) for b in group["betas"])
            for p in group["params"]:
                was_updated = p.grad is not None if chosen is None else id(p) in chosen
                state = optimizer.state.get(p)
                if not state or not was_updated:
                    continue
                t = float(local_tensor(state["step"]))
                total += _update_squares(local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"]),
                                         local_tensor(p.detach()) if wd else None,
                                         lr=lr, wd=wd, eps=eps, c1=lr / (1.0 - beta1 ** t),
                                         c2=1.0 / (1.0 - beta2 ** t))
    return math.sqrt(total)


UPDATE_CHUNK = 1 << 16
"""Elements per chunk of `_update_squares`: 256 KiB float32 temporaries, which stay in a
core's cache across the chunk's passes. On the 135M model on one thread 0.24-0.30 s against
0.41-0.54 s with parameter-sized temporaries (bound by memory traffic), and exact to 1e-7 of a
float64 sum where one float32 `vector_norm` per parameter was 0.35% off."""


def _update_squares(m: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, *, lr: float, wd: float,
                    eps: float, c1: float, c2: float) -> float:
    """`sum(((c1 m / (sqrt(c2 v) + eps) + lr wd w) / (1 - lr wd))^2)` over one parameter's
    AdamW state (`w` only when `wd`), in chunks of `UPDATE_CHUNK` elements, float32 per chunk
    and summed in float64."""
    m, v = m.reshape(-1), v.reshape(-1)
    w = None if w is None else w.reshape(-1)
    n = m.numel()
    buf = torch.empty(min(n, UPDATE_CHUNK), dtype=torch.float32, device=m.device)
    total = 0.0
    for start in range(0, n, UPDATE_CHUNK):
        stop = min(start + UPDATE_CHUNK, n)
        u = buf[: stop - start]
        u.copy_(v[start:stop]).mul_(c2).sqrt_().add_(eps)
        torch.div(m[start:stop].float(), u, out=u).mul_(c1)
        if w is not None:
            u.add_(w[start:stop].float(), alpha=lr * wd).div_(1.0 - lr * wd)
        total += float(torch.dot(u, u))
    return total


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16}
"""`train.autocast` names (besides "off") and their torch dtypes."""


def native_cpu_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX tiles). Without
    either, torch emulates them: on an AVX2-only AMD EPYC a 135M train step under bfloat16
    autocast took 110-128 s against 8-14 s in float32 beside the engine (`bench/learning.py`)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def autocast_context(model: torch.nn.Module, autocast: str) -> contextlib.AbstractContextManager[Any]:
    """`torch.autocast` on the device of `model`'s weights in the dtype `autocast` names
    (`AUTOCAST_DTYPES`), or no context for "off": mixed precision, the matmuls in bfloat16
    with the weights kept in their own dtype (Micikevicius et al. 2018; the Hugging Face
    `Trainer`'s `bf16=True` is the same `torch.autocast`).

    Raises:
        ValueError: another name.
    """
    if autocast == "off":
        return contextlib.nullcontext()
    if autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"train.autocast={autocast!r} is not 'off' or one of {sorted(AUTOCAST_DTYPES)}")
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=AUTOCAST_DTYPES[autocast])


def sampler_parity(
    model: torch.nn.Module, rows: Sequence[Row], *, temperature: float, token_budget: int, max_rows: int = 8,
    autocast: str = "off",
) -> float | None:
    """Mean |exp(trainer_logprob - sampler_logprob) - 1| over the trained tokens of up to
    `max_rows` rows, without gradient; None when there is no trained token.

    Run on the first batch of a run, when trainer and engine hold the same weights: it checks
    that the trainer computes the sampler's distribution (same temperature, same ids, same
    context). DESIGN.md §3.2; on the CPU default with fp32 it must be <= 1e-3. `autocast`: the
    trainer's own precision (`optimizer_step`), so the check measures what the loss sees.
    """
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in pack_rows(list(rows)[:max_rows], token_budget):
            with autocast_context(model, autocast):
                lp_T = compute_trainer_logprobs(model, batch, temperature)
            mask = batch.mask_T.to(lp_T.device)
            dev = (torch.exp(lp_T[mask] - batch.sampler_logprobs_T.to(lp_T.device)[mask]) - 1).abs()
            total += float(dev.sum())
            count += int(mask.sum())
    return total / count if count else None

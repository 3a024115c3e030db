"""One optimizer step on a batch of rows: pack → trainer logprobs → loss → backward → clip → step.

Responsibility: the algorithm-blind training step. The loss variant is a function passed in
(`losses.loss_fn_for`); normalisation is the global token mean: every micro-batch's loss is
`sum(loss_t) / num_trained_tokens_of_the_whole_batch`, so gradient accumulation over
micro-batches equals one big batch.

Guard: a non-finite gradient norm (NaN or inf, from a NaN loss or an overflow) skips the
optimizer update instead of writing NaN into every weight (`skipped_nonfinite`).

Metrics it returns: loss, grad_norm (before clipping), `param_delta_l2` (the L2 norm of what
the update changed, from the optimizer's own update: `update_l2`), the loss's ratio and clip statistics
(token-weighted over micro-batches), and `ratio_abs_dev`: mean |exp(trainer − sampler) − 1| over
trained tokens at the weights *before* the update (at step 0 trainer and sampler hold the same
weights, so this is the sampler/trainer parity check, DESIGN.md §3.2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from harnessrl.train.losses import LossFn
from harnessrl.train.packing import PackedBatch, compute_trainer_logprobs, loss_inputs, pack_rows
from harnessrl.types import Row


@dataclass
class StepResult:
    metrics: dict[str, float | str] = field(default_factory=dict)
    """Numbers of the step; `skip_reason` is the one text value (set when `skipped`)."""


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
) -> StepResult:
    """Train on `rows` (advantages already stamped) with one optimizer update.

    `reference(batch)` gives the reference policy's logprobs of a micro-batch (float32 [T], no
    gradient) for the loss's KL penalty (`kl_coef > 0` needs it; `policy.reference_logprobs`).

    Rows with no trained token must not be passed (the samples builder drops them).
    Returns metrics; `skipped=1` when no update happened: nothing to train, or a NaN / inf
    gradient norm (then also `skipped_nonfinite=1` and `skip_reason`; the gradients are
    dropped and neither the weights nor the optimizer state change).
    """
    t0 = time.perf_counter()
    # 1) pack rows padding-free into micro-batches under the token budget
    batches = pack_rows(rows, token_budget)
    num_trained = sum(b.num_trained_tokens for b in batches)
    if num_trained == 0:
        return StepResult({"skipped": 1.0, "tokens_trained": 0.0})
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    mins: dict[str, float] = {}
    maxs: dict[str, float] = {}
    abs_dev_sum = 0.0
    loss_total = 0.0
    for batch in batches:
        # 2) trainer logprobs of the sampled tokens (same temperature as the sampler)
        trainer_lp_T = compute_trainer_logprobs(model, batch, temperature)
        with torch.no_grad():
            mask = batch.mask_T
            ratio = torch.exp(trainer_lp_T.detach()[mask] - batch.sampler_logprobs_T[mask])
            abs_dev_sum += float(torch.nan_to_num((ratio - 1).abs(), nan=0.0, posinf=0.0).sum())
        # 3) loss, normalised by the whole batch's trained tokens, and backward
        ref_lp_T = reference(batch) if reference is not None else None
        out = loss_fn(loss_inputs(batch, trainer_lp_T, num_trained, ref_lp_T))
        out.loss.backward()
        loss_total += float(out.loss.detach())
        weight = batch.num_trained_tokens / num_trained
        for key, value in out.metrics.items():
            if key.endswith("_min"):
                mins[key] = min(mins.get(key, value), value)
            elif key.endswith("_max"):
                maxs[key] = max(maxs.get(key, value), value)
            elif key.endswith("_count") or key.startswith("num_"):
                sums[key] = sums.get(key, 0.0) + value
            else:
                sums[key] = sums.get(key, 0.0) + weight * value
    # 4) clip and update; a NaN or inf gradient norm skips the update (weights and optimizer
    # state untouched), counted as `skipped_nonfinite`
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    finite = math.isfinite(grad_norm)
    delta_l2 = None
    if finite:
        optimizer.step()
        delta_l2 = update_l2(optimizer)
    optimizer.zero_grad(set_to_none=True)
    metrics = {**sums, **mins, **maxs}
    if not finite:
        metrics.update(skipped=1.0, skipped_nonfinite=1.0,
                       skip_reason=f"non-finite gradient norm ({grad_norm}): update skipped")
    metrics.update(
        loss=loss_total,
        grad_norm=grad_norm,
        ratio_abs_dev=abs_dev_sum / num_trained,
        tokens_trained=float(num_trained),
        tokens_packed=float(sum(b.num_tokens for b in batches)),
        micro_batches=float(len(batches)),
        train_s=time.perf_counter() - t0,
    )
    if delta_l2 is not None:
        metrics["param_delta_l2"] = delta_l2
    return StepResult(metrics)


def update_l2(optimizer: torch.optim.Optimizer) -> float:
    """`||p_after - p_before||_2` over every parameter the last `optimizer.step()` updated,
    from the update itself: no copy of the weights is kept. Call it right after the step,
    before `zero_grad` (a parameter with `grad is None` was not updated and is skipped).

    For AdamW (`torch.optim.AdamW`, not amsgrad / maximize) the step is
    `p' = p (1 - lr wd) - u` with `u = lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)`
    (Loshchilov & Hutter 2019, torch's formulation), so `p' - p = -(u + lr wd p') / (1 - lr wd)`
    is recomputed from the optimizer state one parameter at a time (temporaries of one
    parameter's size). With LoRA the parameters are the adapter matrices.

    Raises:
        TypeError: another optimizer, or AdamW with amsgrad / maximize.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"update_l2 knows torch.optim.AdamW only, got {type(optimizer).__name__}")
    total = 0.0
    with torch.no_grad():
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise TypeError("update_l2: AdamW with amsgrad or maximize is not supported")
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            beta1, beta2 = (float(b) for b in group["betas"])
            for p in group["params"]:
                state = optimizer.state.get(p)
                if p.grad is None or not state:
                    continue
                t = float(state["step"])
                u = (state["exp_avg_sq"].float() / (1.0 - beta2 ** t)).sqrt_().add_(eps)
                u = torch.div(state["exp_avg"].float(), u, out=u).mul_(lr / (1.0 - beta1 ** t))
                if wd:
                    u.add_(p.detach().float(), alpha=lr * wd).div_(1.0 - lr * wd)
                total += float(torch.linalg.vector_norm(u)) ** 2
    return math.sqrt(total)


def sampler_parity(
    model: torch.nn.Module, rows: Sequence[Row], *, temperature: float, token_budget: int, max_rows: int = 8
) -> float | None:
    """Mean |exp(trainer_logprob - sampler_logprob) - 1| over the trained tokens of up to
    `max_rows` rows, without gradient; None when there is no trained token.

    Run on the first batch of a run, when trainer and engine hold the same weights: it checks
    that the trainer computes the sampler's distribution (same temperature, same ids, same
    context). DESIGN.md §3.2; on the CPU default with fp32 it must be <= 1e-3.
    """
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in pack_rows(list(rows)[:max_rows], token_budget):
            lp_T = compute_trainer_logprobs(model, batch, temperature)
            mask = batch.mask_T
            dev = (torch.exp(lp_T[mask] - batch.sampler_logprobs_T[mask]) - 1).abs()
            total += float(dev.sum())
            count += int(mask.sum())
    return total / count if count else None

"""Token logprobs from logits, with a hand-written backward: the trainer's output head.

`token_logprobs(logits_K_V, targets_K, scale)` is `log_softmax(logits / scale)[k, target_k]`
for the K positions that predict a trained token (`packing.compute_trainer_logprobs` calls it
on the logits of a pack). Autograd through `logsumexp` and `gather` fills four float32 [K, V]
tensors in the backward; `_TokenLogprobs` keeps one (those [K, V] passes are a large share of a
step's time at a 49k vocabulary).
Values and gradients equal the autograd formula within float32 rounding (`tests/test_packing.py`).
"""

from __future__ import annotations

from typing import Any

import torch


class _TokenLogprobs(torch.autograd.Function):
    """`log_softmax(logits / scale)[k, targets[k]]` with a hand-written backward.

    Autograd through `logsumexp` and `gather` allocates and fills several [K, V] tensors in the
    backward (a zero-filled scatter target for the gather, `exp(z - lse)`, their sum, the
    division by the temperature); this keeps one, the float32 log-softmax saved by the forward,
    and computes `d lp_k / d logits_k = (onehot(target_k) - softmax_k) / scale` from it in one
    new [K, V] tensor.
    """

    @staticmethod
    def forward(ctx: Any, logits_K_V: torch.Tensor, targets_K: torch.Tensor, scale: float) -> torch.Tensor:
        z_K_V = logits_K_V.float() if logits_K_V.dtype.itemsize < 4 else logits_K_V  # bf16/fp16 upcast
        if scale != 1.0:
            z_K_V = z_K_V / scale
        logp_K_V = torch.log_softmax(z_K_V, dim=-1)
        ctx.save_for_backward(logp_K_V, targets_K)
        ctx.scale, ctx.dtype = scale, logits_K_V.dtype
        return logp_K_V.gather(-1, targets_K[:, None]).squeeze(-1)

    @staticmethod
    def backward(ctx: Any, grad_K: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        logp_K_V, targets_K = ctx.saved_tensors
        g_K1 = (grad_K.to(logp_K_V.dtype) / ctx.scale)[:, None]
        grad_K_V = torch.exp(logp_K_V).mul_(-g_K1)
        grad_K_V.scatter_add_(-1, targets_K[:, None], g_K1)
        return grad_K_V.to(ctx.dtype), None, None


def token_logprobs(logits_K_V: torch.Tensor, targets_K: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`log_softmax(logits_K_V / scale, -1)[k, targets_K[k]]`: [K], float32 (float64 for
    float64 logits; bf16 / fp16 logits are upcast), differentiable with respect to
    `logits_K_V` ([K, V]; its gradient comes back in its dtype).

    Equal to the autograd formula `z.gather(-1, t) - logsumexp(z)` within float32 rounding
    (values and gradients, `tests/test_packing.py`), with fewer [K, V] passes and
    temporaries (`_TokenLogprobs`).

    Raises:
        ValueError: shapes that are not `[K, V]` and `[K]`, or `scale <= 0`.
    """
    if logits_K_V.dim() != 2 or targets_K.shape != logits_K_V.shape[:1]:
        raise ValueError(f"token_logprobs: logits {tuple(logits_K_V.shape)} and targets "
                         f"{tuple(targets_K.shape)} are not [K, V] and [K]")
    if not scale > 0:
        raise ValueError(f"token_logprobs: scale={scale} must be > 0")
    return _TokenLogprobs.apply(logits_K_V, targets_K, float(scale))

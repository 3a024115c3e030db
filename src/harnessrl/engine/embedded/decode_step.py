"""One decode step of a Llama-family causal LM, written against its weights directly.

Responsibility: compute the next-token logits `[B, V]` of B rows that each feed one id, over
the engine's KV batch (`engine/embedded/batch.py`: slots whose layers write each row's new column in
place), with the same arithmetic as transformers' modules (`LlamaRMSNorm`, `LlamaRotaryEmbedding`,
`apply_rotary_pos_emb`, SDPA over the key/value heads as transformers' `pack_gqa` does for one
query, `LlamaMLP`) but without their per-call overhead: on CPU at batch 8 the 30 layers of
SmolLM2-135M spend a large share of a step in module calls, keyword plumbing and mask building
rather than in matmuls. Each layer's q/k/v projections are one matmul and gate/up another: the
model's own parameters are re-pointed at slices of one fused tensor per layer (no extra memory;
`load_weights` writes through the model's `state_dict`, so the fused tensors stay current).

Models handled (`DecodeStep.for_model` returns None otherwise, and the engine calls the model's
own forward): `LlamaForCausalLM`, `Qwen2ForCausalLM` (q/k/v biases) and `MistralForCausalLM`
without a sliding window, with SiLU MLPs, one tensor-parallel slice (`pretraining_tp == 1`) and
sdpa or eager attention, no MLP biases. Anything else (q/k norms, sliding windows, other
activations) goes through transformers.

Packed weights (`pack_weights`, the engine's default; float32 on the CPU where torch has
oneDNN): every projection and the LM head multiply through a oneDNN-reordered copy of the
weight (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch.compile's
CPU backend uses for frozen linears) instead of MKL's sgemm over the plain layout. A decode
step is B rows of one id, so each projection streams its whole weight matrix for a few output
rows: the step is bound by reading the weights, and MKL reads the plain `[out, in]` layout far
below the memory bandwidth where oneDNN's blocked one comes close (SmolLM2-135M at batch 8, one
thread: the 49152 x 576 LM head 30.7 ms with MKL vs 13.3 ms packed; a whole step 1.4-2.5x
faster, `bench/engine.py --engine-unpacked`). Costs: one more copy of the decode weights in
memory (0.54 GB for SmolLM2-135M in float32), and the copies do not follow writes into the
model, so `refresh()` rebuilds them after the weights change (the engine calls it after each
`load_weights`; about 0.5 s for SmolLM2-135M). Other dtypes and devices, or a torch without
those ops, use `F.linear` (`packed` says which).

Exactness: unpacked, the same operations in the same order as transformers, except that a
fused projection is one GEMM over the concatenated weights (each output is the same dot
product; BLAS may block it differently). Packed, oneDNN sums each dot product in another
order: SmolLM2-135M's logits differ from the model's forward by up to ~1e-4 (of logits of
magnitude ~20), and greedy ids stayed equal to `model.generate`'s on the benchmark's prompts.
`tests/test_decode_step.py` checks logits against the model's forward within 1e-5 (on a small
model), greedy ids identical over whole generations, and that `refresh` picks up new weights.
The prefill and `prompt_logprobs` (the weight-sync canary) run the model's own forward.
Not thread-safe: called by the engine's decode thread only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_SUPPORTED = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


@dataclass(frozen=True, slots=True)
class _Layer:
    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


def packed_linear_usable(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed inner product (`torch.ops.mkldnn`) is available for `weight`'s
    device and dtype here and agrees with `F.linear` on a probe; else steps use `F.linear`."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn((48, 40), generator=gen)
        x = torch.randn((5, 40), generator=gen)
        got = _packed_linear(x, _pack(w), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, F.linear(x, w), atol=1e-5, rtol=1e-5))


def _pack(w: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a `[out, in]` weight, laid out for inner products of a few rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_size=_PACK_BATCH_HINT)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, w, b)`, through `packed` (`_pack(w)`) when there is one."""
    return F.linear(x, w, b) if packed is None else _packed_linear(x, packed, b)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, w, b)` through `_pack(w)`, x `[..., in]`."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, b, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


_PACK_BATCH_HINT = 8
"""The row count oneDNN tunes the packed layout for (any count works)."""


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dim and re-point each
    module's parameters at its slice, so that writes through the model reach the fused tensor."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    assert all(has_bias) or not any(has_bias), "fused projections mix biased and unbiased linears"
    bias = torch.cat([lin.bias.detach() for lin in linears], dim=0) if all(has_bias) else None
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


class DecodeStep:
    """The decode forward of one model (see the module docstring)."""

    @staticmethod
    def for_model(model: nn.Module, pack_weights: bool = True) -> DecodeStep | None:
        """A `DecodeStep` over `model` when its architecture is one handled here, else None.
        Fuses the model's projection weights in place (the model's outputs do not change).
        `pack_weights`: multiply through oneDNN-packed copies of the weights where that is
        available (float32 on the CPU; see the module docstring), else through `F.linear`."""
        config = getattr(model, "config", None)
        if type(model).__name__ not in _SUPPORTED or config is None:
            return None
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        if (
            getattr(config, "hidden_act", None) != "silu"
            or getattr(config, "pretraining_tp", 1) != 1
            or getattr(config, "mlp_bias", False)
            or getattr(config, "use_sliding_window", False)
            or (type(model).__name__ == "MistralForCausalLM" and getattr(config, "sliding_window", None))
            or any(t != "full_attention" for t in layer_types)
            or getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager")
        ):
            return None
        inner = getattr(model, "model", None)
        attn0 = inner.layers[0].self_attn if inner is not None and len(inner.layers) else None
        if attn0 is None or hasattr(attn0, "q_norm") or getattr(attn0, "sliding_window", None):
            return None
        return DecodeStep(model, pack_weights=pack_weights)

    def __init__(self, model: nn.Module, pack_weights: bool = False) -> None:
        inner = model.model  # type: ignore[attr-defined]
        attn = inner.layers[0].self_attn
        self._embed = inner.embed_tokens
        self._rotary = inner.rotary_emb
        self._norm_w = inner.norm.weight
        lm_head = model.lm_head  # type: ignore[attr-defined]
        assert isinstance(lm_head, nn.Linear), "the LM head is not a linear layer"
        self._lm_head = lm_head
        self._eps = float(inner.norm.variance_epsilon)
        self._head_dim = int(attn.head_dim)
        self._kv_heads = int(model.config.num_key_value_heads)  # type: ignore[attr-defined]
        self._heads = int(model.config.num_attention_heads)  # type: ignore[attr-defined]
        self._scaling = float(attn.scaling)
        self._q_cols = self._heads * self._head_dim
        self._kv_cols = self._kv_heads * self._head_dim
        self._inter = int(inner.layers[0].mlp.gate_proj.weight.shape[0])
        self._layers: list[_Layer] = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([a.q_proj, a.k_proj, a.v_proj])
            gate_up_w, gate_up_b = _fuse([mlp.gate_proj, mlp.up_proj])
            assert gate_up_b is None and mlp.down_proj.bias is None, "MLP biases are not handled"
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                assert float(norm.variance_epsilon) == self._eps, "layers with different RMSNorm eps"
            self._layers.append(_Layer(
                ln1=layer.input_layernorm.weight, qkv_w=qkv_w, qkv_b=qkv_b,
                o_w=a.o_proj.weight, o_b=a.o_proj.bias, ln2=layer.post_attention_layernorm.weight,
                gate_up_w=gate_up_w, down_w=mlp.down_proj.weight,
            ))
        self._packed: list[tuple[torch.Tensor | None, ...]] | None = None
        self._lm_packed: torch.Tensor | None = None
        self._pack = pack_weights and packed_linear_usable(self._lm_head.weight)
        self.refresh()

    @property
    def packed(self) -> bool:
        """Whether steps multiply through oneDNN-packed copies of the weights (False when not
        asked for, not available, or the last `refresh` failed)."""
        return self._packed is not None and self._lm_packed is not None

    def refresh(self) -> None:
        """Rebuild the packed weight copies from the model's current weights (a no-op when
        unpacked). Call after the weights change: the packed copies do not follow the model."""
        for _ in self.refresh_parts():
            pass

    def refresh_parts(self) -> Iterator[None]:
        """`refresh` one layer at a time: yields after each layer's copies are made, so that the
        caller may serve other work between them (the engine scores a canary probe there, with the
        model's own forward). The step is unpacked (`packed` False) from the first part until the
        last is made; a caller that stops iterating, or an exception from a part, leaves it
        unpacked, multiplying the model's weights."""
        if not self._pack:
            return
        self._packed = None  # the old copies go before the new ones are made
        self._lm_packed = None
        layers: list[tuple[torch.Tensor | None, ...]] = []
        for ly in self._layers:
            layers.append(tuple(_pack(w) for w in (ly.qkv_w, ly.o_w, ly.gate_up_w, ly.down_w)))
            yield
        lm_packed = _pack(self._lm_head.weight)
        self._packed, self._lm_packed = layers, lm_packed

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._eps)
        return weight * x.to(dtype)

    def __call__(
        self,
        ids_B: torch.Tensor,
        positions_B: torch.Tensor,
        mask_B_1_1_L: torch.Tensor | None,
        layers: list,  # per model layer, anything with update(k, v) -> (keys, values): `SlotLayer`s
    ) -> torch.Tensor:
        """Logits `[B, V]` of one step.

        Args:
            ids_B: the id each row feeds, long `[B]`.
            positions_B: its position id, long `[B]`.
            mask_B_1_1_L: bool, True where row b may attend key column j, over the L columns the
                cache holds after this step's write (None: every column of every row).
            layers: the cache layers; each `update(k, v)` writes this step's key/value
                `[B, H_kv, 1, D]` and returns the keys/values `[B, H_kv, L, D]`.
        """
        B = ids_B.shape[0]
        hd, nq, nkv = self._head_dim, self._q_cols, self._kv_cols
        h = self._embed(ids_B.unsqueeze(-1))  # [B, 1, E]
        cos, sin = self._rotary(h, positions_B.unsqueeze(-1))  # [B, 1, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, 1, D]
        half = hd // 2
        heads_qk = self._heads + self._kv_heads
        packed = self._packed if self._packed is not None else [(None, None, None, None)] * len(self._layers)
        for ly, cache_layer, pk in zip(self._layers, layers, packed, strict=True):
            x = self._rms(h, ly.ln1)
            qkv = _linear(x, ly.qkv_w, ly.qkv_b, pk[0])
            qk = qkv[..., : nq + nkv].view(B, 1, heads_qk, hd).transpose(1, 2)  # [B, H + H_kv, 1, D]
            v = qkv[..., nq + nkv :].view(B, 1, self._kv_heads, hd).transpose(1, 2)
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin  # rotary, q and k at once
            q, k = qk[:, : self._heads], qk[:, self._heads :]
            keys, values = cache_layer.update(k, v)
            q = q.reshape(B, self._kv_heads, self._heads // self._kv_heads, hd)  # one query: heads by kv head
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_B_1_1_L, scale=self._scaling)
            att = att.reshape(B, self._heads, 1, hd).transpose(1, 2).reshape(B, 1, nq)
            h = h + _linear(att, ly.o_w, ly.o_b, pk[1])
            x = self._rms(h, ly.ln2)
            gu = _linear(x, ly.gate_up_w, None, pk[2])
            act = F.silu(gu[..., : self._inter]) * gu[..., self._inter :]
            h = h + _linear(act, ly.down_w, None, pk[3])
        h = self._rms(h, self._norm_w)[:, -1, :]
        if self._lm_packed is None:
            return self._lm_head(h)
        return _packed_linear(h, self._lm_packed, self._lm_head.bias)

"""Rotary position embedding as one autograd function: Megatron's `apply_rope_fusion` without Transformer Engine.

Megatron-core applies RoPE either with Transformer Engine's fused kernel (`config.apply_rope_fusion`) or
with its unfused torch code (`rope_utils._apply_rotary_pos_emb_bshd`): for each of q and k in every
layer, `cos` and `sin` of the frequencies, a split, a negation, two concatenations, two products and a
sum, each an autograd node. At the tiny model's sizes those calls, not their arithmetic, cost the time.

`rope_bshd(t, freqs)` computes the same expression, `t * cos(freqs) + rotate_half(t) * sin(freqs)`, in
the same order and dtype, so its forward output is bit-identical to the unfused code; its backward is
the closed form `rotate_half^T(g * sin) + g * cos` (`rotate_half^T(y) = [y2, -y1]`), the same sums,
in the same memory layout, that autograd forms for the unfused graph (the extra terms there are exact
zeros), so the model's gradients are bit-identical too (tests/mcore). `cos` and `sin` are computed once
per frequency tensor (Megatron computes the frequencies once per model forward and passes the same tensor
to every layer) instead of once per call, kept in a `moe_gspo.tensor_cache.TensorCache`.

It takes the place of TE's `fused_apply_rotary_pos_emb` only where TE is absent
(`moe_gspo.mcore.shims.install_torch_fused_rope`, called by `build_gpt_model(fused_rope=True)`; config
`model.fused_rope`, default on: measured faster, `benchmarks/fastpath_bench.py`); the packed-sequence
(`thd`) variant is not provided, so `apply_rope_fusion` stays off for packed sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_gspo.tensor_cache import TensorCache


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_transposed(y: Tensor) -> Tensor:
    """The adjoint of `_rotate_half`: `[y1, y2] -> [y2, -y1]`."""
    y1, y2 = torch.chunk(y, 2, dim=-1)
    return torch.cat((y2, -y1), dim=-1)


class _RotaryBshd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return t * cos + _rotate_half(t) * sin

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        # this operand order gives the sum the contiguous layout autograd's sum has for the unfused graph;
        # `grad * cos + ...` would keep grad's strides, and the q/k norms' weight gradients (reductions
        # over it) would then add in another order (1e-10 apart)
        return _rotate_half_transposed(grad * sin) + grad * cos, None, None


_cos_sin = TensorCache(leave_inference_mode=False)
"""`cos(freqs)` and `sin(freqs)` in a dtype for the last frequency tensor seen (one entry: the same tensor
object, held there so that its id cannot be reused, at the same version)."""


def _cos_sin_of(freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _cos_sin("cos_sin", (freqs,), lambda f: (torch.cos(f).to(dtype), torch.sin(f).to(dtype)), extra=(dtype,))


def rope_bshd(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE on `t` [s, b, h, d] with frequencies `freqs` [s, 1, 1, rot_dim] (TE's `fused_apply_rotary_pos_emb`
    signature); dims past `rot_dim` pass through. Interleaved rotation falls back to Megatron's own code."""
    if interleaved or freqs.requires_grad:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    rot_dim = freqs.shape[-1]
    cos, sin = _cos_sin_of(freqs, t.dtype)
    if rot_dim == t.shape[-1]:
        return _RotaryBshd.apply(t, cos, sin)
    return torch.cat((_RotaryBshd.apply(t[..., :rot_dim], cos, sin), t[..., rot_dim:]), dim=-1)

"""Megatron's local core attention computed by one `torch.nn.functional.scaled_dot_product_attention` call.

`model.sdpa_attention=true` (the default) builds the learner's attention layers with
`SDPADotProductAttention` through the layer spec (Megatron's own extension point; Megatron is not
patched), where the spec has upstream's local `DotProductAttention` (no Transformer Engine). Upstream
computes attention as `baddbmm` -> masked softmax -> `bmm` in the `[s, b, heads, dim]` layout, with
grouped-query keys and values repeated to every query head: about fifteen ops forward and more
backward, each with its own Python and autograd overhead, which dominates small models on CPU; on a
GPU it also materialises the `[b, heads, s, s]` scores. This subclass computes the same function (same
mask semantics: Megatron's boolean mask, True = masked; scale `1/sqrt(head dim)` or the config's
`softmax_scale`) with torch's fused kernel (its flash kernel on CPU; flash / memory-efficient kernels on
CUDA) and grouped-query attention natively (`enable_gqa`). It has no parameters, so checkpoints and
weight conversion see no difference. Same maths up to float rounding (the fused kernel sums in another
order; `tests/mcore/test_sdpa_attention.py` compares outputs and gradients with upstream's).

It falls back to upstream's forward for what it does not cover: packed sequences, an attention bias,
a softmax offset (off-by-one / learnable softmax), sliding-window layers, query-key layer scaling,
attention dropout while training, and a missing or non-boolean mask (the learner always passes its
explicit boolean causal mask, `moe_gspo.mcore.model.causal_mask`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPADotProductAttention(DotProductAttention):
    """`DotProductAttention` whose forward is one fused `scaled_dot_product_attention` call."""

    def _fused_ok(self, attention_mask, attention_bias, packed_seq_params) -> bool:
        c = self.config
        dropout = self.attention_dropout.p if self.training else 0.0
        return (packed_seq_params is None and attention_bias is None and self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None and not c.apply_query_key_layer_scaling
                and dropout == 0.0 and attention_mask is not None and attention_mask.dtype == torch.bool)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._fused_ok(attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        sq, b, num_heads, _ = query.shape
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # The mask as given, like upstream's unfused softmax (whatever attn_mask_type says); SDPA's boolean
        # mask is the opposite of Megatron's: True = attend.
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, v_BGSD, attn_mask=attention_mask.logical_not(), scale=self.softmax_scale,
            enable_gqa=num_heads != k_BGSD.shape[1])
        # [b, heads, sq, dim] -> [sq, b, heads * dim], upstream's output layout
        return out_BHSD.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def with_sdpa_attention(block_spec):
    """A copy of a GPT decoder block spec whose layers build `SDPADotProductAttention` where the spec has
    upstream's local `DotProductAttention`; returns (spec, number of layers changed)."""
    spec = copy.deepcopy(block_spec)
    found = 0
    for layer in spec.layer_specs:
        attn = getattr(layer.submodules, "self_attention", None)
        core = getattr(getattr(attn, "submodules", None), "core_attention", None)
        if core is DotProductAttention:
            attn.submodules.core_attention = SDPADotProductAttention
            found += 1
        elif getattr(core, "module", None) is DotProductAttention:
            core.module = SDPADotProductAttention
            found += 1
    return spec, found


__all__ = ["SDPADotProductAttention", "with_sdpa_attention"]

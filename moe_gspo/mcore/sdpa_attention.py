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

No mask, causal layer: **flash attention.** The learner's sequences are right-padded and start at position
0, so their mask is plain causal; a model whose attention layers all take it as implied
(`build_gpt_model` sets `model.implicit_causal_mask`) gets `attention_mask=None` from
`moe_gspo.mcore.model.forward_logits`, and this class calls SDPA with `is_causal=True` instead of an
explicit `[s, s]` mask, which CUDA's flash kernel needs (an explicit mask rules it out). On the CPU the
two give bit-identical outputs and gradients (tests/mcore).

It falls back to upstream's forward for what it does not cover: packed sequences, an attention bias,
a softmax offset (off-by-one / learnable softmax), sliding-window layers, query-key layer scaling,
attention dropout while training, and a non-boolean mask; a missing mask is then made explicit on the
query's device first (upstream builds its default causal mask on "cuda").
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPADotProductAttention(DotProductAttention):
    """`DotProductAttention` whose forward is one fused `scaled_dot_product_attention` call."""

    def _fused_ok(self, attention_mask, attention_bias, packed_seq_params) -> bool:
        c = self.config
        dropout = self.attention_dropout.p if self.training else 0.0
        return (packed_seq_params is None and attention_bias is None and self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None and not c.apply_query_key_layer_scaling
                and dropout == 0.0 and (attention_mask is None or attention_mask.dtype == torch.bool))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        assert attention_mask is not None or causal, "no attention mask for a layer that is not causal"
        if not self._fused_ok(attention_mask, attention_bias, packed_seq_params):
            if attention_mask is None:  # upstream's default causal mask is built on "cuda": make it here
                sq, sk = query.shape[0], key.shape[0]
                attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1 + sk - sq)[None, None]
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        sq, b, num_heads, _ = query.shape
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:  # plain causal, implied: flash attention where the device has it
            assert sq == key.shape[0], "an implied causal mask is for self-attention over the whole sequence"
            mask, is_causal = None, True
        else:  # the mask as given, like upstream's unfused softmax (whatever attn_mask_type says); SDPA's
            mask, is_causal = attention_mask.logical_not(), False  # boolean mask is Megatron's negated
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, v_BGSD, attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale,
            enable_gqa=num_heads != k_BGSD.shape[1])
        # [b, heads, sq, dim] -> [sq, b, heads * dim], upstream's output layout
        return out_BHSD.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def with_sdpa_attention(block_spec):
    """A copy of a GPT decoder block spec whose layers build `SDPADotProductAttention` where the spec has
    upstream's local `DotProductAttention`; returns (spec, number of layers that now build it). Layers may
    share one spec object (Megatron's MoE layers do)."""
    spec = copy.deepcopy(block_spec)

    def core_of(layer):
        attn = getattr(layer.submodules, "self_attention", None)
        return attn, getattr(getattr(attn, "submodules", None), "core_attention", None)

    for layer in spec.layer_specs:
        attn, core = core_of(layer)
        if core is DotProductAttention:
            attn.submodules.core_attention = SDPADotProductAttention
        elif getattr(core, "module", None) is DotProductAttention:
            core.module = SDPADotProductAttention
    cores = [core_of(layer)[1] for layer in spec.layer_specs]
    return spec, sum(SDPADotProductAttention in (core, getattr(core, "module", None)) for core in cores)


__all__ = ["SDPADotProductAttention", "with_sdpa_attention"]

"""Model FLOPs of the learner's passes and model FLOPs utilization (MFU), from the model's config (pure).

The count follows PaLM (Chowdhery et al. 2022, appendix B) as torchtitan and nanoGPT use it: a training
step on a sequence of `T` tokens costs, per token,

    6 N_active + 12 L a d T

where `N_active` is the number of parameters a token multiplies with (every matmul weight it passes
through: per layer the fused QKV `(a + 2g) d H`, the output projection `H a d`, the router `E H` and
its `k` experts `k 3 I H` in a MoE layer, or the dense MLP `3 I_d H`; and the LM head `V H`; the input
embedding is a lookup and norms are negligible, so neither counts), `6 = 2` (multiply-add) `x 3`
(forward, and backward for inputs and for weights), and `12 L a d T` the attention scores and their
weighted sum (`2 x 2 a d T` per token and layer, forward and backward), over the full `T x T` matrix
(causal masking not discounted, as in PaLM's formula). A forward-only pass (the old-policy log-probs)
costs a third. These are *model* FLOPs: activation recomputation re-runs forwards that are not
counted, and padding tokens are not counted (each sequence at its real length).

MFU = model FLOPs / seconds / the accelerator's peak dense bf16 FLOP/s.
"""

from __future__ import annotations

from typing import Iterable

from moe_gspo.plan.params import Geometry


def active_matmul_params(geom: Geometry) -> int:
    """`N_active`: matmul parameters one token passes through (see the module docstring)."""
    g = geom
    attn = (g.num_heads + 2 * g.num_kv_heads) * g.head_dim * g.hidden + g.hidden * g.num_heads * g.head_dim
    moe = g.num_experts * g.hidden + g.top_k * 3 * g.moe_intermediate * g.hidden
    dense = 3 * g.intermediate * g.hidden
    mlp = sum(moe if is_moe else dense for is_moe in g.moe_layers)
    return g.num_layers * attn + mlp + g.vocab_size * g.hidden


def train_flops(geom: Geometry, seq_lens: Iterable[int]) -> float:
    """Model FLOPs of one forward + backward over sequences of these lengths."""
    n = active_matmul_params(geom)
    attn = 12 * geom.num_layers * geom.num_heads * geom.head_dim
    return float(sum(6 * n * T + attn * T * T for T in seq_lens))


def forward_flops(geom: Geometry, seq_lens: Iterable[int]) -> float:
    """Model FLOPs of one forward pass (a third of `train_flops`)."""
    return train_flops(geom, seq_lens) / 3.0


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the peak (a fraction, 0-1)."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError(f"mfu needs positive seconds and peak, got seconds={seconds}, peak={peak_flops_per_s}")
    return flops / seconds / peak_flops_per_s

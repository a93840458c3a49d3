"""Megatron's `SequentialMLP` experts computed as two grouped (or batched) matmuls instead of a loop over experts.

`model.batched_experts=true` builds the MoE layers with `BatchedSequentialMLP` through the layer
spec (Megatron's own extension point; Megatron is not patched). The parameters are exactly
`SequentialMLP`'s (`local_experts.{i}.linear_fc1/linear_fc2`), so weight conversion, checkpoints,
expert parallelism, DDP and routing replay see no difference. Only the forward changes: the local
experts' weights are stacked and an MoE layer runs 2 GEMMs over all its local experts instead of
2 x num_local_experts small matmuls, each with its own Python and autograd overhead:

- **grouped** (CPU, where torch has a `_grouped_mm` kernel and the widths meet its 16-byte stride
  rule): the tokens, already permuted by expert, stay contiguous and `torch._grouped_mm` multiplies
  each expert's rows by that expert's weights (offsets = cumulative tokens per expert); no padding.
  Its forward and gradients equal the loop's (`tests/mcore/test_batched_experts.py`).
- **padded bmm** (elsewhere): the tokens are scattered into an `[experts, max tokens per expert,
  hidden]` buffer for two `bmm`s; the padding rows are zeros and dropped. Padding to the busiest
  expert costs compute when the load is uneven.

Same maths as the loop; the stacked weights are a copy per forward, so this is for small models (the
tiny CPU configs, where the per-expert overhead dominates: `python -m benchmarks.fastpath_bench`)
— not for real checkpoints on GPUs, which use Transformer Engine's grouped GEMM. Falls back to the
loop for what it does not cover (one local expert, expert biases, expert tensor parallelism, FP8/FP4,
probabilities on the input).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


def _grouped_mm_ok(x_TH: torch.Tensor, ffn: int) -> bool:
    """Whether `torch._grouped_mm` can multiply these experts here: a CPU kernel (torch >= 2.9) whose
    operands' row strides (hidden and expert widths, in bytes) are multiples of 16."""
    size = x_TH.element_size()
    return (x_TH.device.type == "cpu" and hasattr(torch, "_grouped_mm") and x_TH.shape[1] * size % 16 == 0
            and ffn * size % 16 == 0 and x_TH.data_ptr() % 16 == 0)


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """`t`, whose gradient is made contiguous before it reaches `_grouped_mm`'s backward (which
    refuses expanded gradients, such as the one of a plain `.sum()`)."""
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


class BatchedSequentialMLP(SequentialMLP):
    """`SequentialMLP` with a grouped (or batched) forward over its local experts (same parameters)."""

    def _batched_ok(self, hidden: torch.Tensor) -> bool:
        c = self.config
        fc1, fc2 = self.local_experts[0].linear_fc1, self.local_experts[0].linear_fc2
        return (self.num_local_experts > 1 and hidden.shape[0] > 0 and not (c.fp8 or c.fp4)
                and not c.moe_apply_probs_on_input and self.tp_group.size() == 1
                and getattr(fc1, "bias", None) is None and getattr(fc2, "bias", None) is None
                and not c.bias_activation_fusion and not getattr(c, "use_te_activation_func", False))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x_TH = permuted_local_hidden_states
        if not self._batched_ok(x_TH):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        E, (T, H) = self.num_local_experts, x_TH.shape
        w1_EHF = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        w2_EFH = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        if _grouped_mm_ok(x_TH, w2_EFH.shape[1]):
            offs_E = torch.cumsum(tokens_per_expert.to(device=x_TH.device), 0).to(torch.int32)
            h_TF = _contiguous_grad(torch._grouped_mm(x_TH, w1_EHF, offs=offs_E))
            h_TF = self._activation(h_TF, permuted_probs)
            return _contiguous_grad(torch._grouped_mm(h_TF, w2_EFH, offs=offs_E)), None
        counts_E = tokens_per_expert.to(device=x_TH.device, dtype=torch.long)
        max_tokens = int(counts_E.max())
        # padded slot of each token: expert e's tokens are rows e*max_tokens + 0..count_e-1
        expert_T = torch.repeat_interleave(torch.arange(E, device=x_TH.device), counts_E)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        slot_T = expert_T * max_tokens + (torch.arange(T, device=x_TH.device) - starts_E[expert_T])
        x_EMH = x_TH.new_zeros(E * max_tokens, H).index_copy(0, slot_T, x_TH).view(E, max_tokens, H)
        probs_EM = permuted_probs.new_zeros(E * max_tokens).index_copy(0, slot_T, permuted_probs).view(E, max_tokens)
        h_EMF = self._activation(torch.bmm(x_EMH, w1_EHF), probs_EM)
        out_TH = torch.bmm(h_EMF, w2_EFH).reshape(E * max_tokens, H).index_select(0, slot_T)
        return out_TH, None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Megatron's `MLP.forward` between its two linears (unfused path): the (gated) activation, then
        the routing probabilities as `per_token_scale`; `probs` has the shape of `h` without its last dim."""
        c = self.config
        if c.gated_linear_unit:
            h_glu, h_lin = torch.chunk(h, 2, dim=-1)
            if (val := c.activation_func_clamp_value) is not None:
                h_glu, h_lin = h_glu.clamp(min=None, max=val), h_lin.clamp(min=-val, max=val)
            out = c.activation_func(h_glu) * (h_lin + c.glu_linear_offset)
        else:
            out = c.activation_func(h)
        return (out * probs.unsqueeze(-1)).to(out.dtype)


def with_batched_experts(block_spec):
    """A copy of a GPT decoder block spec whose MoE layers build `BatchedSequentialMLP` experts."""
    spec = copy.deepcopy(block_spec)
    found = 0
    for layer in spec.layer_specs:
        mlp = getattr(layer.submodules, "mlp", None)
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if experts is not None and getattr(experts, "module", None) is SequentialMLP:
            experts.module = BatchedSequentialMLP
            found += 1
    return spec, found

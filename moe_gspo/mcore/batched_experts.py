"""Megatron's `SequentialMLP` experts computed as two batched matmuls instead of a loop over experts.

`model.batched_experts=true` builds the MoE layers with `BatchedSequentialMLP` through the layer
spec (Megatron's own extension point; Megatron is not patched). The parameters are exactly
`SequentialMLP`'s (`local_experts.{i}.linear_fc1/linear_fc2`), so weight conversion, checkpoints,
expert parallelism, DDP and routing replay see no difference. Only the forward changes: the local
experts' weights are stacked and the tokens (already permuted by expert) are scattered into an
`[experts, max tokens per expert, hidden]` buffer, so an MoE layer runs 2 `bmm`s instead of
2 x num_local_experts small matmuls, each with its own Python and autograd overhead. Same maths (the
padding rows are zeros and dropped); the stacked weights are a copy per forward, so this is for small
models (the tiny CPU configs), where that overhead dominates — not for real checkpoints on GPUs,
which use Transformer Engine's grouped GEMM. Falls back to the loop for what it does not cover
(one local expert, expert biases, expert tensor parallelism, FP8/FP4, probabilities on the input).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class BatchedSequentialMLP(SequentialMLP):
    """`SequentialMLP` with a batched forward over its local experts (same parameters)."""

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
        counts_E = tokens_per_expert.to(device=x_TH.device, dtype=torch.long)
        max_tokens = int(counts_E.max())
        # padded slot of each token: expert e's tokens are rows e*max_tokens + 0..count_e-1
        expert_T = torch.repeat_interleave(torch.arange(E, device=x_TH.device), counts_E)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        slot_T = expert_T * max_tokens + (torch.arange(T, device=x_TH.device) - starts_E[expert_T])
        x_EMH = x_TH.new_zeros(E * max_tokens, H).index_copy(0, slot_T, x_TH).view(E, max_tokens, H)
        w1_EHF = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        w2_EFH = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        h_EMF = torch.bmm(x_EMH, w1_EHF)
        c = self.config
        if c.gated_linear_unit:  # as Megatron's MLP.forward (unfused path)
            h_glu, h_lin = torch.chunk(h_EMF, 2, dim=-1)
            if (val := c.activation_func_clamp_value) is not None:
                h_glu, h_lin = h_glu.clamp(min=None, max=val), h_lin.clamp(min=-val, max=val)
            h_EMF = c.activation_func(h_glu) * (h_lin + c.glu_linear_offset)
        else:
            h_EMF = c.activation_func(h_EMF)
        probs_EM1 = permuted_probs.new_zeros(E * max_tokens).index_copy(0, slot_T, permuted_probs)
        h_EMF = (h_EMF * probs_EM1.view(E, max_tokens, 1)).to(h_EMF.dtype)  # MLP's per_token_scale
        out_TH = torch.bmm(h_EMF, w2_EFH).reshape(E * max_tokens, H).index_select(0, slot_T)
        return out_TH, None


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

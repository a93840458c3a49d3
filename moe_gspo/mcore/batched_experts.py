"""Megatron's `SequentialMLP` experts computed as one grouped GEMM per projection instead of a loop over experts.

`model.batched_experts=true` builds the MoE layers with `BatchedSequentialMLP` through the layer
spec (Megatron's own extension point; Megatron is not patched). The parameters are exactly
`SequentialMLP`'s (`local_experts.{i}.linear_fc1/linear_fc2`), so weight conversion, checkpoints,
expert parallelism, DDP and routing replay see no difference. Only the forward changes: an MoE layer
runs 2 GEMMs over all its local experts instead of 2 x num_local_experts small matmuls, each with its
own Python and autograd overhead, and (upstream's loop) a `tokens_per_expert.tolist()` host sync:

- **grouped** (`torch._grouped_mm`: on the CPU in any float dtype, on CUDA in bfloat16 on sm90+; the
  widths meet its 16-byte stride rule): the tokens, already permuted by expert, stay contiguous and each
  expert's rows are multiplied by that expert's weights (offsets = cumulative tokens per expert, moved
  to the device without a sync); no padding. Forward and gradients equal the loop's
  (`tests/mcore/test_batched_experts.py`, on CUDA too when present).
- **padded bmm** (elsewhere: fp32 on CUDA, GPUs before sm90): the tokens are scattered into an
  `[experts, max tokens per expert, hidden]` buffer for two `bmm`s; the padding rows are zeros and
  dropped. Padding to the busiest expert costs compute when the load is uneven. (Megatron's dispatcher
  hands `tokens_per_expert` over on the host, so its maximum is read without a sync.)

**Weights without a copy.** A grouped GEMM takes the experts' weights as one `[E, out, in]` tensor.
`stack_weights_()` (run at construction and by `build_gpt_model` after the model has moved to its
device) lays each projection's local expert weights out back to back in one storage; each parameter
stays its own `nn.Parameter` (same names, `_base` None), a slice of it. The forward then views that
storage as `[E, out, in]` (no copy) and an autograd function hands each expert its slice of the
gradient. Whoever moves the parameters afterwards breaks the layout: the forward checks it (pointer
arithmetic, no sync) and stacks the weights with a copy when it does not hold (`num_weight_copies`
counts those forwards). Megatron's distributed optimizer does that: its buffer holds the parameters in
reverse order, fc1 and fc2 interleaved, so with `train.distributed_optimizer` (the CUDA default) every
forward copies the weights, as before (a known cost, `docs/gpu.md`).

Falls back to the loop for what it does not cover (one local expert, expert biases, expert tensor
parallelism, FP8/FP4, probabilities on the input). With Transformer Engine, Megatron's own
`TEGroupedMLP` (`moe_grouped_gemm`) is used instead (`moe_gspo.mcore.model.build_gpt_model`).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


def grouped_mm_supported(x_TH: torch.Tensor, ffn: int) -> bool:
    """Whether `torch._grouped_mm` can multiply these experts here: a CPU kernel (torch >= 2.9, any float
    dtype) or CUDA's (bfloat16, compute capability >= 9.0), with the operands' row strides (hidden and
    expert widths, in bytes) multiples of 16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    size = x_TH.element_size()
    aligned = x_TH.shape[1] * size % 16 == 0 and ffn * size % 16 == 0 and x_TH.data_ptr() % 16 == 0
    if x_TH.device.type == "cpu":
        return aligned
    if x_TH.device.type == "cuda":
        return aligned and x_TH.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_TH.device) >= (9, 0)
    return False


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """`t`, whose gradient is made contiguous before it reaches `_grouped_mm`'s backward (which
    refuses expanded gradients, such as the one of a plain `.sum()`)."""
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def _alias(storage_of: torch.Tensor, offset: int, size, stride) -> torch.Tensor:
    """A tensor over `storage_of`'s storage that autograd does not know as a view of it (`_base` None)."""
    return torch.empty(0, dtype=storage_of.dtype, device=storage_of.device).set_(
        storage_of.untyped_storage(), offset, tuple(size), tuple(stride))


def stacked_view(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """`[E, *w.shape]` over E same-shaped contiguous weights that lie at one constant, ascending, non-overlapping
    step in one storage (what `stack_weights_` lays out), without a copy; None when they do not."""
    w0 = weights[0]
    ptr, shape, step = w0.untyped_storage().data_ptr(), w0.shape, None
    offsets = []
    for w in weights:
        if w.shape != shape or not w.is_contiguous() or w.untyped_storage().data_ptr() != ptr:
            return None
        offsets.append(w.storage_offset())
    if len(offsets) > 1:
        step = offsets[1] - offsets[0]
        if step < w0.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
            return None
    with torch.no_grad():
        return _alias(w0, offsets[0], (len(weights), *shape), (step or w0.numel(), *w0.stride()))


class _StackedWeights(torch.autograd.Function):
    """The experts' weights as one `[E, out, in]` tensor: forward returns the no-copy view `stacked`,
    backward hands each weight its slice of the gradient."""

    @staticmethod
    def forward(ctx, stacked: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return stacked.detach()

    @staticmethod
    def backward(ctx, grad_EOI: torch.Tensor):
        return (None, *grad_EOI.unbind(0))


class BatchedSequentialMLP(SequentialMLP):
    """`SequentialMLP` with a grouped (or batched) forward over its local experts (same parameters)."""

    num_weight_copies: int = 0
    """Forwards that had to stack the expert weights with a copy (their layout was broken since
    `stack_weights_`, e.g. by the distributed optimizer's buffer)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stack_weights_()

    def stack_weights_(self) -> None:
        """Lay each projection's local expert weights out back to back in one storage (a one-time copy),
        keeping every parameter object and name; a no-op where they already are."""
        if self.num_local_experts < 2:
            return
        for fc in ("linear_fc1", "linear_fc2"):
            params = [getattr(e, fc).weight for e in self.local_experts]
            if stacked_view(params) is not None:
                continue
            with torch.no_grad():
                stacked = torch.stack([p.detach() for p in params])  # [E, out, in], contiguous
                for i, p in enumerate(params):
                    p.data = _alias(stacked, i * p.numel(), p.shape, stacked.stride()[1:])

    def _stacked(self, fc: str) -> torch.Tensor:
        weights = [getattr(e, fc).weight for e in self.local_experts]
        view = stacked_view(weights)
        if view is None:
            self.num_weight_copies += 1
            return torch.stack(weights)
        return _StackedWeights.apply(view, *weights) if torch.is_grad_enabled() else view

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
        w1_EHF = self._stacked("linear_fc1").transpose(1, 2)
        w2_EFH = self._stacked("linear_fc2").transpose(1, 2)
        if grouped_mm_supported(x_TH, w2_EFH.shape[1]):
            offs_E = torch.cumsum(tokens_per_expert, 0).to(device=x_TH.device, dtype=torch.int32, non_blocking=True)
            h_TF = _contiguous_grad(torch._grouped_mm(x_TH, w1_EHF, offs=offs_E))
            h_TF = self._activation(h_TF, permuted_probs)
            return _contiguous_grad(torch._grouped_mm(h_TF, w2_EFH, offs=offs_E)), None
        max_tokens = int(tokens_per_expert.max())  # Megatron's dispatchers give the counts on the host
        counts_E = tokens_per_expert.to(device=x_TH.device, dtype=torch.long)
        # padded slot of each token: expert e's tokens are rows e*max_tokens + 0..count_e-1
        expert_T = torch.repeat_interleave(torch.arange(E, device=x_TH.device), counts_E, output_size=T)
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


def stack_expert_weights_(model) -> None:
    """`BatchedSequentialMLP.stack_weights_` on every such module of `model` (after it moved devices)."""
    for module in model.modules():
        if isinstance(module, BatchedSequentialMLP):
            module.stack_weights_()


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

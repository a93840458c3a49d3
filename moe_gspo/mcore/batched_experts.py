"""Megatron's `SequentialMLP` experts computed as one grouped GEMM per projection instead of a loop over experts.

`model.batched_experts=true` builds the MoE layers with `BatchedSequentialMLP` through the layer
spec (Megatron's own extension point; Megatron is not patched). The parameters are exactly
`SequentialMLP`'s (`local_experts.{i}.linear_fc1/linear_fc2`), so weight conversion, checkpoints,
expert parallelism, DDP and routing replay see no difference. Only the forward changes: an MoE layer
runs 2 GEMMs over all its local experts instead of 2 x num_local_experts small matmuls, each with its
own Python and autograd overhead, and (upstream's loop) a `tokens_per_expert.tolist()` host sync:

- **grouped** (`torch._grouped_mm`, torch >= 2.9: on the CPU in any float dtype, on CUDA in bfloat16 on
  compute capability major 9 or 10 only; the widths meet its 16-byte stride rule): the tokens, already permuted
  by expert, stay contiguous and each expert's rows are multiplied by that expert's weights (offsets =
  cumulative tokens per expert, staged in pinned host memory and moved to the device without a sync);
  no padding. Forward and gradients equal the loop's (`tests/mcore/test_batched_experts.py`, on CUDA
  too when present). Why only majors 9 and 10 (issue 40): torch's fast grouped GEMM kernels exist for
  those; on other GPUs (e.g. sm_120, or a future major) `_grouped_mm` falls back to copying the offsets
  to the host (`offs.cpu()`, a sync) and a loop over experts. On major 10, pytorch#172439 reports
  non-zero weight gradients for experts that received no tokens, so there the weight gradients of
  experts without tokens are set to zero (`mask_empty_expert_grads`).
- **padded bmm** (elsewhere: fp32 on CUDA, other GPUs): the tokens are scattered into an
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
forward copies the weights. The grouped layout (`model.expert_layout=grouped`,
`moe_gspo.mcore.grouped_experts`: one parameter per projection) has no such copy, and is what
`model.expert_layout=auto` picks on the GPUs with fast grouped GEMMs; this per-expert path stays the CPU's
(measured no slower there, and the default run's numbers are its own).

Falls back to the loop for what it does not cover (one local expert, expert biases, expert tensor
parallelism, FP8/FP4, probabilities on the input). With Transformer Engine, Megatron's own
`TEGroupedMLP` (`moe_grouped_gemm`) is used instead (`moe_gspo.mcore.model.build_gpt_model`).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _cuda_capability(device) -> tuple[int, int]:
    """The compute capability of a CUDA device, read once per device and process (it does not change; the
    grouped-GEMM rules ask on every layer forward). A function of its own so that tests can fake it."""
    device = torch.device(device)
    return _capability_of(torch.cuda.current_device() if device.index is None else device.index)


def _torch_version() -> str:
    """This process's torch version (a function of its own so that tests can fake an older one)."""
    return str(torch.__version__)


FAST_GROUPED_MM_MAJORS = (9, 10)
"""Compute-capability majors with torch's fast grouped-GEMM kernels (sm90: H100/H200; sm100: B200);
elsewhere `torch._grouped_mm` syncs (`offs.cpu()`) and loops over experts."""
GROUPED_MM_MIN_TORCH = (2, 9)
"""The oldest torch whose `torch._grouped_mm` the grouped paths use: before CUTLASS 4.0 (torch <= 2.8) the
weight-gradient kernel could hang on experts without tokens (pytorch#152668, fixed by #157376 / #157903),
and torch 2.8 has no CPU kernel."""
GROUPED_MM_MAX_GROUPS = 1023
"""The most groups (local experts) one `torch._grouped_mm` call takes (the CUDA kernel checks `< 1024`)."""


def grouped_mm_torch_problem(version: str | None = None) -> str | None:
    """None where this torch (`version`, default the running one) may run the grouped paths' `torch._grouped_mm`;
    else why not, in a few words."""
    version = _torch_version() if version is None else version
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) >= GROUPED_MM_MIN_TORCH:
        return None
    need = ".".join(map(str, GROUPED_MM_MIN_TORCH))
    return (f"torch._grouped_mm needs torch >= {need} here (this is torch {version}: before CUTLASS 4.0 its "
            f"weight-gradient kernel could hang on experts without tokens, pytorch#152668)")


def old_torch(version: str | None = None) -> str | None:
    """`grouped_mm_torch_problem` in a few words for the expert-path line ("torch 2.8.0 < 2.9"); None where
    this torch may run the grouped paths."""
    version = _torch_version() if version is None else version
    if grouped_mm_torch_problem(version) is None:
        return None
    return f"torch {version} < {'.'.join(map(str, GROUPED_MM_MIN_TORCH))}"


def fast_kernel_problem(kind: str, capability: tuple[int, int] | None, dtype: torch.dtype, *,
                        auto: bool = False) -> str | None:
    """Why `torch._grouped_mm` has no fast kernel for `dtype` on this device kind and capability, in a few
    words (None: it has): the torch version, the device ("no CUDA" where `auto` asks: the CPU kernel exists but
    `model.expert_layout=auto` keeps the per-expert layout there), the dtype (bf16 on CUDA), the compute
    capability (majors `FAST_GROUPED_MM_MAJORS`). The order is the one the expert-path line names first."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {_torch_version()} has no torch._grouped_mm"
    if (too_old := old_torch()) is not None:
        return too_old
    if kind == "cpu":
        return "no CUDA" if auto else None
    if kind != "cuda":
        return f"no CUDA (device {kind})"
    if dtype != torch.bfloat16:
        return f"params {str(dtype).removeprefix('torch.')}, grouped needs bf16"
    if capability[0] not in FAST_GROUPED_MM_MAJORS:
        return (f"compute capability {capability[0]}.{capability[1]}, grouped needs "
                + " or ".join(f"{m}.x" for m in FAST_GROUPED_MM_MAJORS))
    return None


def grouped_mm_problem(x_TH: torch.Tensor, ffn: int, *, device: tuple[str, tuple[int, int] | None] | None = None
                       ) -> str | None:
    """Why `grouped_mm_supported(x_TH, ffn)` is False, in a few words (None when it is True)."""
    kind, capability = device or kernel_device(x_TH.device)
    if (problem := fast_kernel_problem(kind, capability, x_TH.dtype)) is not None:
        return problem
    size = x_TH.element_size()
    if x_TH.shape[1] * size % 16 or ffn * size % 16:
        return f"widths {x_TH.shape[1]} and {ffn} x {size} B not multiples of 16 B"
    if x_TH.data_ptr() % 16:
        return "rows not 16-byte aligned"
    return None


def kernel_device(device) -> tuple[str, tuple[int, int] | None]:
    """`(device type, CUDA compute capability or None)`: what the grouped-GEMM and SwiGLU rules read of a
    device (the capability cached by `_cuda_capability`). One function so that a test can present the `meta`
    device as a CUDA one (the grouped GEMM's contract at Qwen3-30B-A3B shapes, tests/mcore)."""
    device = torch.device(device)
    return (device.type, _cuda_capability(device)) if device.type == "cuda" else (device.type, None)


def grouped_mm_supported(x_TH: torch.Tensor, ffn: int, *, device: tuple[str, tuple[int, int] | None] | None = None
                         ) -> bool:
    """Whether `torch._grouped_mm` can multiply these experts here: torch >= 2.9 (`GROUPED_MM_MIN_TORCH`) with
    a CPU kernel (any float dtype) or CUDA's fast kernels (bfloat16, compute capability major 9 or 10), with
    the operands' row strides (hidden and expert widths, in bytes) multiples of 16. `device`: `x_TH`'s
    `kernel_device`, when the caller has it already."""
    if not hasattr(torch, "_grouped_mm") or grouped_mm_torch_problem() is not None:
        return False
    size = x_TH.element_size()
    aligned = x_TH.shape[1] * size % 16 == 0 and ffn * size % 16 == 0 and x_TH.data_ptr() % 16 == 0
    kind, capability = device or kernel_device(x_TH.device)
    if kind == "cpu":
        return aligned
    if kind == "cuda":
        return aligned and x_TH.dtype == torch.bfloat16 and capability[0] in FAST_GROUPED_MM_MAJORS
    return False


def masks_empty_expert_grads(device, *, kind: tuple[str, tuple[int, int] | None] | None = None) -> bool:
    """Whether the grouped path zeroes the weight gradients of experts without tokens on `device`: CUDA
    capability major 10, where pytorch#172439 reports non-zero ones from `_grouped_mm`'s backward. `kind`:
    `device`'s `kernel_device`, when the caller has it already."""
    kind, capability = kind or kernel_device(device)
    return kind == "cuda" and capability[0] == 10


class _MaskEmptyExpertGrads(torch.autograd.Function):
    """Identity on `[E, ...]` expert weights; the backward sets the gradient of experts `e` with
    `nonempty_E[e]` False to zero (`torch.where`, so a NaN there goes too)."""

    @staticmethod
    def forward(ctx, w_E: torch.Tensor, nonempty_E: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(nonempty_E)
        return w_E.view_as(w_E)

    @staticmethod
    def backward(ctx, grad_E: torch.Tensor):
        nonempty_E, = ctx.saved_tensors
        keep = nonempty_E.view(-1, *([1] * (grad_E.dim() - 1)))
        return torch.where(keep, grad_E, torch.zeros((), dtype=grad_E.dtype, device=grad_E.device)), None


def mask_empty_expert_grads(w_E: torch.Tensor, nonempty_E: torch.Tensor) -> torch.Tensor:
    """`w_E` (`[E, ...]`), whose gradient is zero for the experts where the bool `nonempty_E` is False."""
    return _MaskEmptyExpertGrads.apply(w_E, nonempty_E)


def to_device_pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without a host sync: a host tensor bound for CUDA is staged in pinned memory, so that
    the non-blocking copy really is asynchronous (from pageable memory it is not); otherwise a plain `.to`."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _meets_stride_rule(w: torch.Tensor) -> bool:
    """`torch._grouped_mm`'s operand rule: one of the last two strides 1, the other at least the extent it
    steps over and a multiple of 16 bytes, and the data pointer 16-byte aligned."""
    size, (s0, s1), (n0, n1) = w.element_size(), w.stride()[-2:], w.shape[-2:]
    major = s0 if s1 == 1 and s0 >= max(1, n1) else (s1 if s0 == 1 and s1 >= max(1, n0) else None)
    return major is not None and major * size % 16 == 0 and w.data_ptr() % 16 == 0


@dataclass(frozen=True)
class ExpertGroups:
    """One layer forward's rows grouped by expert, prepared once for all its grouped GEMMs (`expert_groups`)."""

    kind: str
    """The rows' device type as the kernel rules see it (`kernel_device`: "cuda", "cpu", ...)."""
    fast: bool
    """`torch._grouped_mm` takes these operands (`grouped_mm_supported` and the weights' stride rule); else a
    loop over the experts' row blocks."""
    offs_E: torch.Tensor | None
    """int32 cumulative row counts on the rows' device (moved from pinned host memory, no sync); fast path only."""
    nonempty_E: torch.Tensor | None
    """bool, on the rows' device: experts with rows, whose weight gradients are kept (capability major 10,
    pytorch#172439, under autograd); None where no mask is needed."""
    slow_because: str | None = None
    """Why not the fast path, in a few words (`grouped_mm_problem`, the group count, the operands' dtype or
    strides); None on it."""


def expert_groups(x_TK: torch.Tensor, counts_E: torch.Tensor, *, ffn: int,
                  weights: tuple[torch.Tensor, ...] = ()) -> ExpertGroups:
    """The grouping of rows `x_TK` (`counts_E[e]` rows for expert e, in order; counts on the host, as Megatron's
    dispatchers give them) for grouped GEMMs whose widths are `x_TK`'s and `ffn` (and multiples of them), with
    the `[E, K, N]` weight operands `weights`: which kernel (`grouped_mm_supported`, the weights' dtype and
    16-byte strides and pointers, fewer than 1024 groups), the device offsets and the major-10 gradient mask,
    each computed once (the device capability is read once, and cached per device)."""
    device = kernel_device(x_TK.device)
    fast = (grouped_mm_supported(x_TK, ffn, device=device) and counts_E.numel() <= GROUPED_MM_MAX_GROUPS
            and _meets_stride_rule(x_TK) and all(w.dtype == x_TK.dtype and _meets_stride_rule(w) for w in weights))
    if not fast:
        return ExpertGroups(kind=device[0], fast=False, offs_E=None, nonempty_E=None,
                            slow_because=slow_reason(x_TK, counts_E, ffn=ffn, weights=weights, device=device))
    offs_E = to_device_pinned(torch.cumsum(counts_E, 0).to(torch.int32), x_TK.device)
    mask = masks_empty_expert_grads(x_TK.device, kind=device) and torch.is_grad_enabled()
    return ExpertGroups(kind=device[0], fast=True, offs_E=offs_E,
                        nonempty_E=to_device_pinned(counts_E > 0, x_TK.device) if mask else None)


def slow_reason(x_TK: torch.Tensor, counts_E: torch.Tensor, *, ffn: int, weights: tuple[torch.Tensor, ...],
                device: tuple[str, tuple[int, int] | None]) -> str:
    """Why `expert_groups` did not take the fast path, in a few words (called only off it)."""
    if (problem := grouped_mm_problem(x_TK, ffn, device=device)) is not None:
        return problem
    if counts_E.numel() > GROUPED_MM_MAX_GROUPS:
        return f"{counts_E.numel()} local experts > {GROUPED_MM_MAX_GROUPS} groups"
    if any(w.dtype != x_TK.dtype for w in weights):
        return f"weights {weights[0].dtype} != rows {x_TK.dtype}".replace("torch.", "")
    if not _meets_stride_rule(x_TK) or not all(_meets_stride_rule(w) for w in weights):
        return "operand strides off torch._grouped_mm's 16-byte rule"
    return "torch._grouped_mm not supported here"


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
        groups = expert_groups(x_TH, tokens_per_expert, ffn=w2_EFH.shape[1], weights=(w1_EHF, w2_EFH))
        if groups.fast:
            if groups.nonempty_E is not None:
                w1_EHF, w2_EFH = (mask_empty_expert_grads(w, groups.nonempty_E) for w in (w1_EHF, w2_EFH))
            h_TF = _contiguous_grad(torch._grouped_mm(x_TH, w1_EHF, offs=groups.offs_E))
            h_TF = self._activation(h_TF, permuted_probs)
            return _contiguous_grad(torch._grouped_mm(h_TF, w2_EFH, offs=groups.offs_E)), None
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
        return mlp_activation(self.config, h, probs)


def mlp_activation(c, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Megatron's `MLP.forward` between its two linears (unfused path) under `TransformerConfig` `c`: the
    (gated) activation, then the routing probabilities as `per_token_scale`; `probs` has the shape of `h`
    without its last dim."""
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


def swap_expert_module(block_spec, old: type, new: type):
    """A copy of a GPT decoder block spec whose MoE layers build `new` experts where they built `old`; and
    how many layers changed."""
    spec = copy.deepcopy(block_spec)
    found = 0
    for layer in spec.layer_specs:
        mlp = getattr(layer.submodules, "mlp", None)
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if experts is not None and getattr(experts, "module", None) is old:
            experts.module = new
            found += 1
    return spec, found


def with_batched_experts(block_spec):
    """A copy of a GPT decoder block spec whose MoE layers build `BatchedSequentialMLP` experts."""
    return swap_expert_module(block_spec, SequentialMLP, BatchedSequentialMLP)

"""The grouped experts' SwiGLU and routing probabilities as one autograd function (issue 48).

Between its two grouped GEMMs an MoE layer computes `silu(gate) * (up + glu_linear_offset) * probs` of the fc1
output `h = [gate | up]` ([T, 2F]) and each row's routing probability. Written out (`batched_experts.
mlp_activation`, Megatron's unfused `MLP` maths) that is 4-5 elementwise passes whose autograd graph keeps,
besides `h`, the SiLU output, the offset `up` and the GLU product: 3 more `[T, F]` tensors per MoE layer
than Megatron's fused `weighted_bias_swiglu_impl` (`WeightedSwiGLUFunction`), ~150 MB per layer at
Qwen3-30B-A3B's 4096-token micro-batches (T = 32768 rows, F = 768, bf16).

`SwiGLUWithProbs` is that fused function: it saves only `h` and `probs`, as Megatron's does, and computes
forward and backward (`swiglu_probs_forward` / `swiglu_probs_backward`, Megatron's `weighted_swiglu` /
`weighted_swiglu_back` formulas, plus the GLU offset) in float32, rounding once to the operands' dtypes. On
CUDA both are `torch.compile`d (one kernel each; `dynamic=True`, so the varying row count does not
recompile), the way Megatron's `jit_fuser` compiles its own. Where compiling fails (e.g. no C compiler for
Triton's launcher) one warning names the error and the same functions run uncompiled from then on (same
formulas, more passes). `moe_gspo.mcore.grouped_experts.GroupedExperts` uses it on CUDA only; the CPU keeps
the unfused maths, bit for bit today's numbers (tests/mcore/test_swiglu.py).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def swiglu_fusable(c) -> bool:
    """Whether `TransformerConfig` `c`'s expert activation is what `SwiGLUWithProbs` computes: a gated SiLU
    without clamping."""
    return bool(c.gated_linear_unit) and c.activation_func is F.silu and c.activation_func_clamp_value is None


def _acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the arithmetic's precision: float32, or float64 for float64 operands."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def swiglu_probs_forward(h: torch.Tensor, probs: torch.Tensor, offset: float) -> torch.Tensor:
    """`silu(gate) * (up + offset) * probs` of `h = [gate | up]` ([..., 2F]) and `probs` ([...]) in float32
    (float64 for float64 operands), rounded once to `h`'s dtype."""
    gate, up = _acc(h).chunk(2, dim=-1)
    return (F.silu(gate) * (up + offset) * _acc(probs).unsqueeze(-1)).to(h.dtype)


def swiglu_probs_backward(g: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, offset: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `swiglu_probs_forward` for the output gradient `g`: `(dh in h's dtype, dprobs in
    probs' dtype)`, in float32 or float64 as the forward (d silu(x)/dx = s (1 + x (1 - s)), s = sigmoid(x))."""
    gate, up = _acc(h).chunk(2, dim=-1)
    g = _acc(g)
    s = torch.sigmoid(gate)
    silu, lin = gate * s, up + offset
    g_p = g * _acc(probs).unsqueeze(-1)
    d_gate = g_p * lin * s * (1 + gate * (1 - s))
    d_probs = (g * silu * lin).sum(-1)
    return torch.cat([d_gate, g_p * silu], dim=-1).to(h.dtype), d_probs.to(probs.dtype)


class _Compiled:
    """`torch.compile`d `swiglu_probs_forward` / `swiglu_probs_backward`, compiled on first use (per process).
    A failure before a function's first compiled call succeeded (compiling happens then) gives one warning
    and the uncompiled functions from then on; after it, errors are the caller's (not a compile failure)."""

    def __init__(self):
        self.fns: dict | None = None
        self.ran: set[str] = set()
        self.error: str | None = None

    def __call__(self, name: str, *args):
        eager = {"forward": swiglu_probs_forward, "backward": swiglu_probs_backward}
        if self.error is None:
            if name in self.ran:
                return self.fns[name](*args)
            try:
                if self.fns is None:
                    self.fns = {k: torch.compile(fn, dynamic=True) for k, fn in eager.items()}
                out = self.fns[name](*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001  (a compiler missing or failing: the same maths, uncompiled)
                self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
                warnings.warn(f"moe_gspo.mcore.swiglu: torch.compile of the experts' SwiGLU failed ({self.error}); "
                              "it runs uncompiled (same maths, more memory passes)", RuntimeWarning, stacklevel=2)
            else:
                self.ran.add(name)
                return out
        return eager[name](*args)


COMPILED = _Compiled()
"""The process's compiled SwiGLU kernels (a cache of compiled code, compiled on first CUDA use)."""


def compile_status() -> str:
    """This process's compiled SwiGLU, in words: "compiled", "not compiled (<error>)" or "not used"."""
    if COMPILED.error is not None:
        return f"not compiled ({COMPILED.error})"
    return "compiled" if COMPILED.ran else "not used"


class SwiGLUWithProbs(torch.autograd.Function):
    """`swiglu_probs_forward(h, probs, offset)` saving only `h` and `probs` for the backward
    (`swiglu_probs_backward`); `compiled`: through `COMPILED` (CUDA)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, probs: torch.Tensor, offset: float, compiled: bool) -> torch.Tensor:
        ctx.save_for_backward(h, probs)
        ctx.offset, ctx.compiled = offset, compiled
        if compiled:
            return COMPILED("forward", h, probs, offset)
        return swiglu_probs_forward(h, probs, offset)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        h, probs = ctx.saved_tensors
        g = g.contiguous()
        if ctx.compiled:
            dh, dprobs = COMPILED("backward", g, h, probs, ctx.offset)
        else:
            dh, dprobs = swiglu_probs_backward(g, h, probs, ctx.offset)
        return dh, (dprobs if ctx.needs_input_grad[1] else None), None, None


def swiglu_with_probs(h: torch.Tensor, probs: torch.Tensor, *, offset: float = 0.0, compiled: bool = False
                      ) -> torch.Tensor:
    """`silu(gate) * (up + offset) * probs` of `h = [gate | up]` as `SwiGLUWithProbs` (see the module docstring)."""
    return SwiGLUWithProbs.apply(h, probs, float(offset), bool(compiled))

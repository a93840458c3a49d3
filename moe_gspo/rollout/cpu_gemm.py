"""bf16 matrix products on CPUs without a bf16 GEMM: the same numbers from an fp32 GEMM.

A bf16 x bf16 product is exact in fp32 (8-bit significands give a 16-bit product; fp32 has 24), so a
bf16 GEMM that accumulates in fp32 and rounds its result to bf16 once — what torch's CPU kernels and
the GPU inference engines' bf16 GEMMs do — equals an fp32 GEMM of the same bf16 values followed by one
rounding to bf16, up to the order of the fp32 additions. CPUs without AVX512-BF16 / AMX (this
project's CI machines) have no fast bf16 GEMM: torch falls back to a reference kernel ~2-5x slower
than its fp32 GEMM at the tiny model's sizes, and the GEMMs are most of a bf16 rollout's time there.

`Fp32GemmForBf16` is a `TorchFunctionMode` that, while active, computes `F.linear`, `torch.matmul`
/ `mm` / `bmm` and grouped GEMMs (`torch._grouped_mm`, `F.grouped_mm`, transformers' MoE experts)
whose inputs are all bf16 CPU tensors as fp32 GEMMs of those values, cast back to bf16. Everything
else (attention, norms, activations, sampling) runs untouched in its own dtype. The rollout therefore
keeps every bf16 rounding point of a bf16 engine, and so the train-inference mismatch that the drift
metrics measure (tests/rollout: identical tokens, log-probs and routes with and without it on the tiny
model). It is used by the transformers rollout engine on CPU in bf16 only when the CPU lacks a native
bf16 GEMM (`needs_fp32_gemm`), and only for inference (no autograd graph is built through it).

A mode intercepts every torch call made while it is active, GEMM or not, and that Python overhead
was ~30% of a tiny-model decode step. `fp32_gemms_in(model)` therefore scopes it to the modules that
own the GEMMs: each `nn.Linear` computes its fp32 GEMM directly (no mode), and every other module with
its own parameters (the MoE router and experts; norms and embeddings, which have no GEMM and pass
through) runs its forward inside the mode. Attention, rotary embeddings and the KV cache, which own no
parameters, run outside it. Same numbers as the mode over the whole model (tests/rollout).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


def _gemm_functions() -> frozenset:
    funcs = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__,
             torch.Tensor.mm, torch.Tensor.bmm}
    for owner, name in ((torch, "_grouped_mm"), (F, "grouped_mm")):
        fn = getattr(owner, name, None)
        if fn is not None:
            funcs.add(fn)
    return frozenset(funcs)


_GEMMS = _gemm_functions()


def needs_fp32_gemm(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True on a CPU device with a bf16 dtype when the CPU has neither AVX512-BF16 nor AMX tiles
    (torch's own capability checks)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return not native


class Fp32GemmForBf16(TorchFunctionMode):
    """While active, bf16 CPU GEMMs run as fp32 GEMMs of the same values, rounded back to bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS:
            floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if floats and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in floats):
                up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
                kw = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                      for k, v in kwargs.items()}
                return func(*up, **kw).to(torch.bfloat16)
        return func(*args, **kwargs)


def _linear_fp32(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = module.weight, module.bias
    if x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" and (b is None or b.dtype == torch.bfloat16):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    return F.linear(x, w, b)


def _in_mode(forward):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with Fp32GemmForBf16():
            return forward(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def fp32_gemms_in(model: nn.Module):
    """While active, `model`'s bf16 CPU GEMMs run as fp32 GEMMs of the same values, rounded back to bf16,
    with the interception scoped to the modules that own parameters (see the module docstring). The
    modules' `forward` attributes are restored on exit."""
    patched = []
    try:
        for module in model.modules():
            if "forward" in module.__dict__:  # already patched (nested use) or set by someone else: leave it
                continue
            if isinstance(module, nn.Linear):
                module.forward = functools.partial(_linear_fp32, module)
            elif next(module.parameters(recurse=False), None) is not None:
                module.forward = _in_mode(module.forward)
            else:
                continue
            patched.append(module)
        yield model
    finally:
        for module in patched:
            del module.forward

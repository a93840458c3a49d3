"""bf16 inference on CPUs without bf16 GEMMs: the same rounding points, computed by fp32 kernels.

A bf16 x bf16 product is exact in fp32 (8-bit significands give a 16-bit product; fp32 has 24), so a
bf16 GEMM that accumulates in fp32 and rounds its result to bf16 once — what torch's CPU kernels and
the GPU inference engines' bf16 GEMMs do — equals an fp32 GEMM of the same bf16 values followed by one
rounding to bf16, up to the order of the fp32 additions. CPUs without AVX512-BF16 / AMX (this
project's CI machines) have no fast bf16 GEMM: torch falls back to a reference kernel ~2-5x slower
than its fp32 GEMM at the tiny model's sizes, and the GEMMs are most of a bf16 rollout's time there.

`Fp32GemmForBf16` is a `TorchFunctionMode` that, while active, computes `F.linear`, `torch.matmul`
/ `mm` / `bmm` and grouped GEMMs (`torch._grouped_mm`, `F.grouped_mm`, transformers' MoE experts)
whose inputs are all bf16 CPU tensors as fp32 GEMMs of those values, cast back to bf16. Everything
else (norms, activations, sampling) runs untouched in its own dtype. The rollout therefore keeps every
bf16 rounding point of a bf16 engine, and so the train-inference mismatch that the drift metrics
measure (tests/rollout: identical tokens, log-probs and routes with and without it on the tiny model).
It is used by the transformers rollout engine on CPU in bf16, by default only when the CPU lacks a native
bf16 GEMM (`needs_fp32_gemm`; config `rollout.fp32_gemm`: null = that, true / false = always / never), and
only for inference (no autograd graph is built through it).

`fp32_gemms_in(model)` is what the engine enters around a generation:

- **Scope.** A mode intercepts every torch call made while it is active, GEMM or not, and that Python
  overhead was ~30% of a tiny-model decode step. So each `nn.Linear` computes its fp32 GEMM directly (no
  mode), and only the other modules that own a matrix (>= 2-D parameters: the MoE router, the
  experts) run their forward inside the mode. Norms, embeddings (a lookup, no GEMM), rotary embeddings
  and the KV cache run outside it. Same numbers as the mode over the whole model (tests/rollout).
- **Weights.** The fp32 copies of the bf16 weights (`fp32_copy`, kept in the engine's
  `moe_gspo.tensor_cache.TensorCache`) are made once and reused until a weight changes in place (a weight
  sync bumps the tensor's version counter), instead of casting every weight at every forward: one fp32
  copy of the engine's matrices stays in memory (the tiny model's: well under 1 MiB).
- **Attention.** torch's bf16 attention kernel on such CPUs is ~2x slower than its fp32 one at
  decode shapes. The model's `sdpa` attention is swapped for `sdpa_fp32_for_bf16`
  (`ATTENTION_FP32`, registered in transformers' `AttentionInterface`; the patches that swap it in, and the
  modules' `forward`, are `moe_gspo.rollout.hf_shims`): the bf16 query, keys and values
  are cast to fp32, attended by the same SDPA call, and the output is rounded to bf16 once. A GPU flash
  kernel accumulates in fp32 as well, but also rounds the softmax probabilities to bf16 before
  multiplying the values; here they stay fp32, so an attention output can differ from torch's bf16
  kernel by a bf16 ulp (the rollout is still a bf16 one: weights, activations between ops and the
  KV cache are bf16).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from moe_gspo.rollout.hf_shims import (has_own_forward, register_attention, restore_forward, set_attention_implementation,
                                       set_forward)
from moe_gspo.tensor_cache import TensorCache

ATTENTION_FP32 = "sdpa_fp32_for_bf16"
"""Name of the fp32-compute attention in transformers' `AttentionInterface` (see the module docstring)."""


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


def fp32_copy(cache: TensorCache | None, t: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a bf16 GEMM operand: a parameter's copy is kept in `cache` (made on first use and
    again after the parameter changed in place: a weight sync bumps its version counter); other tensors
    (activations), or every tensor without a cache, are cast every time."""
    if cache is None or not isinstance(t, nn.Parameter):
        return t.float()
    return cache(("fp32", id(t)), (t,), _to_fp32)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float()


class Fp32GemmForBf16(TorchFunctionMode):
    """While active, bf16 CPU GEMMs run as fp32 GEMMs of the same values, rounded back to bf16.
    `cache`: where the fp32 copies of parameters are kept (`fp32_copy`); None casts every operand."""

    def __init__(self, cache: TensorCache | None = None):
        super().__init__()
        self.up = functools.partial(fp32_copy, cache)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS:
            floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if floats and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in floats):
                up = [self.up(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
                kw = {k: (self.up(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                      for k, v in kwargs.items()}
                return func(*up, **kw).to(torch.bfloat16)
        return func(*args, **kwargs)


def _linear_fp32(module: nn.Linear, cache: TensorCache, x: torch.Tensor) -> torch.Tensor:
    w, b = module.weight, module.bias
    if x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" and (b is None or b.dtype == torch.bfloat16):
        return F.linear(x.float(), fp32_copy(cache, w), None if b is None else fp32_copy(cache, b)).to(torch.bfloat16)
    return F.linear(x, w, b)


def _in_mode(forward, cache: TensorCache):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with Fp32GemmForBf16(cache):
            return forward(*args, **kwargs)
    return wrapped


def _owns_a_matrix(module: nn.Module) -> bool:
    """A module with a parameter of >= 2 dims of its own (router, experts); not norms (1-D weights) or
    embeddings (a table lookup: no GEMM)."""
    return not isinstance(module, nn.Embedding) and any(p.dim() >= 2 for p in module.parameters(recurse=False))


def sdpa_fp32_for_bf16(module, query, key, value, attention_mask, **kwargs):
    """transformers' `sdpa` attention computed in fp32 from bf16 CPU inputs, output rounded to bf16 once."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.dtype != torch.bfloat16 or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                          **kwargs)
    return out.to(torch.bfloat16), weights


@contextlib.contextmanager
def fp32_gemms_in(model: nn.Module, cache: TensorCache | None = None):
    """While active, `model`'s bf16 CPU GEMMs run as fp32 GEMMs of the same values rounded back to bf16,
    and its `sdpa` attention computes in fp32 (see the module docstring). `cache`: where the fp32 copies of
    the weights are kept across calls (the engine's `TensorCache`); default: copies for this scope only. The
    modules' `forward` attributes and the attention implementation are restored on exit (the patches:
    `moe_gspo.rollout.hf_shims`)."""
    cache = cache if cache is not None else TensorCache()
    patched = []
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    try:
        for module in model.modules():
            if has_own_forward(module):  # already patched (nested use) or set by someone else: leave it
                continue
            if isinstance(module, nn.Linear):
                set_forward(module, functools.partial(_linear_fp32, module, cache))
            elif _owns_a_matrix(module):
                set_forward(module, _in_mode(module.forward, cache))
            else:
                continue
            patched.append(module)
        if attention == "sdpa":
            register_attention(ATTENTION_FP32, sdpa_fp32_for_bf16)
            set_attention_implementation(config, ATTENTION_FP32)
        yield model
    finally:
        for module in patched:
            restore_forward(module)
        if attention == "sdpa":
            set_attention_implementation(config, attention)

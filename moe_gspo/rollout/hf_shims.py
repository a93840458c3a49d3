"""Every patch of transformers (and of the torch modules inside a transformers model) that the transformers
rollout engine makes. None changes transformers' code: each sets an attribute on one module or config of the
engine's own model copy, which its caller restores, or registers a name in one of transformers' global
registries. Each is a named function below, with who applies it.

- `set_forward(module, forward)` / `restore_forward(module)`: a module's own `forward`, an instance
  attribute that shadows its class's (`nn.Module.__call__` looks it up on the instance first).
  - `moe_gspo.rollout.cpu_gemm.fp32_gemms_in`: each `nn.Linear` and each module that owns a matrix (the
    MoE router, the experts) computes its bf16 GEMMs in fp32, for one generation; restored on exit. A
    module that already has its own `forward` (`has_own_forward`) is left as it is.
  - `moe_gspo.rollout.router_dtype.use_router_dtype_`: each Qwen3-MoE gate routes in `rollout.router_dtype`
    (`router_forward`), for the engine's life.
- `wrap_apply_gate(experts, wrap)` / `restore_apply_gate(experts)`: the fused experts' `_apply_gate`
  (act(gate) * up, which transformers' `grouped_mm` / `batched_mm` experts call between the two expert
  GEMMs), wrapped on that instance; `moe_gspo.rollout.fp8.Fp8ActivationQuantizer` quantizes the
  down-projection input with it (W8A8) and restores it in `remove()`.
- `register_attention(name, forward)`: an attention function in transformers' `AttentionInterface`, and
  `sdpa`'s mask builder under the same name in `AttentionMaskInterface` (transformers builds NO attention
  mask for a name without one: it assumes a backend that masks by itself, which would let left-padded
  prompts attend to their padding). Once per process; `cpu_gemm` registers `sdpa_fp32_for_bf16`.
- `set_attention_implementation(config, name)`: the model config's private `_attn_implementation`, which
  transformers' attention layers read at every forward to pick the function; `cpu_gemm.fp32_gemms_in`
  switches `sdpa` to `sdpa_fp32_for_bf16` for one generation and back.
"""

from __future__ import annotations

from typing import Callable

from torch import nn


def has_own_forward(module: nn.Module) -> bool:
    """True when `module` has an instance-level `forward` (set by `set_forward`, or by someone else)."""
    return "forward" in module.__dict__


def set_forward(module: nn.Module, forward: Callable) -> None:
    """Give `module` its own `forward` (see the module docstring); `restore_forward` undoes it."""
    module.forward = forward


def restore_forward(module: nn.Module) -> None:
    """Drop `module`'s own `forward`: its class's runs again."""
    del module.forward


def wrap_apply_gate(experts: nn.Module, wrap: Callable[[Callable], Callable]) -> None:
    """Set `experts._apply_gate` on the instance to `wrap(the class's _apply_gate bound to it)`."""
    experts._apply_gate = wrap(type(experts)._apply_gate.__get__(experts))


def restore_apply_gate(experts: nn.Module) -> None:
    """Drop the instance's `_apply_gate` (a no-op when it has none): its class's runs again."""
    experts.__dict__.pop("_apply_gate", None)


def register_attention(name: str, forward: Callable) -> None:
    """Register `forward` as attention `name` with transformers, and `sdpa`'s mask builder under the same
    name (see the module docstring); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, forward)
    if name not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, sdpa_mask)


def set_attention_implementation(config, name: str) -> None:
    """Make the model of `config` run attention `name` from its next forward on."""
    config._attn_implementation = name

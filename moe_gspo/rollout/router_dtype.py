"""The rollout engine's MoE routers in a wider dtype (`model.router_dtype`, docs/algorithms.md "Router
policy during RL"), local to the engine's own gate modules; transformers' classes are neither forked nor
patched (the instance-level `forward` is `moe_gspo.rollout.hf_shims.set_forward`).

transformers' `Qwen3MoeTopKRouter.forward` computes the gate GEMM in the model dtype (bf16 for a bf16
rollout), the softmax in fp32, the top-k on those fp32 probabilities, renormalises (`norm_topk_prob`) and
returns the weights in the logits' dtype. With `router_dtype` (fp32 or fp64), `use_router_dtype_(model,
dtype)`:
- keeps each gate's weight in that dtype (so the weight sync, which casts into the destination's dtype,
  copies the learner's weights in without rounding them to the rollout dtype);
- replaces that gate instance's `forward` with `router_forward`: the hidden state upcast, the gate GEMM,
  softmax, top-k and renormalisation in that dtype, as Megatron's `moe_router_dtype` does on the learner;
  the returned logits stay in that dtype (the route recorders read them), the top-k weights go back to the
  hidden state's dtype, so the expert combine runs in rollout.dtype as before (Megatron also does the
  weighted average of the expert outputs in `moe_router_dtype`: that step is not mirrored).
`moe_gspo.rollout.compact_decode.CompactDecoder` computes its router the same way when the gate weights
are wider than the model dtype. vLLM: not available (its fused MoE gate runs in the model dtype).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from moe_gspo.rollout.hf_shims import set_forward

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def parse_router_dtype(router_dtype: str | torch.dtype | None) -> torch.dtype | None:
    if router_dtype is None or isinstance(router_dtype, torch.dtype):
        if isinstance(router_dtype, torch.dtype) and router_dtype not in ROUTER_DTYPES.values():
            raise ValueError(f"router_dtype={router_dtype}: use torch.float32 or torch.float64")
        return router_dtype
    if router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"router_dtype={router_dtype!r}: use 'fp32', 'fp64' or None")
    return ROUTER_DTYPES[router_dtype]


def route_in_dtype(hidden_NH: torch.Tensor, weight_EH: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(logits [N, E] in the weight's dtype, top-k weights [N, K] in the hidden state's dtype, ids [N, K]):
    transformers' Qwen3-MoE routing with the gate GEMM, softmax, top-k and renormalisation all in the
    weight's dtype."""
    dtype = weight_EH.dtype
    logits = F.linear(hidden_NH.to(dtype), weight_EH)
    probs = torch.softmax(logits, dim=-1, dtype=dtype)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(hidden_NH.dtype), ids


def router_forward(self, hidden_states: torch.Tensor):
    """`Qwen3MoeTopKRouter.forward` with the routing in the gate weight's dtype (`route_in_dtype`)."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    return route_in_dtype(hidden, self.weight, self.top_k, self.norm_topk_prob)


def use_router_dtype_(model: nn.Module, router_dtype: str | torch.dtype) -> int:
    """Keep every MoE gate's weight of the transformers `model` in `router_dtype` and route in it
    (`router_forward` bound to each gate instance). Returns the number of gates changed."""
    from moe_gspo.rollout.hf_router_hooks import find_routers

    dtype = parse_router_dtype(router_dtype)
    routers = find_routers(model)
    if not routers:
        raise ValueError("router_dtype: the model has no MoE router")
    for _, gate in routers:
        gate.weight.data = gate.weight.data.to(dtype)
        set_forward(gate, types.MethodType(router_forward, gate))
    return len(routers)

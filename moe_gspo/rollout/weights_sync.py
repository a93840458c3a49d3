"""In-memory weight loading into a transformers Qwen3-MoE model (learner -> rollout engine).

`load_named_tensors_(model, named_tensors)` copies tensors into the model's parameters in place,
casting them to each parameter's dtype and device. Names are those of the in-memory
`Qwen3MoeForCausalLM` state dict (transformers 5 fuses the experts:
`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first then up rows, and `mlp.experts.down_proj`
[E, H, I]). The on-disk per-expert layout (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as in real
checkpoints) is accepted too and written into the matching slice of the fused tensors:
`gate_up_proj[e, :I] = gate_e`, `gate_up_proj[e, I:] = up_e`, `down_proj[e] = down_e`.

Every name and shape is checked before anything is written, so a bad input leaves the model as it
was. A partial set of names is allowed (only those tensors change).

Streams (`moe_gspo.mcore.weight_stream.HFWeightStream`, or any iterable with a `specs` list of
objects with `.name` and `.shape`) are copied tensor by tensor as they arrive, never held whole:
their names and shapes are checked from `specs` before the first tensor is read, and a tensor that
then differs from its spec raises (after the stream is drained, since it runs collectives), leaving
the earlier tensors written.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _resolve(name: str, tensor: torch.Tensor, targets: dict[str, torch.Tensor]):
    """The destination view for `name` (a parameter or a slice of a fused expert tensor)."""
    if name in targets:
        dest = targets[name]
    else:
        match = _PER_EXPERT_RE.match(name)
        if match is None:
            raise ValueError(f"update_weights: unknown weight name {name!r}; expected a name of the "
                             "in-memory Qwen3MoeForCausalLM state dict (e.g. "
                             "'model.layers.1.mlp.experts.gate_up_proj') or a per-expert checkpoint "
                             "name ('...mlp.experts.<e>.gate_proj.weight')")
        prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
        fused_name = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if fused_name not in targets:
            raise ValueError(f"update_weights: {name!r} maps to {fused_name!r}, which the model lacks")
        fused = targets[fused_name]
        if expert >= fused.shape[0]:
            raise ValueError(f"update_weights: {name!r} names expert {expert}, but the model has "
                             f"{fused.shape[0]} experts")
        if proj == "down_proj":
            dest = fused[expert]
        else:
            half = fused.shape[1] // 2
            dest = fused[expert, :half] if proj == "gate_proj" else fused[expert, half:]
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"update_weights: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                         f"the model expects {tuple(dest.shape)}")
    return dest


@torch.no_grad()
def load_named_tensors_(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy `(name, tensor)` pairs into `model` in place (cast to each target's dtype/device).

    Returns the number of tensors loaded. Raises `ValueError` naming the key for an unknown name or
    a shape mismatch; in that case nothing is written.
    """
    targets = dict(model.state_dict(keep_vars=True))
    specs = getattr(named_tensors, "specs", None)
    if specs is not None:
        return _load_stream_(named_tensors, specs, targets)
    plan = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update_weights: value of {name!r} is a {type(tensor).__name__}, "
                             "expected a torch.Tensor")
        plan.append((_resolve(name, tensor, targets), tensor))
    for dest, tensor in plan:
        dest.copy_(tensor.detach().to(device=dest.device, dtype=dest.dtype))
    return len(plan)


def _load_stream_(stream, specs, targets: dict[str, torch.Tensor]) -> int:
    for spec in specs:  # every name and shape, before any collective runs or any weight changes
        _resolve(spec.name, torch.empty(spec.shape, device="meta"), targets)
    expected = iter(specs)
    iterator = iter(stream)
    count = 0
    try:
        for name, tensor in iterator:
            spec = next(expected, None)
            if spec is None or name != spec.name or tuple(tensor.shape) != tuple(spec.shape):
                raise ValueError(f"update_weights: the stream yielded {name!r} {tuple(tensor.shape)} where its "
                                 f"specs announced {spec}; the model is partly updated")
            dest = _resolve(name, tensor, targets)
            dest.copy_(tensor.detach().to(device=dest.device, dtype=dest.dtype))
            count += 1
    except BaseException:
        from moe_gspo.mcore.weight_stream import drain

        drain(iterator)
        raise
    if count != len(specs):
        raise ValueError(f"update_weights: the stream yielded {count} tensors, its specs announced {len(specs)}")
    return count

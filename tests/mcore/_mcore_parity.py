"""Shared helpers for the Megatron-vs-transformers parity checks (in-process tests and the EP=2 worker).

Top-k capture conventions:
- transformers' router (`mlp.gate`) flattens hidden states [B, S, H] → token index `b*S + s` and
  returns `(logits, scores, indices [N, k])`;
- Megatron's `TopKRouter` sees [S, B, H] (sequence-first) and flattens to token index `s*B + b`;
  its forward returns `(probs [N, E], routing_map [N, E] bool)`.
Both are turned into a bool mask [B, S, E] of the chosen experts, so sets compare directly.
"""

from __future__ import annotations

import torch

from moe_gspo.mcore.model import forward_logits, moe_layer_ids, moe_routers


def hf_forward(hf_model, ids_BS: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [B,S,V], chosen-expert masks [B,S,E] per MoE layer) from a transformers model."""
    B, S = ids_BS.shape
    cfg = hf_model.config
    masks: list[torch.Tensor] = []
    hooks = []
    for l in moe_layer_ids(cfg):
        def hook(_mod, _inp, out):
            _logits, _scores, idx_NK = out
            mask = torch.zeros(idx_NK.shape[0], cfg.num_experts, dtype=torch.bool)
            mask.scatter_(1, idx_NK.cpu(), True)
            masks.append(mask.view(B, S, cfg.num_experts))
        hooks.append(hf_model.model.layers[l].mlp.gate.register_forward_hook(hook))
    try:
        logits = hf_model(ids_BS).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, masks


def mcore_forward(model, ids_BS: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [B,S,V], chosen-expert masks [B,S,E] per MoE layer) from the Megatron GPTModel."""
    B, S = ids_BS.shape
    masks: list[torch.Tensor] = []
    hooks = []
    for router in moe_routers(model):
        def hook(_mod, _inp, out):
            _probs, routing_map_NE = out
            assert routing_map_NE.shape[0] == S * B
            masks.append(routing_map_NE.detach().cpu().view(S, B, -1).transpose(0, 1))
        hooks.append(router.register_forward_hook(hook))
    try:
        logits = forward_logits(model, ids_BS)
    finally:
        for h in hooks:
            h.remove()
    return logits, masks


def topk_mismatches(masks_a: list[torch.Tensor], masks_b: list[torch.Tensor]) -> list[int]:
    """Per MoE layer, the number of tokens whose chosen-expert SETS differ."""
    assert len(masks_a) == len(masks_b)
    return [int((a != b).any(-1).sum()) for a, b in zip(masks_a, masks_b)]


def logits_and_grads(models, ids_BS: torch.Tensor) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Per Megatron model (train mode): its logits [B, S, V] on `ids_BS` and every parameter's gradient of
    `logsumexp(logits).mean()`, for checking that two builds compute the same function."""
    out = []
    for m in models:
        m.train()
        logits = forward_logits(m, ids_BS)
        logits.logsumexp(-1).mean().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)

"""Shared per-algorithm arguments of the policy-loss tests (`from algos._cases import ...`)."""

import torch

from moe_gspo.algos import ALGOS

PPO_CLIP = ("gspo", "gspo_token", "grpo")
"""The hard-clip methods whose clip acts on a ratio range [1 - low, 1 + high] (tests written for them)."""
SAPO_TAUS = (1.0, 1.05)


def loss_kwargs(algo: str, clip_low: float = 0.2, clip_high: float = 0.2) -> dict:
    """Clip arguments of `algo` (gmpo reads them as log-space bounds; sapo takes none)."""
    return {} if algo == "sapo" else dict(clip_low=clip_low, clip_high=clip_high)


def default_mode(algo: str) -> str:
    return "token-mean" if algo == "cispo" else "seq-mean-token-mean"


def on_policy_value_BT(algo: str, adv_BT: torch.Tensor) -> torch.Tensor:
    """Per-token objective value at ratio 1: A, except SAPO's f(1) A = 2A / tau(A)."""
    if algo != "sapo":
        return adv_BT
    tau = torch.where(adv_BT > 0, SAPO_TAUS[0], SAPO_TAUS[1]).to(adv_BT.dtype)
    return 2.0 * adv_BT / tau


def mean_as(mode: str, values_BT: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Aggregate per-token values (any values at masked positions) as `mode` does, written out."""
    v = torch.where(mask, values_BT, 0.0)
    lengths = mask.sum(-1)
    valid = lengths > 0
    if not valid.any():
        return torch.zeros((), dtype=values_BT.dtype)
    if mode == "token-mean":
        return v.sum() / mask.sum()
    per_seq = v.sum(-1) / lengths.clamp(min=1) if mode == "seq-mean-token-mean" else v.sum(-1)
    return per_seq[valid].mean()


__all__ = ["ALGOS", "PPO_CLIP", "SAPO_TAUS", "default_mode", "loss_kwargs", "mean_as", "on_policy_value_BT"]

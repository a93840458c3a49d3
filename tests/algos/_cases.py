"""Shared per-algorithm arguments of the policy-loss tests (`from algos._cases import ...`)."""

import math

import torch

from moe_gspo.algos import ALGOS
from moe_gspo.algos.registry import get_algo

PPO_CLIP = ("gspo", "gspo_token", "grpo")
"""The hard-clip methods whose clip acts on a ratio range [1 - low, 1 + high] (tests written for them)."""
SAPO_TAUS = tuple(o.default for o in get_algo("sapo").options)
LN = math.log
NAN, INF = float("nan"), float("inf")


def loss_kwargs(algo: str, clip_low: float = 0.2, clip_high: float = 0.2) -> dict:
    """Clip arguments of `algo` (gmpo reads them as log-space bounds; an algorithm without a clip range,
    sapo, takes none)."""
    return {} if get_algo(algo).default_clip is None else dict(clip_low=clip_low, clip_high=clip_high)


def default_mode(algo: str) -> str:
    return get_algo(algo).default_agg


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


def hand_batch():
    """Three sequences, T = 3, clip range [0.8, 1.2]; log ratios lr and advantages:
    seq 0: lr [ln1.5, ln1.5, pad]    A = +1   (GSPO s = 1.5: above 1.2, clip binds)
    seq 1: lr [0, 2 ln0.5, pad]      A = -1   (GSPO s = exp(ln0.5) = 0.5: below 0.8, clip binds)
    seq 2: lr [ln1.1, pad, pad]      A = +2   (s = 1.1: inside)
    Padding holds garbage."""
    old = torch.tensor([[-1.0, -2.0, NAN], [-0.3, -0.2, INF], [-0.9, -INF, NAN]], dtype=torch.float64)
    lr = torch.tensor([[LN(1.5), LN(1.5), 0.0], [0.0, 2 * LN(0.5), 0.0], [LN(1.1), 0.0, 0.0]], dtype=torch.float64)
    logp = (old + lr).nan_to_num(0.0, 0.0, 0.0)
    logp[0, 2], logp[1, 2], logp[2, 1], logp[2, 2] = NAN, INF, -INF, 123.0
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    return logp.requires_grad_(True), old, adv, mask


def mixed_sign_batch():
    """Four sequences of 2 tokens, clip range [0.8, 1.2], every ratio out of range on a chosen side:
    seq 0: lr [ln1.5, ln1.5]   A = +1  (ratio high, A > 0: binds)
    seq 1: lr [ln1.5, ln1.5]   A = -1  (ratio high, A < 0: not clipped, the gradient flows)
    seq 2: lr [ln0.5, ln0.5]   A = +1  (ratio low, A > 0: not clipped)
    seq 3: lr [ln0.25, 0]      A = -1  (GSPO s = 0.5, low with A < 0: binds; GRPO: only token 0 binds)"""
    old = torch.full((4, 2), -1.0, dtype=torch.float64)
    lr = torch.tensor([[LN(1.5), LN(1.5)], [LN(1.5), LN(1.5)], [LN(0.5), LN(0.5)], [LN(0.25), 0.0]],
                      dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    return (old + lr).requires_grad_(True), old, adv, torch.ones(4, 2, dtype=torch.bool)


__all__ = ["ALGOS", "INF", "LN", "NAN", "PPO_CLIP", "SAPO_TAUS", "default_mode", "hand_batch", "loss_kwargs", "mean_as",
           "mixed_sign_batch", "on_policy_value_BT"]

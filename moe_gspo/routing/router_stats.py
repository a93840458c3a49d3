"""Router diagnostics: expert-load imbalance (MaxVio), router entropy and the top-k decision margin.

Pure functions (arrays in, values / metrics out; no config, no torch.distributed), used by both sides:
the rollout engine's router hooks and the learner's old-policy pass compute the per-token statistics
(`token_router_stats`) on the fly, and `router_summary` turns them into the `router/*` metrics
(`moe_gspo.routing.router_diag` picks the rows).

Definitions (per MoE layer l; N tokens; E experts; top-k K):

- **MaxVio** (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing", arXiv 2408.15664, eq. 4):
  ``(max_e load_le - mean_e load_le) / mean_e load_le`` where ``load_le`` counts the top-k slots of
  the N tokens that go to expert e. With load shares ``f_le = load_le / (N K)`` this is ``E max_e f_le - 1``:
  0 = perfectly balanced, 1 = the busiest expert gets twice its fair share, ``E - 1`` = every slot on one
  expert (K = 1). verl computes the same number per layer from the rollout engine's routed expert ids
  (``verl/trainer/ppo/metric_utils.py``: ``load_share * E - 1``, max over experts, logged as
  ``rollout/moe/max_vio/layer_i``); prime-rl computes it in its trainer from ``tokens_per_expert``.
  NaN when there is no token.
- **Router entropy**: ``H = -sum_e p_e log p_e`` (nats) of the softmax over *all* E experts of the
  router logits (computed in float32), per token; in ``[0, log E]``.
- **Router margin**: ``z_(K) - z_(K+1)``, the gap between the K-th and (K+1)-th largest router *logits*
  of a token (the softmax's argument; ``+inf`` when K = E). The top-k set of a token changes under a
  perturbation of its logits only when the perturbation moves that pair by more than the gap, so the
  margin is what a numeric difference (bf16 vs fp32, FP8 weights, another kernel) has to overcome.
  Logits rather than probabilities: the probability gap ``p_(K) - p_(K+1)`` of the same logit gap shrinks
  with the softmax normaliser, i.e. roughly as 1/E (measured on the random tiny models: the median
  probability margin is 0.029 with 8 experts and 0.001 with 64, the logit margin 0.18 and 0.035), so
  one probability threshold means different things for different models, while a logit threshold is
  directly comparable with the numeric error of the router's GEMM.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from moe_gspo.routing.drift import expert_load

STAT_NAMES = ("margin", "entropy")
"""The per-token statistics `token_router_stats` returns, in the order of its last axis."""


SHORT_EXPERT_AXIS = 16
"""Below this many experts the CPU's log-softmax over the last axis runs without vectorisation."""


def _log_softmax_experts(z_NE: torch.Tensor) -> torch.Tensor:
    """`log_softmax(z_NE, dim=-1)`. On the CPU with fewer than `SHORT_EXPERT_AXIS` experts, computed over
    the first axis of the transposed copy instead: the last-axis kernel runs scalar on an axis shorter
    than one vector (7x slower at E = 8, [2048, 8]: 209 vs 29 us), the first-axis one vectorises across
    tokens. The same values to float32 rounding (`tests/routing/test_router_stats.py`); bit-identical at E = 8 on
    a CPU with AMX, not on an AVX2-only one (another reduction kernel: the last bits differ)."""
    if z_NE.device.type == "cpu" and z_NE.shape[-1] < SHORT_EXPERT_AXIS:
        return torch.log_softmax(z_NE.t().contiguous(), dim=0).t()
    return torch.log_softmax(z_NE, dim=-1)


def token_router_stats(logits_NE: torch.Tensor, top_k: int) -> torch.Tensor:
    """float32 [N, 2] per-token router statistics from router logits [N, E] (any float dtype):
    ``[:, 0]`` the margin ``z_(K) - z_(K+1)`` of the logits (``+inf`` when K = E), ``[:, 1]`` the
    entropy (nats) of the float32 softmax over all experts. No gradient."""
    num_experts = logits_NE.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    with torch.no_grad():
        z_NE = logits_NE.detach().reshape(-1, num_experts).float()
        if top_k < num_experts:
            top_N2 = torch.topk(z_NE, top_k + 1, dim=-1).values[:, top_k - 1:]
            margin_N = top_N2[:, 0] - top_N2[:, 1]
        else:
            margin_N = torch.full(z_NE.shape[:1], math.inf, device=z_NE.device)
        logp_NE = _log_softmax_experts(z_NE)
        entropy_N = -(logp_NE.exp() * logp_NE).sum(-1)
        return torch.stack([margin_N, entropy_N], dim=-1)


def max_vio(topk_NLK: Any, num_experts: int) -> np.ndarray:
    """float64 [L]: MaxVio of each layer's top-k assignments (module docstring); NaN without tokens."""
    ids = np.asarray(topk_NLK)
    if ids.ndim != 3:
        raise ValueError(f"topk_NLK must be [N, L, K], got shape {ids.shape}")
    n, num_layers, k = ids.shape
    if n == 0 or k == 0:
        return np.full(num_layers, math.nan)
    if int(ids.min()) < 0 or int(ids.max()) >= num_experts:
        raise ValueError(f"topk_NLK holds expert ids outside [0, num_experts={num_experts})")
    return expert_load(ids, num_experts).max(axis=1) * num_experts - 1.0


def _mean_or_nan(x: np.ndarray, axis=None):
    if x.size == 0 or (axis is not None and x.shape[axis] == 0):
        shape = () if axis is None else tuple(s for i, s in enumerate(x.shape) if i != axis)
        return np.full(shape, math.nan) if shape else math.nan
    return x.mean(axis=axis)


def router_summary(side: str, *, topk_NLK: Any = None, num_experts: int | None = None, margin_NL: Any = None,
                   entropy_NL: Any = None, margin_threshold: float) -> dict[str, Any]:
    """The `router/*` metrics of one side (``side`` = "rollout" or "learner") over N token rows.

    From the ids (when given): ``router/max_vio_{side}`` [L], ``..._mean`` (over layers, verl's
    ``max_vio/avg``, prime-rl's ``max_vio/mean``) and ``..._max`` (the worst layer). From the per-token
    statistics (when given): ``router/margin_{side}`` [L] (mean logit margin) and ``..._mean``,
    ``router/margin_small_frac_{side}`` [L] (share of tokens with margin < `margin_threshold`) and
    ``..._mean``, ``router/entropy_{side}`` [L] (mean entropy, nats) and ``..._mean``. A pooled ``_mean``
    is the mean over layers, i.e. over all (token, layer) pairs. NaN where there is no token.
    """
    out: dict[str, Any] = {}
    if topk_NLK is not None:
        vio_L = max_vio(topk_NLK, int(num_experts))
        out[f"router/max_vio_{side}"] = vio_L.tolist()
        out[f"router/max_vio_{side}_mean"] = float(_mean_or_nan(vio_L))
        out[f"router/max_vio_{side}_max"] = float(vio_L.max()) if vio_L.size else math.nan
    if margin_NL is not None:
        margin = np.asarray(margin_NL, np.float64)
        small = (margin < margin_threshold).astype(np.float64)
        for name, x in ((f"margin_{side}", margin), (f"margin_small_frac_{side}", small)):
            per_layer = np.atleast_1d(_mean_or_nan(x, axis=0))
            out[f"router/{name}"] = per_layer.tolist()
            out[f"router/{name}_mean"] = float(_mean_or_nan(x))
    if entropy_NL is not None:
        entropy = np.asarray(entropy_NL, np.float64)
        out[f"router/entropy_{side}"] = np.atleast_1d(_mean_or_nan(entropy, axis=0)).tolist()
        out[f"router/entropy_{side}_mean"] = float(_mean_or_nan(entropy))
    return out


def flip_by_margin(margin_NL: Any, layer_diff_NL: Any, margin_threshold: float) -> dict[str, float]:
    """Share of (token, layer) pairs whose top-k sets differ between two routings (`layer_diff_NL`,
    bool [N, L], e.g. `moe_gspo.routing.drift.per_token_layer_diff`), among the pairs whose margin is
    below `margin_threshold` (``router/flip_frac_small_margin``) and among the others
    (``router/flip_frac_large_margin``); NaN for an empty subset."""
    margin = np.asarray(margin_NL, np.float64)
    diff = np.asarray(layer_diff_NL, bool)
    if margin.shape != diff.shape:
        raise ValueError(f"margin_NL {margin.shape} and layer_diff_NL {diff.shape} must have the same shape")
    small = margin < margin_threshold
    return {"router/flip_frac_small_margin": float(diff[small].mean()) if small.any() else math.nan,
            "router/flip_frac_large_margin": float(diff[~small].mean()) if (~small).any() else math.nan}


def flip_rate_by_margin_bin(margin_M: Any, flip_M: Any, edges: Any) -> tuple[np.ndarray, np.ndarray]:
    """Binned flip rate: ``(rate_B float64, count_B int64)`` for the B = len(edges) - 1 bins
    ``[edges[b], edges[b+1])`` of `margin_M` (the last bin also holds margins equal to its upper edge);
    `flip_M` bool. Rate is NaN for an empty bin; margins outside the edges are dropped."""
    margin = np.asarray(margin_M, np.float64).ravel()
    flip = np.asarray(flip_M, bool).ravel()
    edges = np.asarray(edges, np.float64)
    if margin.shape != flip.shape:
        raise ValueError(f"margin_M {margin.shape} and flip_M {flip.shape} must have the same size")
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError("edges must be at least 2 increasing values")
    b = np.searchsorted(edges, margin, side="right") - 1
    b = np.where(margin == edges[-1], edges.size - 2, b)
    keep = (b >= 0) & (b < edges.size - 1)
    count = np.bincount(b[keep], minlength=edges.size - 1).astype(np.int64)
    flips = np.bincount(b[keep], weights=flip[keep].astype(np.float64), minlength=edges.size - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(count > 0, flips / np.maximum(count, 1), math.nan)
    return rate, count

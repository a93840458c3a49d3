"""Rollout engine vs learner on the same tokens: log-prob mismatch, routing drift, ratio variance.

Shared by the training loop (every step) and `moe_gspo.probe` (one checkpoint, no training), so
both report the same metric keys. Attribution of ratio variance to routing: the log-prob of token t
is produced at position t-1, so a response token counts as "flipped" when the routing of position
t-1 differs in at least one MoE layer (its own earlier positions also feed it through attention;
this attribution is the direct one).
"""

from __future__ import annotations

import numpy as np
import torch

from moe_gspo.algos import mismatch_metrics, ratio_stats
from moe_gspo.routing.drift import per_token_flip_mask, routing_drift


def _rename(d: dict, old: str, new: str) -> dict:
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in d.items()}


def _floats(d: dict) -> dict:
    return {k: float(v) for k, v in d.items()}


def stack_common_routes(routes_a: list[np.ndarray], routes_b: list[np.ndarray]):
    """Concatenate per-sequence routes over the rows both sides have; returns (a_NLK, b_NLK, index list)."""
    a_parts, b_parts, rows = [], [], []
    for i, (ra, rb) in enumerate(zip(routes_a, routes_b)):
        n = min(len(ra), len(rb))
        a_parts.append(np.asarray(ra[:n]))
        b_parts.append(np.asarray(rb[:n]))
        rows.append(n)
    if not a_parts:
        return np.zeros((0, 0, 0), np.int64), np.zeros((0, 0, 0), np.int64), rows
    return np.concatenate(a_parts), np.concatenate(b_parts), rows


def flipped_response_mask(routes_a, routes_b, response_mask_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: response tokens whose producing position (t-1) is routed differently in >= 1 layer."""
    B, S = response_mask_BS.shape
    out = torch.zeros(B, S, dtype=torch.bool)
    for b, (ra, rb) in enumerate(zip(routes_a, routes_b)):
        n = min(len(ra), len(rb), S - 1)
        if n <= 0:
            continue
        flips = torch.from_numpy(per_token_flip_mask(np.asarray(ra[:n]), np.asarray(rb[:n])))
        out[b, 1:n + 1] = flips
    return out & response_mask_BS.cpu().bool()


def rollout_vs_learner(*, rollout_logp_BS: torch.Tensor, learner_logp_BS: torch.Tensor,
                       response_mask_BS: torch.Tensor, rollout_routes: list | None,
                       learner_routes: list | None, num_experts: int) -> dict:
    """All rollout-vs-learner metrics for one batch (see module docstring)."""
    mask = response_mask_BS.bool()
    a, b = rollout_logp_BS.detach().float().cpu(), learner_logp_BS.detach().float().cpu()
    mask = mask.cpu()
    out = dict(mismatch_metrics(a, b, mask))
    out.update(_rename(_floats(ratio_stats(b, a, mask)), "ratio/", "mismatch_ratio/"))
    if rollout_routes is not None and learner_routes is not None:
        ra, rb, _ = stack_common_routes(rollout_routes, learner_routes)
        drift = routing_drift(ra, rb, num_experts=num_experts)
        out.update({k: v for k, v in drift.items() if k != "num_tokens"})
        out["routing/expert_load_rollout"] = out.pop("routing/expert_load_a")
        out["routing/expert_load_learner"] = out.pop("routing/expert_load_b")
        out.pop("routing/expert_load_diff", None)
        flipped = flipped_response_mask(rollout_routes, learner_routes, mask)
        out["mismatch_ratio/token_var_flipped"] = float(ratio_stats(b, a, flipped)["ratio/token_var"])
        out["mismatch_ratio/token_var_agreed"] = float(ratio_stats(b, a, mask & ~flipped)["ratio/token_var"])
        out["mismatch_ratio/flipped_token_frac"] = float(flipped.sum()) / max(1, int(mask.sum()))
    return out


def policy_update_drift(old_routes: list, new_routes: list, *, num_experts: int) -> dict:
    """Learner routing of the same tokens before vs after an update (GSPO paper §5.3's ~10% figure)."""
    ra, rb, _ = stack_common_routes(old_routes, new_routes)
    d = routing_drift(ra, rb, num_experts=num_experts)
    return {
        "update/layer_change": d["routing/layer_disagree"],
        "update/any_layer_change": d["routing/any_layer_flip"],
        "update/expert_change_frac": d["routing/expert_change_frac"],
    }

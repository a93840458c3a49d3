"""Rollout engine vs learner on the same tokens: log-prob mismatch, routing drift, ratio variance.

Shared by the training loop (every step) and `moe_gspo.probe` (one checkpoint, no training), so
both report the same metric keys.

Which routing rows: the log-prob of response token t (positions P .. P+R-1 of `prompt + response`)
is produced by the forward at position t-1, so the rows that produce response log-probs are
positions P-1 .. P+R-2 (the last prompt token and every response token but the last). `routing/*`
(and `update/*`) use exactly those rows; the prompt rows 0 .. P-2 produce no log-prob that the loss
uses and are reported apart under `routing_prompt/*`, counting each group's prompt once (the G
responses of a prompt share it, and the transformers engine prefills each distinct prompt once;
its prefill is a batched, left-padded pass, another source of prompt-row drift). Under R3,
`mismatch/*`, `mismatch_ratio/*` and `routing/*` still compare the learner's *natural* routing with
the rollout engine's; `mismatch_replayed/*` (same suffixes as `mismatch/*`) compares the pass that
replays the rollout routes, i.e. the log-probs the loss uses as pi_old.

Attribution of ratio variance to routing: a response token counts as "flipped" when its producing
row (t-1) is routed differently in at least one MoE layer (its own earlier rows also feed it through
attention; this attribution is the direct one). `mismatch_ratio/token_var_share_flipped` /
`_agreed` are each subset's share of the total sum of squared deviations of the token ratios
w_t = pi_learner / pi_rollout from their batch mean (they add up to 1); `token_var_flipped` /
`_agreed` are the variances within each subset (which do not split the total). All four are NaN
when their subset is empty (or the total is 0), never 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moe_gspo.algos import mismatch_metrics, ratio_stats
from moe_gspo.algos.mismatch import extreme_frac_curve
from moe_gspo.routing.drift import per_token_flip_mask, routing_drift

_DRIFT_SCALARS = ("routing/layer_disagree", "routing/any_layer_flip", "routing/mean_layers_differing",
                  "routing/topk_overlap", "routing/jaccard", "routing/expert_change_frac")


def _rename(d: dict, old: str, new: str) -> dict:
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in d.items()}


def _floats(d: dict) -> dict:
    return {k: float(v) for k, v in d.items()}


def response_spans(response_mask_BS: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(P_B, R_B) int64: prompt length (index of the first response token) and response length of
    every sequence, read from the response mask (R = 0 gives P = 0)."""
    mask = response_mask_BS.detach().cpu().bool()
    lens = mask.sum(-1).numpy().astype(np.int64)
    first = mask.int().argmax(-1).numpy().astype(np.int64)
    return np.where(lens > 0, first, 0), lens


def stack_rows(routes_a: list, routes_b: list, lo_B, hi_B) -> tuple[np.ndarray, np.ndarray]:
    """Rows [lo_b, hi_b) of every sequence that both sides have, concatenated: (a_NLK, b_NLK)."""
    a_parts, b_parts = [], []
    for ra, rb, lo, hi in zip(routes_a, routes_b, lo_B, hi_B):
        hi = min(int(hi), len(ra), len(rb))
        lo = min(int(lo), hi)
        a_parts.append(np.asarray(ra[lo:hi]))
        b_parts.append(np.asarray(rb[lo:hi]))
    if not a_parts:
        return np.zeros((0, 0, 0), np.int64), np.zeros((0, 0, 0), np.int64)
    return np.concatenate(a_parts), np.concatenate(b_parts)


def response_rows(P_B, R_B) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) of the rows that produce response log-probs: P-1 .. P+R-2 (empty when R = 0)."""
    P_B, R_B = np.asarray(P_B, np.int64), np.asarray(R_B, np.int64)
    lo = np.maximum(P_B - 1, 0)
    return lo, np.where(R_B > 0, P_B + R_B - 1, lo)


def prompt_rows(P_B, group_ids=None) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) of the prompt rows 0 .. P-2, for the first sequence of each group only (others empty)."""
    P_B = np.asarray(P_B, np.int64)
    hi = np.maximum(P_B - 1, 0)
    if group_ids is not None:
        seen, first = set(), np.zeros(len(P_B), bool)
        for b, g in enumerate(group_ids):
            if g not in seen:
                seen.add(g)
                first[b] = True
        hi = np.where(first, hi, 0)
    return np.zeros_like(hi), hi


def flipped_response_mask(routes_a, routes_b, response_mask_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: response tokens whose producing position (t-1) is routed differently in >= 1 layer."""
    B, S = response_mask_BS.shape
    out = np.zeros((B, S), dtype=bool)
    n_B = np.array([max(0, min(len(ra), len(rb), S - 1)) for ra, rb in zip(routes_a, routes_b)], dtype=np.int64)
    if n_B.sum():  # every sequence's rows in one comparison, scattered back to [b, 1 .. n_b]
        a, b = stack_rows(routes_a, routes_b, np.zeros_like(n_B), n_B)
        rows = np.repeat(np.arange(len(n_B)), n_B)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(n_B) - n_B, n_B) + 1
        out[rows, cols] = per_token_flip_mask(a, b)
    return torch.from_numpy(out) & response_mask_BS.cpu().bool()


def variance_attribution(logp_b_BS: torch.Tensor, logp_a_BS: torch.Tensor, mask_BS: torch.Tensor,
                         subsets: dict[str, torch.Tensor], *, max_log_ratio: float = 20.0) -> dict[str, float]:
    """Each subset's share of the total sum of squared deviations of w = exp(logp_b - logp_a) over the
    valid tokens (deviations from the mean over all valid tokens), keyed by the subset's name; NaN
    for an empty subset or when the total is 0."""
    mask = mask_BS.bool()
    lr = torch.where(mask, logp_b_BS.double() - logp_a_BS.double(), 0.0).clamp(-max_log_ratio, max_log_ratio)
    w = torch.exp(lr)
    n = int(mask.sum())
    if n == 0:
        return {name: math.nan for name in subsets}
    dev2 = torch.where(mask, (w - w[mask].mean()) ** 2, 0.0)
    total = float(dev2.sum())
    out = {}
    for name, sel in subsets.items():
        sel = sel.bool() & mask
        out[name] = float(dev2[sel].sum()) / total if bool(sel.any()) and total > 0 else math.nan
    return out


def _subset_var(b, a, sel) -> float:
    return float(ratio_stats(b, a, sel)["ratio/token_var"]) if bool(sel.any()) else math.nan


def rollout_vs_learner(*, rollout_logp_BS: torch.Tensor, learner_logp_BS: torch.Tensor,
                       response_mask_BS: torch.Tensor, rollout_routes: list | None,
                       learner_routes: list | None, num_experts: int, group_ids=None) -> dict:
    """All rollout-vs-learner metrics for one batch (see the module docstring). `group_ids` (one per
    sequence, e.g. the samples' `prompt_index`) lets `routing_prompt/*` count each prompt once."""
    mask = response_mask_BS.bool().cpu()
    a, b = rollout_logp_BS.detach().float().cpu(), learner_logp_BS.detach().float().cpu()
    out = dict(mismatch_metrics(a, b, mask))
    out["mismatch/extreme_frac_curve"] = extreme_frac_curve(a, b, mask)  # F(tau) on EXTREME_TAUS
    out.update(_rename(_floats(ratio_stats(b, a, mask)), "ratio/", "mismatch_ratio/"))
    if rollout_routes is not None and learner_routes is not None:
        P_B, R_B = response_spans(mask)
        ra, rb = stack_rows(rollout_routes, learner_routes, *response_rows(P_B, R_B))
        drift = routing_drift(ra, rb, num_experts=num_experts)
        out.update({k: v for k, v in drift.items() if k.startswith("routing/")})
        out["routing/num_tokens"] = drift["num_tokens"]
        out["routing/expert_load_rollout"] = out.pop("routing/expert_load_a")
        out["routing/expert_load_learner"] = out.pop("routing/expert_load_b")
        out.pop("routing/expert_load_diff", None)
        pa, pb = stack_rows(rollout_routes, learner_routes, *prompt_rows(P_B, group_ids))
        prompt = routing_drift(pa, pb, num_experts=num_experts)
        for k in _DRIFT_SCALARS:  # no prompt row (one-token prompts): NaN, not a perfect 0
            v = prompt[k] if prompt["num_tokens"] else (
                [math.nan] * len(prompt[k]) if isinstance(prompt[k], list) else math.nan)
            out[k.replace("routing/", "routing_prompt/")] = v
        out["routing_prompt/num_tokens"] = prompt["num_tokens"]
        flipped = flipped_response_mask(rollout_routes, learner_routes, mask)
        agreed = mask & ~flipped
        out["mismatch_ratio/token_var_flipped"] = _subset_var(b, a, flipped)
        out["mismatch_ratio/token_var_agreed"] = _subset_var(b, a, agreed)
        shares = variance_attribution(b, a, mask, {"flipped": flipped, "agreed": agreed})
        out["mismatch_ratio/token_var_share_flipped"] = shares["flipped"]
        out["mismatch_ratio/token_var_share_agreed"] = shares["agreed"]
        out["mismatch_ratio/flipped_token_frac"] = float(flipped.sum()) / max(1, int(mask.sum()))
    return out


def replayed_mismatch(*, rollout_logp_BS: torch.Tensor, replayed_logp_BS: torch.Tensor,
                      response_mask_BS: torch.Tensor) -> dict:
    """`mismatch/*` of the learner pass that replays the rollout routes (R3), as `mismatch_replayed/*`."""
    a, b = rollout_logp_BS.detach().float().cpu(), replayed_logp_BS.detach().float().cpu()
    mask = response_mask_BS.bool().cpu()
    m = mismatch_metrics(a, b, mask)
    m["mismatch/extreme_frac_curve"] = extreme_frac_curve(a, b, mask)
    return _rename(m, "mismatch/", "mismatch_replayed/")


def policy_update_drift(old_routes: list, new_routes: list, response_mask_BS: torch.Tensor, *,
                        num_experts: int, prefix: str = "update/") -> dict:
    """Learner routing of the same rows before vs after an update (GSPO paper §5.3's ~10% figure),
    on the rows that produce response log-probs (as `routing/*`), keyed `{prefix}layer_change`,
    `{prefix}any_layer_change`, `{prefix}expert_change_frac`."""
    ra, rb = stack_rows(old_routes, new_routes, *response_rows(*response_spans(response_mask_BS)))
    d = routing_drift(ra, rb, num_experts=num_experts)
    return {
        f"{prefix}layer_change": d["routing/layer_disagree"],
        f"{prefix}any_layer_change": d["routing/any_layer_flip"],
        f"{prefix}expert_change_frac": d["routing/expert_change_frac"],
    }

"""A training step's drift metrics under the keys they are logged with: rollout engine vs learner on the same
tokens (`mismatch/*`, `mismatch_ratio/*`, `routing/*`, `routing_prompt/*`), the replayed pass under R3
(`mismatch_replayed/*`) and the learner's routing before vs after an update (`update/*`,
`update_all_minibatches/*`). Shared by the training loop (every step, `moe_gspo.run.learner_passes`) and
`moe_gspo.probe` (one checkpoint, no training), so both report the same keys. Each function builds its keys
itself; a new drift metric is one more key in the function that computes it (and a row in docs/metrics.md).

Pure maths (log-probs as torch tensors, routes as per-sequence numpy arrays; no config, no torch.distributed).

Which routing rows (`moe_gspo.routing.rows`): `routing/*` (and `update/*`) use the rows that produce response
log-probs, positions P-1 .. P+R-2; the prompt rows 0 .. P-2 produce no log-prob that the loss uses and are
reported apart under `routing_prompt/*`, counting each group's prompt once (the G responses of a prompt share
it, and the transformers engine prefills each distinct prompt once; its prefill is a batched, left-padded pass,
another source of prompt-row drift). Under R3, `mismatch/*`, `mismatch_ratio/*` and `routing/*` still compare
the learner's *natural* routing with the rollout engine's; `mismatch_replayed/*` (same suffixes as
`mismatch/*`) compares the pass that replays the rollout routes, i.e. the log-probs the loss uses as pi_old.

Attribution of ratio variance to routing: a response token counts as "flipped" when its producing row (t-1)
is routed differently in at least one MoE layer (its own earlier rows also feed it through attention; this
attribution is the direct one). `mismatch_ratio/token_var_share_flipped` / `_agreed` are each subset's share
of the total sum of squared deviations of the token ratios w_t = pi_learner / pi_rollout from their batch mean
(they add up to 1); `token_var_flipped` / `_agreed` are the variances within each subset (which do not split
the total). All four are NaN when their subset is empty (or the total is 0), never 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moe_gspo.algos import mismatch_metrics, ratio_stats
from moe_gspo.algos.mismatch import extreme_frac_curve
from moe_gspo.algos.ratios import token_ratio_var
from moe_gspo.routing.drift import (SetDrift, check_topk_ids, expert_load, per_token_flip_mask, set_drift,
                                   set_drift_of_intersection, topk_intersection)
from moe_gspo.routing.rows import prompt_rows, response_rows, response_spans, row_index, stack_rows


def _comparable_rows(routes_a, routes_b, S: int) -> np.ndarray:
    """int64 [B]: the rows 0 .. n_b - 1 of each sequence that produce a log-prob of a token (n_b <= S - 1)
    and both sides have."""
    return np.array([max(0, min(len(ra), len(rb), S - 1)) for ra, rb in zip(routes_a, routes_b)], dtype=np.int64)


def _flipped_mask(flip_M: np.ndarray, n_B: np.ndarray, response_mask_BS: torch.Tensor) -> torch.Tensor:
    """`flip_M` (the rows 0 .. n_b - 1 of every sequence, concatenated) scattered to the tokens they produce,
    [b, 1 .. n_b], and masked to the response tokens: bool [B, S]."""
    B, S = response_mask_BS.shape
    out = np.zeros((B, S), dtype=bool)
    if n_B.sum():
        rows = np.repeat(np.arange(len(n_B)), n_B)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(n_B) - n_B, n_B) + 1
        out[rows, cols] = flip_M
    return torch.from_numpy(out) & response_mask_BS.cpu().bool()


def flipped_response_mask(routes_a, routes_b, response_mask_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: response tokens whose producing position (t-1) is routed differently in >= 1 layer."""
    n_B = _comparable_rows(routes_a, routes_b, response_mask_BS.shape[1])
    flip = np.zeros(0, bool)
    if n_B.sum():  # every sequence's rows in one comparison, scattered back to [b, 1 .. n_b]
        flip = per_token_flip_mask(*stack_rows(routes_a, routes_b, np.zeros_like(n_B), n_B))
    return _flipped_mask(flip, n_B, response_mask_BS)


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
    return float(token_ratio_var(b, a, sel)) if bool(sel.any()) else math.nan


def _selected_drift(a_all: np.ndarray, b_all: np.ndarray, inter_all: np.ndarray, index: np.ndarray,
                    num_experts: int) -> SetDrift:
    """`set_drift` of the rows `index` of the stacked rows (their intersections computed once for all rows)."""
    check_topk_ids(a_all, b_all, num_experts=num_experts, rows=index)
    return set_drift_of_intersection(inter_all[index], a_all.shape[2])


def _routing_drift(rollout_routes: list, learner_routes: list, P_B, R_B, group_ids, num_experts: int,
                   n_B: np.ndarray) -> tuple[dict, np.ndarray]:
    """`routing/*` on the response rows and `routing_prompt/*` on the prompt rows (module docstring), from
    one comparison of the rows 0 .. n_b - 1 of every sequence (`_comparable_rows`), and whether each of
    those rows differs in some layer (for the flipped tokens)."""
    a_all, b_all = stack_rows(rollout_routes, learner_routes, np.zeros_like(n_B), n_B)
    inter_all = topk_intersection(a_all, b_all)  # [sum n_b, L]: every comparison below selects its rows
    rows = row_index(n_B, *response_rows(P_B, R_B))
    d = _selected_drift(a_all, b_all, inter_all, rows, num_experts)
    out = {"routing/layer_disagree": d.layer_disagree, "routing/any_layer_flip": d.any_layer_flip,
           "routing/mean_layers_differing": d.mean_layers_differing, "routing/topk_overlap": d.topk_overlap,
           "routing/jaccard": d.jaccard, "routing/expert_change_frac": d.expert_change_frac,
           "routing/num_tokens": d.num_tokens,
           "routing/expert_load_rollout": expert_load(a_all, num_experts, rows=rows).tolist(),
           "routing/expert_load_learner": expert_load(b_all, num_experts, rows=rows).tolist()}
    p = _selected_drift(a_all, b_all, inter_all, row_index(n_B, *prompt_rows(P_B, group_ids)), num_experts)
    nan = None if p.num_tokens else math.nan  # no prompt row (one-token prompts): NaN, not a perfect 0
    out.update({
        "routing_prompt/layer_disagree": p.layer_disagree if nan is None else [nan] * len(p.layer_disagree),
        "routing_prompt/any_layer_flip": p.any_layer_flip if nan is None else nan,
        "routing_prompt/mean_layers_differing": p.mean_layers_differing if nan is None else nan,
        "routing_prompt/topk_overlap": p.topk_overlap if nan is None else nan,
        "routing_prompt/jaccard": p.jaccard if nan is None else nan,
        "routing_prompt/expert_change_frac": p.expert_change_frac if nan is None else nan,
        "routing_prompt/num_tokens": p.num_tokens})
    flip_M = (inter_all < a_all.shape[2]).any(axis=1)  # as per_token_flip_mask
    return out, flip_M


def rollout_vs_learner(*, rollout_logp_BS: torch.Tensor, learner_logp_BS: torch.Tensor,
                       response_mask_BS: torch.Tensor, rollout_routes: list | None,
                       learner_routes: list | None, num_experts: int, group_ids=None) -> dict:
    """All rollout-vs-learner metrics for one batch (see the module docstring). `group_ids` (one per
    sequence, e.g. the samples' `prompt_index`) lets `routing_prompt/*` count each prompt once."""
    mask = response_mask_BS.bool().cpu()
    a, b = rollout_logp_BS.detach().float().cpu(), learner_logp_BS.detach().float().cpu()
    out = dict(mismatch_metrics(a, b, mask))
    out["mismatch/extreme_frac_curve"] = extreme_frac_curve(a, b, mask)  # F(tau) on EXTREME_TAUS
    out.update({k: float(v) for k, v in ratio_stats(b, a, mask, namespace="mismatch_ratio").items()})
    if rollout_routes is not None and learner_routes is not None:
        P_B, R_B = response_spans(mask)
        n_B = _comparable_rows(rollout_routes, learner_routes, mask.shape[1])
        drift, flip_M = _routing_drift(rollout_routes, learner_routes, P_B, R_B, group_ids, num_experts, n_B)
        out.update(drift)
        flipped = _flipped_mask(flip_M, n_B, mask)
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
    """`mismatch_replayed/*`: `mismatch/*` of the learner pass that replays the rollout routes (R3)."""
    a, b = rollout_logp_BS.detach().float().cpu(), replayed_logp_BS.detach().float().cpu()
    mask = response_mask_BS.bool().cpu()
    out = mismatch_metrics(a, b, mask, namespace="mismatch_replayed")
    out["mismatch_replayed/extreme_frac_curve"] = extreme_frac_curve(a, b, mask)
    return out


def policy_update_drift(old_routes: list, new_routes: list, response_mask_BS: torch.Tensor, *,
                        num_experts: int, prefix: str = "update/") -> dict:
    """Learner routing of the same rows before vs after an update (GSPO paper §5.3's ~10% figure),
    on the rows that produce response log-probs (as `routing/*`), keyed `{prefix}layer_change`,
    `{prefix}any_layer_change`, `{prefix}expert_change_frac` (`prefix`: `update/` after the first
    optimizer step, `update_all_minibatches/` after all)."""
    ra, rb = stack_rows(old_routes, new_routes, *response_rows(*response_spans(response_mask_BS)))
    d = set_drift(ra, rb, num_experts=num_experts)
    return {f"{prefix}layer_change": d.layer_disagree, f"{prefix}any_layer_change": d.any_layer_flip,
            f"{prefix}expert_change_frac": d.expert_change_frac}

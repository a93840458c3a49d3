"""The `router/*` metrics of a training step: expert-load imbalance (MaxVio), router entropy and router
margin on the rollout side and the learner side, and how often low-margin tokens flip (definitions, and
why the margin is taken on logits: `moe_gspo.routing.router_stats`). Pure maths: no config, no
torch.distributed.

Which rows: those of `routing/*` (`moe_gspo.routing.rows`), the rows that produce response log-probs,
positions P-1 .. P+R-2 of every sequence (the last prompt token and every response token but the last).
Both sides are measured on the same rows; the learner side is its old-policy pass with natural routing
(also under R2/R3, like `routing/*`). Per layer a list, pooled `_mean` (over layers = over all (token,
layer) pairs) and, for MaxVio, `_max` (the worst layer); NaN when the step has no response row.

Peers:
- verl (`verl/trainer/ppo/metric_utils.py`, verl-project/verl at 1dda039): with
  `rollout.moe_load_balance_metrics_interval` > 0 and rollout routing replay on, it counts the rollout
  engine's `routed_experts` per layer over the response tokens (each sequence's last response token, never
  fed to the model, excluded), accumulated over the interval, and logs `rollout/moe/max_vio/layer_i` =
  E * max load share - 1 (the MaxVio below), also `min_vio` (E * min share - 1), `avg_vio` (mean |E * share
  - 1|) and `.../max`, `.../avg` over layers. `router/max_vio_rollout` is the same number per layer and
  step, on rows that differ by one per sequence: verl's are the rows whose *input* is a response token
  (P .. P+R-2), ours include the last prompt token's row (P-1), which produces the first response
  log-prob, so that `router/*` and `routing/*` describe the same tokens. No min/avg violation here (the
  per-expert loads are `routing/expert_load_*`).
- prime-rl (`src/prime_rl/trainer/model.py`, `get_load_balance_stats`): MaxVio per layer in its trainer
  from `tokens_per_expert` over all tokens of a micro-batch, by default leaving out the K busiest experts
  ("padding experts"), averaged over layers (`max_vio/mean`); its `routing_confidence` is the mean top-k
  softmax mass (the sum of a trace row's `router_probs`). Our learner side counts all experts on the
  response rows of the whole batch.

What each engine gives: the MaxVio of a side needs its routes (rollout: `rollout.record_routes`, hf or
vLLM engine; the learner always records them in that pass); margin and entropy need the router logits,
which the learner (recomputed from the router's own gating on its input, one [N, H] x [H, E] product per
layer) and the transformers engine (`rollout.record_probs`; computed on the fly in the router hook or
compact decoder as two float16 scalars per token and layer) record; vLLM returns the routed expert ids
only, so a vLLM run logs `router/max_vio_rollout*`, every learner key and `router/flip_frac_*` (routes of
both sides, margins of the learner), but no rollout margin or entropy. A sequence whose rollout routes are missing,
or hold ids out of range from some row on, contributes only its rows before that, on both sides.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from moe_gspo.routing.drift import per_token_layer_diff
from moe_gspo.routing.router_stats import flip_by_margin, router_summary
from moe_gspo.routing.rows import response_rows, response_spans


def _rows(arrays: Sequence[np.ndarray | None] | None, lo_B, hi_B, tail: tuple, dtype=np.float32) -> np.ndarray | None:
    """Rows [lo_b, hi_b) of every sequence's array, concatenated into [M, *tail] (None passes through;
    sequences with no row may hold None)."""
    if arrays is None:
        return None
    parts = [a[lo:hi] for a, lo, hi in zip(arrays, np.asarray(lo_B).tolist(), np.asarray(hi_B).tolist()) if hi > lo]
    return np.concatenate(parts) if parts else np.zeros((0, *tail), dtype)


def _usable_rows(arrays: Sequence[np.ndarray | None], tail: tuple, num_experts: int | None = None) -> np.ndarray | None:
    """Per sequence, how many leading rows are usable: the array has shape [T, *tail] and, for ids
    (`num_experts` given), every id of the row is in [0, num_experts) (engines may drop or garble routes,
    `moe_gspo.routing.replay_checks`); 0 for a missing array. None when no sequence has any."""
    out = np.zeros(len(arrays), np.int64)
    tail = tuple(tail)
    ids: list[tuple[int, np.ndarray]] = []
    for b, a in enumerate(arrays):
        if a is None:
            continue
        if type(a) is not np.ndarray:
            a = np.asarray(a)
        if a.shape[1:] != tail:  # also a wrong number of dimensions (tail is never empty)
            continue
        if num_experts is None:
            out[b] = a.shape[0]
        elif a.dtype.kind in "iu" and a.shape[0]:
            ids.append((b, a))
    if ids:  # the id range of every sequence's rows at once: one check, then each sequence's first bad row
        which = np.array([b for b, _ in ids], np.int64)
        lens = np.array([a.shape[0] for _, a in ids], np.int64)
        cat = np.concatenate([a for _, a in ids])
        out[which] = lens
        if int(cat.min()) < 0 or int(cat.max()) >= num_experts:
            bad = np.flatnonzero(((cat < 0) | (cat >= num_experts)).reshape(cat.shape[0], -1).any(-1))
            start = np.cumsum(lens) - lens
            pos = np.searchsorted(bad, start)  # the first bad row at or after each sequence's start
            first = bad[np.minimum(pos, bad.size - 1)] - start
            out[which] = np.where((pos < bad.size) & (first < lens), first, lens)
    return out if out.any() else None


def router_diagnostics(*, response_mask_BS: torch.Tensor, num_experts: int, margin_threshold: float,
                       learner_routes: Sequence[np.ndarray], learner_stats: Sequence[np.ndarray] | None = None,
                       rollout_routes: Sequence[np.ndarray | None] | None = None,
                       rollout_margin: Sequence[np.ndarray | None] | None = None,
                       rollout_entropy: Sequence[np.ndarray | None] | None = None) -> dict[str, Any]:
    """`router/*` metrics of one batch (keys: `moe_gspo.routing.router_stats.router_summary`,
    `flip_by_margin`). Per sequence: `*_routes` [T_b, L, K] ids, `learner_stats` [T_b, L, 2] (margin,
    entropy), `rollout_margin` / `rollout_entropy` [T_b, L]. A rollout input that no sequence has (None, or
    None for every sequence) leaves its keys out; otherwise every rollout key is computed on the rows that
    all recorded rollout inputs have (a sequence whose routes are missing, or ids out of range from some
    row on, contributes its rows before that: none for a missing one), and the learner's on the same rows."""
    B = len(learner_routes)
    num_layers, top_k = (learner_routes[0].shape[1:] if B else (0, 0))
    P_B, R_B = response_spans(response_mask_BS)
    lo_B, hi_B = response_rows(P_B, R_B)
    hi_B = np.minimum(hi_B, [len(a) for a in learner_routes])
    if learner_stats is not None:
        hi_B = np.minimum(hi_B, [len(a) for a in learner_stats])
    usable = {name: _usable_rows(seqs, tail, experts) if seqs is not None else None
              for name, seqs, tail, experts in (("routes", rollout_routes, (num_layers, top_k), num_experts),
                                                ("margin", rollout_margin, (num_layers,), None),
                                                ("entropy", rollout_entropy, (num_layers,), None))}
    for n_B in usable.values():
        if n_B is not None:
            hi_B = np.minimum(hi_B, n_B)
    lo_B = np.minimum(lo_B, hi_B)
    out: dict[str, Any] = {}
    ids_LK, per_L = (num_layers, top_k), (num_layers,)
    ro_ids = _rows(rollout_routes, lo_B, hi_B, ids_LK, np.int64) if usable["routes"] is not None else None
    out.update(router_summary(
        "rollout", topk_NLK=ro_ids, num_experts=num_experts, margin_threshold=margin_threshold,
        margin_NL=_rows(rollout_margin, lo_B, hi_B, per_L) if usable["margin"] is not None else None,
        entropy_NL=_rows(rollout_entropy, lo_B, hi_B, per_L) if usable["entropy"] is not None else None))
    le_ids = _rows(learner_routes, lo_B, hi_B, ids_LK, np.int64)
    le_stats = _rows(learner_stats, lo_B, hi_B, (num_layers, 2))
    out.update(router_summary("learner", topk_NLK=le_ids, num_experts=num_experts,
                              margin_NL=None if le_stats is None else le_stats[..., 0],
                              entropy_NL=None if le_stats is None else le_stats[..., 1],
                              margin_threshold=margin_threshold))
    if ro_ids is not None and le_stats is not None:
        out.update(flip_by_margin(le_stats[..., 0], per_token_layer_diff(ro_ids, le_ids), margin_threshold))
    return out


def step_router_diagnostics(samples, old, response_mask_BS: torch.Tensor, *, num_experts: int,
                            margin_threshold: float) -> dict[str, Any]:
    """`router_diagnostics` of a training step: the rollout side from the samples (`RolloutSample`), the
    learner side from the old-policy pass (`LogprobResult` with routes)."""
    def field(name):
        seqs = [getattr(s, name, None) for s in samples]
        return None if all(a is None for a in seqs) else seqs

    return router_diagnostics(
        response_mask_BS=response_mask_BS, num_experts=num_experts, margin_threshold=margin_threshold,
        learner_routes=old.routes, learner_stats=old.router_stats, rollout_routes=field("routes_TLK"),
        rollout_margin=field("router_margin_TL"), rollout_entropy=field("router_entropy_TL"))

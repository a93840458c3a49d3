"""Which routing rows of a training step's sequences the step metrics compare (`moe_gspo.routing.drift_metrics`,
`moe_gspo.routing.router_diag`, `moe_gspo.routing.expert_usage`).

The log-prob of response token t (positions P .. P+R-1 of `prompt + response`) is produced by the forward at
position t-1, so the rows that produce response log-probs are positions P-1 .. P+R-2 (the last prompt token and
every response token but the last): `response_rows`. The prompt rows 0 .. P-2 produce no log-prob that the loss
uses: `prompt_rows` (each group's prompt once). Per sequence, routes are [T_b, L, K] arrays (T_b may differ
between the two sides: a row only one side has is never compared).

Pure numpy on the host (the response mask may be a torch tensor); no config, no torch.distributed.
"""

from __future__ import annotations

import numpy as np
import torch


def response_spans(response_mask_BS: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(P_B, R_B) int64: prompt length (index of the first response token) and response length of
    every sequence, read from the response mask (R = 0 gives P = 0)."""
    mask = response_mask_BS.detach().cpu().bool()
    lens = mask.sum(-1).numpy().astype(np.int64)
    first = mask.int().argmax(-1).numpy().astype(np.int64)
    return np.where(lens > 0, first, 0), lens


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


def stack_rows(routes_a: list, routes_b: list, lo_B, hi_B) -> tuple[np.ndarray, np.ndarray]:
    """Rows [lo_b, hi_b) of every sequence that both sides have, concatenated: (a_NLK, b_NLK)."""
    n = min(len(routes_a), len(routes_b), len(lo_B), len(hi_B))
    if not n:
        return np.zeros((0, 0, 0), np.int64), np.zeros((0, 0, 0), np.int64)
    routes_a, routes_b = routes_a[:n], routes_b[:n]
    # the bounds of every sequence at once, then one slice per sequence and side
    hi = np.minimum(np.minimum(np.asarray(hi_B, np.int64)[:n], np.fromiter(map(len, routes_a), np.int64, n)),
                    np.fromiter(map(len, routes_b), np.int64, n))
    lo = np.minimum(np.asarray(lo_B, np.int64)[:n], hi)
    lo, hi = lo.tolist(), hi.tolist()
    return (np.concatenate([r[i:j] for r, i, j in zip(routes_a, lo, hi)]),
            np.concatenate([r[i:j] for r, i, j in zip(routes_b, lo, hi)]))


def row_index(n_B, lo_B, hi_B) -> np.ndarray:
    """int64 [M]: where rows [lo_b, hi_b) of every sequence (cut at n_b) lie in the concatenation of the rows
    0 .. n_b - 1 of every sequence (as `stack_rows(a, b, 0, n_B)` stacks them), in sequence order."""
    n_B = np.asarray(n_B, np.int64)
    hi = np.minimum(np.asarray(hi_B, np.int64), n_B)
    lo = np.minimum(np.asarray(lo_B, np.int64), hi)
    count = hi - lo
    first = np.cumsum(n_B) - n_B + lo  # each selected run's first row in the concatenation
    return np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()), dtype=np.int64)

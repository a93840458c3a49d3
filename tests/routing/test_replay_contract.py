"""Issue 41: R3's replay contract (`moe_gspo.routing.replay_checks.replay_mismatch`), hand-counted: the share of
replayed (token, layer) rows whose used top-k set differs from the replayed one, fallback rows and each
sequence's last row left out."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_gspo.routing.replay_checks import REPLAY_MISMATCH_KEY, check_routes, replay_mismatch


def _routes():
    """Two sequences, n = 4 and 3 tokens, 2 MoE layers, top-2 of 4 experts (rows = tokens)."""
    a = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]], [[0, 2], [1, 3]]], np.uint8)
    b = np.array([[[2, 3], [0, 1]], [[0, 3], [1, 2]], [[1, 3], [0, 2]]], np.uint8)
    return [a, b]


def _reasons(routes, lens=(4, 3)):
    return check_routes(routes, list(lens), num_layers=2, top_k=2, num_experts=4)[0]


def test_exact_replay_and_reordered_topk_are_no_mismatch():
    routes = _routes()
    assert replay_mismatch(routes, routes, _reasons(routes)) == {REPLAY_MISMATCH_KEY: 0.0}
    swapped = [r[..., ::-1].copy() for r in routes]  # the same sets in the other order: the contract holds
    assert replay_mismatch(routes, swapped, _reasons(routes))[REPLAY_MISMATCH_KEY] == 0.0


def test_permuted_ids_are_detected_hand_counted():
    routes = _routes()
    # counted pairs: rows 0..2 of seq 0 and rows 0..1 of seq 1 (the last row of each is not replayed) x 2 layers = 10
    used = [r.copy() for r in routes]
    used[0][1, 0] = [2, 1]   # {1, 2}: same set, reordered: no mismatch
    used[0][2, 1] = [1, 3]   # {1, 2} -> {1, 3}: mismatch
    used[1][0, 0] = [3, 2]   # {2, 3} same set
    used[1][1, 1] = [0, 3]   # {1, 2} -> {0, 3}: mismatch
    used[0][3] = [[1, 2], [0, 3]]  # the last row (no log-prob): not counted
    assert replay_mismatch(routes, used, _reasons(routes))[REPLAY_MISMATCH_KEY] == pytest.approx(2 / 10)
    # a wrong replay permuting expert ids (e -> (e + 1) % E) breaks every counted pair
    permuted = [((r.astype(np.int64) + 1) % 4).astype(np.uint8) for r in routes]
    assert replay_mismatch(routes, permuted, _reasons(routes))[REPLAY_MISMATCH_KEY] == 1.0
    # rows replayed in the wrong order (sequence-major vs batch-major mix-ups): rows 0 and 1 swapped in seq 0
    shuffled = [routes[0][[1, 0, 2, 3]], routes[1]]
    assert replay_mismatch(routes, shuffled, _reasons(routes))[REPLAY_MISMATCH_KEY] == pytest.approx(4 / 10)


def test_fallback_rows_are_not_counted():
    routes = _routes()
    engine = [routes[0].copy(), None]  # seq 1 has no engine routes: all of its rows fall back
    engine[0][1, 0] = [2, 2]           # a duplicate: row 1 of seq 0 falls back
    reasons = _reasons(engine)
    used = [r.copy() for r in routes]
    used[0][1] = [[0, 1], [0, 1]]      # differs on a fallback row: not counted
    used[1][0] = [[0, 1], [0, 1]]      # the whole fallback sequence: not counted
    used[0][2, 0] = [0, 1]             # {0, 3} -> {0, 1}: counted, a mismatch
    # counted: rows 0 and 2 of seq 0 x 2 layers = 4 pairs
    assert replay_mismatch(routes, used, reasons)[REPLAY_MISMATCH_KEY] == pytest.approx(1 / 4)
    nothing = _reasons([None, None])
    assert math.isnan(replay_mismatch(routes, used, nothing)[REPLAY_MISMATCH_KEY])
    with pytest.raises(ValueError, match="one of each per sequence"):
        replay_mismatch(routes, used[:1], reasons)

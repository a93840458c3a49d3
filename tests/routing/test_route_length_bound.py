"""Issue 43.12: an R3 route array may be one row short of its sequence (the engine does not route the
last sampled token), never two: `n - 1 <= T <= n` in `row_reasons`."""

from __future__ import annotations

import numpy as np

from moe_gspo.routing.replay_checks import LENGTH, MISSING, row_reasons


def _routes(T: int) -> np.ndarray:
    return np.tile(np.array([[[0, 1], [2, 3]]], dtype=np.uint8), (T, 1, 1))


def test_two_rows_short_is_refused_one_row_short_is_not():
    n = 6
    assert (row_reasons(_routes(n - 2), n, num_layers=2, top_k=2, num_experts=8) == LENGTH).all()
    one_short = row_reasons(_routes(n - 1), n, num_layers=2, top_k=2, num_experts=8)
    assert one_short[:-1].tolist() == [0] * (n - 1) and one_short[-1] == MISSING
    assert (row_reasons(_routes(n), n, num_layers=2, top_k=2, num_experts=8) == 0).all()
    assert (row_reasons(_routes(n + 1), n, num_layers=2, top_k=2, num_experts=8) == LENGTH).all()

"""Issue 41: dead experts over a trailing window (`moe_gspo.routing.expert_usage`), hand-counted."""

from __future__ import annotations

import numpy as np
import pytest

from moe_gspo.routing.expert_usage import ExpertUsageWindow, dead_experts, expert_token_counts


def test_expert_token_counts_hand_counted():
    # 2 MoE layers, top-2 of 4 experts; seq 0 rows 1..2 counted, seq 1 row 0 counted, seq 2 none
    r0 = np.array([[[3, 3], [3, 3]], [[0, 1], [2, 3]], [[0, 2], [2, 1]], [[3, 3], [3, 3]]], np.uint8)
    r1 = np.array([[[1, 0], [0, 2]], [[3, 3], [3, 3]]], np.uint8)
    counts = expert_token_counts([r0, r1, None], [1, 0, 0], [3, 1, 0], num_layers=2, num_experts=4)
    assert counts.tolist() == [[3, 2, 1, 0], [1, 1, 3, 1]]


def test_dead_experts_over_the_trailing_window():
    w = ExpertUsageWindow()
    zero_after = lambda *dead: np.array([[0 if (l, e) in dead else 1 for e in range(3)] for l in range(2)])  # noqa: E731
    # window 3: experts with no token in the last 3 steps (the current one included)
    assert w.update(zero_after((0, 0), (1, 2)), window=3) == 2       # step 0: 2 unused pairs, 1 step seen
    assert w.update(zero_after((0, 0)), window=3) == 1               # (1, 2) got tokens at step 1
    assert w.update(zero_after((0, 0), (0, 1)), window=3) == 1       # (0, 1) used at steps 0, 1
    assert w.update(zero_after((0, 1)), window=3) == 0               # (0, 0) used now; (0, 1) used at step 1
    assert w.update(zero_after((0, 1)), window=3) == 1               # (0, 1) unused at steps 2, 3, 4: dead
    assert len(w) == 3
    assert w.update(zero_after(), window=3) == 0                     # (0, 1) used at step 5: alive again
    # a checkpoint round trip continues identically
    again = ExpertUsageWindow()
    again.load_state_dict(w.state_dict())
    nxt = zero_after((1, 0))
    assert again.update(nxt, window=3) == w.update(nxt, window=3) == 0   # (1, 0) used at steps 4, 5
    assert again.update(nxt, window=2) == w.update(nxt, window=2) == 1   # window 2: steps 6, 7, both without (1, 0)
    assert dead_experts(np.zeros((0, 2, 3))) == 0
    with pytest.raises(ValueError, match=">= 1 step"):
        w.update(nxt, window=0)
    empty = ExpertUsageWindow()
    empty.load_state_dict(ExpertUsageWindow().state_dict())
    assert len(empty) == 0

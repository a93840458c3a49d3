"""Issue 41: F(tau), the R3 paper's extreme-token fraction curve (`moe_gspo.algos.mismatch.extreme_frac_curve`),
hand-counted, and equal to `mismatch/extreme_frac_ln2` / `_ln5` at tau = 2 and 5."""

from __future__ import annotations

import math

import pytest
import torch

from moe_gspo.algos.mismatch import EXTREME_TAUS, extreme_frac_curve, mismatch_metrics


def _batch():
    """8 valid tokens whose |log p_a - log p_b| are 0, 0.05, 0.2, 0.3, 0.5, 0.9, 1.8, 2.5 (either sign), plus a
    masked token with a huge difference that must not count."""
    diffs = torch.tensor([[0.0, -0.05, 0.2, -0.3, 0.5], [-0.9, 1.8, -2.5, 40.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    logp_b = torch.full_like(diffs, -1.0)
    return logp_b + diffs, logp_b, mask


def test_hand_values_on_the_default_grid():
    a, b, mask = _batch()
    # ln tau: 1.1 -> 0.0953, 1.25 -> 0.223, 1.5 -> 0.405, 2 -> 0.693, 3 -> 1.099, 5 -> 1.609, 10 -> 2.303
    # tokens beyond:   6 (0.2 ..)  5 (0.3 ..)   4 (0.5 ..)  3 (0.9 ..) 2 (1.8, 2.5) 2        1 (2.5)
    assert EXTREME_TAUS == (1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
    assert extreme_frac_curve(a, b, mask) == pytest.approx([6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 2 / 8, 1 / 8])
    assert extreme_frac_curve(b, a, mask) == extreme_frac_curve(a, b, mask)  # symmetric in the two sides


def test_points_at_2_and_5_are_the_logged_extreme_fracs_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    a = -torch.rand(4, 30, generator=g, dtype=torch.float64) * 3
    b = a + torch.randn(4, 30, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 30, generator=g) > 0.3
    curve = dict(zip(EXTREME_TAUS, extreme_frac_curve(a, b, mask)))
    m = mismatch_metrics(a, b, mask)
    assert curve[2.0] == m["mismatch/extreme_frac_ln2"] and curve[5.0] == m["mismatch/extreme_frac_ln5"]
    values = list(curve.values())
    assert all(x >= y for x, y in zip(values, values[1:]))  # non-increasing in tau


def test_no_valid_token_and_bad_taus():
    a, b, mask = _batch()
    assert extreme_frac_curve(a, b, torch.zeros_like(mask)) == [0.0] * len(EXTREME_TAUS)
    assert extreme_frac_curve(a, b, mask, taus=[math.e]) == [2 / 8]  # ln e = 1: 1.8 and 2.5 (0.9 is not beyond)
    with pytest.raises(ValueError, match="must be > 1"):
        extreme_frac_curve(a, b, mask, taus=[1.0])

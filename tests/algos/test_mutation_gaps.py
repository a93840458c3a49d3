"""Issue 43.12: tests that fail under the planted bugs of the mutation check: the KL clamp at
+-max_log_ratio, OPSM at an advantage of exactly 0 (`A < 0`, not `A <= 0`), and GSPO's asymmetric clip
bounds (clip_low != clip_high, swapped = a different loss). The config and R3 ones:
tests/test_config_bounds.py, tests/routing/test_route_length_bound.py."""

from __future__ import annotations

import math

import pytest
import torch

from moe_gspo.algos import opsm_mask, policy_loss
from moe_gspo.algos.kl import kl_estimate


@pytest.mark.parametrize("estimator, expected", [
    ("k1", [20.0, -20.0, 1.0]),
    ("k2", [200.0, 200.0, 0.5]),
    ("k3", [math.expm1(-20.0) + 20.0, math.expm1(20.0) - 20.0, math.expm1(-1.0) + 1.0]),
])
def test_kl_clamps_the_log_ratio_at_max_log_ratio(estimator, expected):
    """|logp - ref| = 30 beyond max_log_ratio = 20 is clamped to +-20 (unclamped k3 at -30 is ~1e13)."""
    logp = torch.tensor([[0.0, -30.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-30.0, 0.0, -2.0]], dtype=torch.float64)
    est = kl_estimate(logp, ref, torch.ones(1, 3, dtype=torch.bool), estimator, max_log_ratio=20.0)
    torch.testing.assert_close(est[0], torch.tensor(expected, dtype=torch.float64))


def test_opsm_keeps_a_drifted_sequence_whose_advantage_is_exactly_zero():
    """OPSM masks only A < 0 with drift > delta; A == 0 (and A > 0) is kept, A just below 0 masked."""
    B, T = 3, 2
    logp = torch.full((B, T), -3.0, dtype=torch.float64)
    rollout = torch.full((B, T), -1.0, dtype=torch.float64)  # drift = 2 per token, far above delta
    adv = torch.tensor([0.0, -1e-9, 1.0], dtype=torch.float64)
    keep, m = opsm_mask(logp, rollout, adv, torch.ones(B, T, dtype=torch.bool), delta=1e-4)
    assert keep.tolist() == [[True, True], [False, False], [True, True]]
    assert m["rollout_corr/opsm_masked_seq_frac"].item() == pytest.approx(1 / 3)


def _asymmetric_batch():
    """Three two-token sequences with GSPO ratios s = 1.5 (A = +1), 0.5 (A = -2), 1.0 (A = +1)."""
    old = torch.full((3, 2), -1.0, dtype=torch.float64)
    lr = torch.tensor([[math.log(1.5)] * 2, [math.log(0.5)] * 2, [0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 1.0], dtype=torch.float64)
    return (old + lr).requires_grad_(True), old, adv, torch.ones(3, 2, dtype=torch.bool)


def test_gspo_hand_values_with_asymmetric_clip_bounds():
    """clip_low = 0.1, clip_high = 0.3: the ratio range is [0.9, 1.3]. Terms min(sA, clip(s)A):
    seq 0 min(1.5, 1.3) = 1.3; seq 1 min(-1.0, -1.8) = -1.8; seq 2 1.0 -> loss = -(0.5) / 3.
    Swapped bounds ([0.7, 1.1]) would give 1.1 - 1.4 + 1.0 = 0.7 -> -0.7 / 3."""
    logp, old, adv, mask = _asymmetric_batch()
    loss, m = policy_loss("gspo", logp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    assert loss.item() == pytest.approx(-0.5 / 3)
    swapped, _ = policy_loss("gspo", logp, old, adv, mask, clip_low=0.3, clip_high=0.1)
    assert swapped.item() == pytest.approx(-0.7 / 3)
    # both out-of-range sequences bind: seq 0 at the ceiling, seq 1 at the floor
    assert m["clip/token_frac_high"].item() == pytest.approx(2 / 6)
    assert m["clip/token_frac_low"].item() == pytest.approx(2 / 6)

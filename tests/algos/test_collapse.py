"""Collapse metrics (moe_gspo/algos/collapse.py), against hand-computed values."""

import math

import pytest
import torch

from moe_gspo.algos import group_advantages
from moe_gspo.algos.collapse import group_signal_metrics, mean_token_entropy


def test_zero_std_groups_and_nonzero_advantages_by_hand():
    # 3 groups of 4: all equal (no signal), one different, all equal at 1.0
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    m = group_signal_metrics(rewards, adv, 4)
    assert m["reward/frac_zero_std"] == pytest.approx(2 / 3)
    assert m["advantage/nonzero_frac"] == pytest.approx(4 / 12)  # the mixed group: all 4 responses move
    # a group differing by a rounding residue still counts as having signal (max != min)
    m = group_signal_metrics(torch.tensor([0.3, 0.3 + 1e-7, 0.3, 0.3]), torch.tensor([-0.5, 1.5, -0.5, -0.5]), 4)
    assert m == {"reward/frac_zero_std": 0.0, "advantage/nonzero_frac": 1.0}


def test_group_signal_rejects_bad_shapes():
    with pytest.raises(ValueError, match="group_size"):
        group_signal_metrics(torch.zeros(6), torch.zeros(6), 4)
    with pytest.raises(ValueError, match="one length"):
        group_signal_metrics(torch.zeros(4), torch.zeros(3), 2)


def test_mean_token_entropy_over_valid_tokens_only():
    ent = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.5]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert mean_token_entropy(ent, mask) == pytest.approx((1 + 2 + 4 + 0.5) / 4)  # a token mean, not per sequence
    assert math.isnan(mean_token_entropy(ent, torch.zeros_like(mask)))
    with pytest.raises(ValueError, match="one shape"):
        mean_token_entropy(ent, mask[:, :2])


# --------------------------------------------------------------------------- detect_failure

import numpy as np  # noqa: E402

from moe_gspo.algos.collapse import FailureCriteria, FailureEvent, detect_failure, trailing_mean  # noqa: E402

W1 = FailureCriteria(window=1)  # no smoothing: every case below is read off the raw curve


def test_pre_registered_defaults():
    c = FailureCriteria()
    assert (c.window, c.drop, c.stall_enter, c.stall_stay, c.solved, c.min_persist) == (10, 0.3, 0.9, 0.75, 0.9, 20)
    with pytest.raises(TypeError):
        FailureCriteria(5)  # kw_only
    with pytest.raises(Exception):
        c.window = 3  # frozen


def test_trailing_mean_by_hand():
    np.testing.assert_allclose(trailing_mean(np.asarray([1.0, 2.0, 3.0, 4.0]), 2), [1.0, 1.5, 2.5, 3.5])
    got = trailing_mean(np.asarray([1.0, np.nan, 3.0, np.nan, np.nan]), 2)  # NaN left out of each window
    np.testing.assert_allclose(got, [1.0, 1.0, 3.0, 3.0, np.nan])


def test_collapse_by_hand():
    r = np.r_[np.full(10, 0.5), np.full(5, 0.8), np.full(25, 0.4)]  # best 0.8; 0.4 ≤ 0.5 from step 15 on
    assert detect_failure(r, None, W1) == FailureEvent("collapse", 15, 39)
    # the pre-registered 10-step window: mean of 9 x 1.0 and 0.0 ... first ≤ 0.7 at step 12 (7 ones, 3 zeros)
    r = np.r_[np.ones(10), np.zeros(40)]
    assert detect_failure(r) == FailureEvent("collapse", 12, 49)


def test_recovery_is_no_event():
    r = np.r_[np.full(10, 0.5), np.full(5, 0.8), np.full(20, 0.4), np.full(5, 0.6)]  # back within 0.3 of 0.8
    assert detect_failure(r, None, W1) == FailureEvent(None, None, 39)
    z = np.r_[np.zeros(5), np.full(30, 0.95), np.full(5, 0.5)]  # signal comes back: no stall
    assert detect_failure(np.full(40, 0.6), z, W1) == FailureEvent(None, None, 39)


def test_an_event_too_late_is_censored():
    r = np.r_[np.full(21, 0.8), np.full(19, 0.4)]  # collapse at step 21 > 40 - 20
    assert detect_failure(r, None, W1) == FailureEvent(None, None, 39)
    r = np.r_[np.full(20, 0.8), np.full(20, 0.4)]  # at step 20 = 40 - 20: counts
    assert detect_failure(r, None, W1) == FailureEvent("collapse", 20, 39)
    assert detect_failure(np.full(10, 0.1), np.ones(10)) == FailureEvent(None, None, 9)  # a 10-step run
    assert detect_failure(np.zeros(0)) == FailureEvent(None, None, -1)


def test_stall_by_hand():
    z = np.r_[np.zeros(5), np.full(35, 0.95)]
    assert detect_failure(np.full(40, 0.6), z, W1) == FailureEvent("stall", 5, 39)
    # dips to 0.8 (≥ stall_stay 0.75) do not end a stall; entering needs 0.9
    z = np.r_[np.zeros(5), 0.85, np.full(10, 0.95), np.full(24, 0.8)]
    assert detect_failure(np.full(40, 0.6), z, W1) == FailureEvent("stall", 6, 39)
    # solved (reward ≥ 0.9): all-equal groups are all-correct ones, not a stall
    assert detect_failure(np.full(40, 0.95), np.ones(40), W1) == FailureEvent(None, None, 39)
    # the reward reaching 0.9 later ends it
    assert detect_failure(np.r_[np.full(30, 0.6), np.full(10, 0.9)], np.ones(40), W1).kind is None


def test_both_kinds_the_earlier_wins_collapse_on_a_tie():
    r = np.r_[np.full(5, 0.8), np.full(35, 0.4)]
    z = np.r_[np.zeros(5), np.full(35, 0.95)]
    assert detect_failure(r, z, W1) == FailureEvent("collapse", 5, 39)  # both at step 5
    z = np.r_[np.zeros(3), np.full(37, 0.95)]
    assert detect_failure(r, z, W1) == FailureEvent("stall", 3, 39)  # stall from step 3, collapse from 5


def test_a_monotone_learning_curve_is_no_failure():
    r = np.linspace(0.0, 1.0, 200)
    z = 1.0 - 4 * r * (1 - r)  # all groups equal at the start (all wrong) and the end (all right)
    assert detect_failure(r, z) == FailureEvent(None, None, 199)
    assert detect_failure(r, z, W1) == FailureEvent(None, None, 199)


def test_thresholds_hold_within_rounding():
    # ten steps at 0.9 average to 0.8999999999999999: that is solved, not a stall
    assert detect_failure(np.full(40, 0.9), np.ones(40)) == FailureEvent(None, None, 39)
    assert detect_failure(np.full(40, 0.6), np.full(40, 0.9)).kind == "stall"


def test_dead_end_of_run_fix_counts_a_late_fall_to_zero_only_when_asked():
    """Issue 47's detector (dead_reward): experiment 2's missed run fell from a low best (0.32) to ~0 and
    stayed there; without a drop of 0.3 from its best and without all-equal groups nothing else fires."""
    r = np.r_[np.full(10, 0.32), np.full(25, 0.03), np.full(5, 0.0)]
    z = np.full(40, 0.5)  # a few groups still differ: no stall
    assert detect_failure(r, z, W1) == FailureEvent(None, None, 39)  # experiments 1-2's detector misses it
    v2 = FailureCriteria(window=1, min_persist=20, dead_reward=0.1)
    assert detect_failure(r, z, v2) == FailureEvent("dead", 10, 39)
    # a fall in the last steps counts too (no min_persist: the run ends dead) ...
    late = np.r_[np.full(35, 0.5), np.full(5, 0.05)]
    assert detect_failure(late, z, v2) == FailureEvent("dead", 35, 39)
    # ... but not a run that recovers above dead_reward, nor one that ends solved
    assert detect_failure(np.r_[np.full(35, 0.05), np.full(5, 0.2)], z, v2).kind is None
    assert detect_failure(np.linspace(0.0, 1.0, 40), z, v2).kind is None
    # the earlier event wins: a collapse from 0.8 at step 5 before the reward is dead
    r = np.r_[np.full(5, 0.8), np.full(10, 0.4), np.full(25, 0.05)]
    assert detect_failure(r, z, v2) == FailureEvent("collapse", 5, 39)

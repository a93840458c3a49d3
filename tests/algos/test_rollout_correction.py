"""Rollout corrections: hand-computed TIS weights and rejection masks at every level, OPSM masks, their
metrics, empty inputs, garbage padding, argument errors."""

import math

import pytest
import torch

from moe_gspo.algos import opsm_mask, rollout_correction, rollout_is_weights, rollout_rs_mask

LN = math.log
NAN, INF = float("nan"), float("inf")


def _batch():
    """pi_learner_old / pi_rollout per token (log ratio lr = old - rollout):
    seq 0: ratios [3, 0.4]   (product 1.2, geometric mean sqrt(1.2) = 1.0954)
    seq 1: ratios [1.2, pad]
    seq 2: no valid token. Padding holds garbage."""
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, NAN], [INF, -INF]], dtype=torch.float64)
    lr = torch.tensor([[LN(3.0), LN(0.4)], [LN(1.2), 0.0], [0.0, 0.0]], dtype=torch.float64)
    old = torch.where(torch.isfinite(rollout), rollout + lr, torch.tensor(NAN, dtype=torch.float64))
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    return old, rollout, mask


def _floats(m):
    return {k: float(v) for k, v in m.items()}


def test_token_is_hand_values():
    old, rollout, mask = _batch()
    w, m = rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.4], [1.2, 0.0], [0.0, 0.0]]))
    m = _floats(m)
    assert m["rollout_corr/is_raw_mean"] == pytest.approx((3 + 0.4 + 1.2) / 3)
    assert m["rollout_corr/is_raw_max"] == pytest.approx(3.0)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx((2 + 0.4 + 1.2) / 3)
    assert m["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 3)
    # ESS of the applied weights: (sum w)^2 / (N sum w^2)
    assert m["rollout_corr/is_ess"] == pytest.approx(3.6 ** 2 / (3 * (4 + 0.16 + 1.44)))


@pytest.mark.parametrize("threshold,truncated", [(2.0, 0.0), (1.15, 1.0)])
def test_sequence_is_hand_values(threshold, truncated):
    old, rollout, mask = _batch()
    w, m = rollout_is_weights(old, rollout, mask, level="sequence", threshold=threshold)
    applied = [min(1.2, threshold)] * 2  # both sequences have product 1.2
    expected = torch.tensor([[applied[0], applied[0]], [applied[1], 0.0], [0.0, 0.0]])
    torch.testing.assert_close(w, expected)
    m = _floats(m)
    assert m["rollout_corr/is_raw_mean"] == pytest.approx(1.2)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(applied[0])
    assert m["rollout_corr/is_truncated_frac"] == truncated
    assert m["rollout_corr/is_ess"] == pytest.approx(1.0)  # equal weights


def test_token_rs_hand_values():
    old, rollout, mask = _batch()
    keep, m = rollout_rs_mask(old, rollout, mask, level="token", threshold=2.0)  # lower = 0.5
    assert keep.tolist() == [[False, False], [True, False], [False, False]]  # 3 high, 0.4 low
    assert _floats(m) == pytest.approx({"rollout_corr/rs_masked_token_frac": 2 / 3,
                                        "rollout_corr/rs_masked_seq_frac": 1 / 2,
                                        "rollout_corr/rs_frac_high": 1 / 3, "rollout_corr/rs_frac_low": 1 / 3})
    keep, m = rollout_rs_mask(old, rollout, mask, level="token", threshold=4.0, threshold_lower=0.3)
    assert keep.tolist() == [[True, True], [True, False], [False, False]]
    assert float(m["rollout_corr/rs_masked_token_frac"]) == 0.0


def test_geometric_vs_sequence_rs():
    old, rollout, mask = _batch()
    # geometric means [1.0954, 1.2] vs products [1.2, 1.2], bounds [0.95, 1.1]
    keep, m = rollout_rs_mask(old, rollout, mask, level="geometric", threshold=1.1, threshold_lower=0.95)
    assert keep.tolist() == [[True, True], [False, False], [False, False]]
    assert _floats(m) == pytest.approx({"rollout_corr/rs_masked_token_frac": 1 / 3,
                                        "rollout_corr/rs_masked_seq_frac": 1 / 2,
                                        "rollout_corr/rs_frac_high": 1 / 2, "rollout_corr/rs_frac_low": 0.0})
    keep, m = rollout_rs_mask(old, rollout, mask, level="sequence", threshold=1.1, threshold_lower=0.95)
    assert not keep.any()
    assert float(m["rollout_corr/rs_masked_seq_frac"]) == 1.0 and float(m["rollout_corr/rs_frac_high"]) == 1.0


def test_combined_and_none():
    old, rollout, mask = _batch()
    (w, keep), m = rollout_correction(old, rollout, mask)
    assert w is None and keep is None and m == {}
    (w, keep), m = rollout_correction(old, rollout, mask, rollout_is="token", rollout_rs="token",
                                      rollout_rs_threshold=2.0)
    assert w[0, 0].item() == 2.0  # rollout_is_threshold None = verl's 2.0
    assert keep.tolist() == [[False, False], [True, False], [False, False]]
    assert {k.split("/")[1][:3] for k in m} == {"is_", "rs_"}


def test_empty_batch_gives_nan_metrics_and_zero_weights():
    old, rollout, _ = _batch()
    mask = torch.zeros(3, 2, dtype=torch.bool)
    for level in ("token", "sequence"):
        w, m = rollout_is_weights(old, rollout, mask, level=level)
        assert (w == 0).all() and all(math.isnan(float(v)) for v in m.values())
    keep, m = rollout_rs_mask(old, rollout, mask, level="geometric", threshold=1.1)
    assert not keep.any() and all(math.isnan(float(v)) for v in m.values())


def test_weights_are_detached_and_bounded():
    old, rollout, mask = _batch()
    old = old.clone().requires_grad_(True)
    lr_huge = torch.tensor([[500.0, -500.0]], dtype=torch.float64)
    w, m = rollout_is_weights(lr_huge, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2), level="token",
                              threshold=1e30)
    assert not w.requires_grad and torch.isfinite(w).all()
    assert float(m["rollout_corr/is_raw_max"]) == pytest.approx(math.exp(20.0), rel=1e-6)
    w, _ = rollout_is_weights(old, rollout, mask, level="token")
    assert not w.requires_grad


@pytest.mark.parametrize("call,match", [
    (lambda o, r, m: rollout_is_weights(o, r, m, level="geometric"), "'token' or 'sequence'"),
    (lambda o, r, m: rollout_is_weights(o, r, m, level="token", threshold=0.0), "> 0"),
    (lambda o, r, m: rollout_rs_mask(o, r, m, level="token", threshold=0.9), "lower < 1 < upper"),
    (lambda o, r, m: rollout_rs_mask(o, r, m, level="token", threshold=2.0, threshold_lower=1.5), "lower < 1"),
    (lambda o, r, m: rollout_correction(o, r, m, rollout_rs="token"), "rollout_rs_threshold"),
    (lambda o, r, m: rollout_correction(o, r, m, rollout_is="seq"), "rollout_is must be one of"),
])
def test_errors(call, match):
    old, rollout, mask = _batch()
    with pytest.raises(ValueError, match=match):
        call(old, rollout, mask)


def _opsm_batch():
    """Current-policy and rollout log-probs, per sequence (drift = mean_t rollout - current):
    seq 0: diffs [0.5, 0.1] -> drift 0.3,  A = -1    (masked for any delta < 0.3)
    seq 1: diffs [-0.1, pad] -> drift -0.1, A = -1   (kept: the current policy is MORE likely)
    seq 2: diffs [1, 1]  -> drift 1.0,  A = +0.5     (kept: positive advantage)
    seq 3: no valid token, A = -1                    (not a sequence)
    seq 4: diffs [0.25, 0.25] -> drift 0.25, A = -2  (kept at delta = 0.25 exactly: strictly above masks)
    Padding holds garbage."""
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, NAN], [-1.0, -1.0], [INF, -INF], [0.0, -1.0]], dtype=torch.float64)
    current = torch.tensor([[-1.5, -2.1], [-0.4, INF], [-2.0, -2.0], [NAN, 0.0], [-0.25, -1.25]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [True, True], [False, False], [True, True]])
    adv = torch.tensor([-1.0, -1.0, 0.5, -1.0, -2.0])
    return current, rollout, adv, mask


def test_opsm_hand_values():
    current, rollout, adv, mask = _opsm_batch()
    keep, m = opsm_mask(current, rollout, adv, mask)  # delta = 1e-4 (slime's default)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [[False, False], [True, False], [True, True], [False, False], [False, False]]
    assert _floats(m) == pytest.approx({"rollout_corr/opsm_masked_seq_frac": 2 / 4,  # seqs 0 and 4 of 0, 1, 2, 4
                                        "rollout_corr/opsm_masked_token_frac": 4 / 7,
                                        "rollout_corr/opsm_kl_mean": (0.3 - 0.1 + 1.0 + 0.25) / 4})
    keep, m = opsm_mask(current, rollout, adv, mask, delta=0.25)  # seq 4 sits exactly on the threshold
    assert keep.tolist() == [[False, False], [True, False], [True, True], [False, False], [True, True]]
    assert float(m["rollout_corr/opsm_masked_seq_frac"]) == 1 / 4
    assert float(m["rollout_corr/opsm_masked_token_frac"]) == 2 / 7
    keep, _ = opsm_mask(current, rollout, adv, mask, delta=10.0)
    assert keep.tolist() == mask.tolist()
    # positive advantages are never masked, however far the policy drifted
    keep, m = opsm_mask(current, rollout, adv.abs(), mask, delta=0.0)
    assert keep.tolist() == mask.tolist() and float(m["rollout_corr/opsm_masked_seq_frac"]) == 0.0


def test_opsm_reads_the_current_policy_detached_and_checks_arguments():
    current, rollout, adv, mask = _opsm_batch()
    current = current.clone().requires_grad_(True)
    keep, _ = opsm_mask(current, rollout, adv, mask)
    assert not keep.requires_grad
    keep, m = opsm_mask(current, rollout, adv, torch.zeros_like(mask))
    assert not keep.any() and all(math.isnan(float(v)) for v in m.values())
    with pytest.raises(ValueError, match="delta must be >= 0"):
        opsm_mask(current, rollout, adv, mask, delta=-1e-4)
    with pytest.raises(ValueError, match=r"advantages_B has shape \(4,\)"):
        opsm_mask(current, rollout, adv[:4], mask)
    with pytest.raises(ValueError, match="rollout_logp_BT has shape"):
        opsm_mask(current, rollout[:, :1], adv, mask)

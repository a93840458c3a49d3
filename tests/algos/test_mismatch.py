"""Tests of mismatch_metrics: hand values, direction, identical inputs, empty input, dtypes."""

import math

import pytest
import torch

from moe_gspo.algos import mismatch_metrics
from moe_gspo.algos.mismatch import MISMATCH_KEYS

LN2, LN4, LN8 = math.log(2.0), math.log(4.0), math.log(8.0)
NAN = float("nan")


def _hand_batch(dtype=torch.float64):
    """d = logp_a - logp_b: seq 0 [0, ln4, -0.1], seq 1 [ln8, pad, pad], seq 2 all padding."""
    logp_a = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, NAN, 0.0], [NAN, NAN, NAN]], dtype=torch.float64)
    d = torch.tensor([[0.0, LN4, -0.1], [LN8, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    logp_b = logp_a - d
    logp_b[1, 1] = -float("inf")
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    return logp_a.to(dtype), logp_b.to(dtype), mask


def test_hand_values():
    metrics = mismatch_metrics(*_hand_batch())
    assert tuple(metrics) == MISMATCH_KEYS
    assert all(type(v) is float for v in metrics.values())
    # k1 = mean(d) = (0 + ln4 - 0.1 + ln8) / 4
    assert metrics["mismatch/k1_kl"] == pytest.approx((LN4 - 0.1 + LN8) / 4)
    # k3 per token, r = exp(-d): r - 1 - log r = e^{-d} - 1 + d:
    #   d=0 -> 0; d=ln4 -> 1/4 - 1 + ln4; d=-0.1 -> e^{0.1} - 1 - 0.1; d=ln8 -> 1/8 - 1 + ln8
    k3 = (0.0 + (0.25 - 1 + LN4) + (math.exp(0.1) - 1.1) + (0.125 - 1 + LN8)) / 4
    assert metrics["mismatch/k3_kl"] == pytest.approx(k3)
    assert metrics["mismatch/logp_abs_diff_mean"] == pytest.approx((LN4 + 0.1 + LN8) / 4)
    assert metrics["mismatch/logp_abs_diff_max"] == pytest.approx(LN8)
    # |d| > ln2: ln4 and ln8 -> 2/4; |d| > ln5 = 1.609: only ln8 = 2.079 -> 1/4
    assert metrics["mismatch/extreme_frac_ln2"] == pytest.approx(0.5)
    assert metrics["mismatch/extreme_frac_ln5"] == pytest.approx(0.25)
    # per-sequence exp(mean d): seq 0 exp((ln4 - 0.1)/3), seq 1 exp(ln8) = 8
    assert metrics["mismatch/ppl_ratio_mean"] == pytest.approx((math.exp((LN4 - 0.1) / 3) + 8.0) / 2)
    assert metrics["mismatch/num_tokens"] == 4.0


def test_direction_estimates_kl_a_to_b():
    # a and b are two categorical distributions over 3 tokens; draw the whole support with weights
    # pi_a by repeating tokens, so sample means equal expectations under pi_a: k1 and k3 both equal
    # KL(pi_a || pi_b) = sum_x pi_a(x) log(pi_a(x) / pi_b(x)).
    pi_a = [0.5, 0.25, 0.25]
    pi_b = [0.125, 0.375, 0.5]
    counts = [2, 1, 1]  # proportional to pi_a
    la = torch.tensor([[math.log(p) for p, c in zip(pi_a, counts) for _ in range(c)]], dtype=torch.float64)
    lb = torch.tensor([[math.log(p) for p, c in zip(pi_b, counts) for _ in range(c)]], dtype=torch.float64)
    kl_ab = sum(pa * math.log(pa / pb) for pa, pb in zip(pi_a, pi_b))
    metrics = mismatch_metrics(la, lb, torch.ones_like(la, dtype=torch.bool))
    assert metrics["mismatch/k1_kl"] == pytest.approx(kl_ab)
    assert metrics["mismatch/k3_kl"] == pytest.approx(kl_ab)
    kl_ba = sum(pb * math.log(pb / pa) for pa, pb in zip(pi_a, pi_b))
    assert kl_ab != pytest.approx(kl_ba)  # the direction matters for this pair


def test_identical_inputs_give_zeros():
    logp = -torch.rand(3, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    metrics = mismatch_metrics(logp, logp.clone(), mask)
    for key in MISMATCH_KEYS:
        if key == "mismatch/ppl_ratio_mean":
            assert metrics[key] == 1.0
        elif key == "mismatch/num_tokens":
            assert metrics[key] == 13.0
        else:
            assert metrics[key] == 0.0, key


@pytest.mark.parametrize("shape", [(0, 0), (2, 3)])
def test_empty_gives_zeros(shape):
    logp = torch.full(shape, NAN)
    metrics = mismatch_metrics(logp, logp, torch.zeros(shape))
    assert all(v == 0.0 for v in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_and_grad_inputs(dtype):
    logp_a, logp_b, mask = _hand_batch(dtype)
    logp_b.requires_grad_(True)
    ref = mismatch_metrics(*_hand_batch())
    metrics = mismatch_metrics(logp_a, logp_b, mask)
    assert all(type(v) is float and math.isfinite(v) for v in metrics.values())
    assert metrics["mismatch/k1_kl"] == pytest.approx(ref["mismatch/k1_kl"], abs=2e-2)
    with torch.no_grad():
        assert mismatch_metrics(logp_a, logp_b, mask) == metrics


def test_k3_clamp_keeps_finite():
    # b assigns -inf to a token a sampled: the k3 exponent is clamped to +-20: log r = -20 would
    # not matter, here log r = +inf -> +20 (b much larger), k3 = e^20 - 1 - 20
    la = torch.tensor([[-float("inf")]])
    lb = torch.tensor([[0.0]])
    metrics = mismatch_metrics(la, lb, torch.ones(1, 1))
    assert metrics["mismatch/k3_kl"] == pytest.approx(math.exp(20.0) - 21.0)
    assert metrics["mismatch/ppl_ratio_mean"] == pytest.approx(math.exp(-20.0))


def test_errors():
    with pytest.raises(ValueError, match="logp_b_BT"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(3, 2), torch.ones(2, 3))

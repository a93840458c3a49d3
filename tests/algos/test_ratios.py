"""Tests of ratio_stats: hand-computed statistics, masking, clamping, empty input."""

import math

import pytest
import torch

from moe_gspo.algos import ratio_stats
from moe_gspo.algos.ratios import RATIO_KEYS

LN2 = math.log(2.0)
NAN = float("nan")
INF = float("inf")


def _hand_batch():
    """Log ratios: seq 0 [ln2, ln2, pad], seq 1 [0, 0, -ln4], seq 2 all padding (garbage)."""
    old = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -0.7, -0.1], [INF, NAN, -INF]], dtype=torch.float64)
    lr = torch.tensor([[LN2, LN2, 0.0], [0.0, 0.0, -2 * LN2], [0.0, 0.0, 0.0]], dtype=torch.float64)
    logp = old + lr
    logp[0, 2] = -INF
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    return logp, old, mask


def test_hand_values():
    logp, old, mask = _hand_batch()
    stats = ratio_stats(logp, old, mask)
    assert tuple(stats) == RATIO_KEYS
    # token ratios w = [2, 2, 1, 1, 1/4]: mean 6.25/5 = 1.25; E[w^2] = (4+4+1+1+1/16)/5 = 2.0125;
    # population var = 2.0125 - 1.25^2 = 0.45; chi2_token = 2.0125 - 1 = 1.0125
    assert stats["ratio/token_mean"].item() == pytest.approx(1.25)
    assert stats["ratio/token_var"].item() == pytest.approx(0.45)
    assert stats["ratio/chi2_token"].item() == pytest.approx(1.0125)
    # s_0 = exp(2 ln2 / 2) = 2; s_1 = exp(-ln4 / 3) = 4^(-1/3); seq 2 skipped
    s1 = 4.0 ** (-1.0 / 3.0)
    assert stats["ratio/seq_mean"].item() == pytest.approx((2.0 + s1) / 2)
    assert stats["ratio/seq_var"].item() == pytest.approx(((2.0 - s1) / 2) ** 2)
    # log products [2 ln2, -2 ln2]: mean 0, population var (2 ln2)^2; products [4, 1/4]:
    # chi2_seq = (16 + 1/16)/2 - 1 = 7.03125
    assert stats["ratio/seq_prod_logvar"].item() == pytest.approx((2 * LN2) ** 2)
    assert stats["ratio/chi2_seq"].item() == pytest.approx(7.03125)
    assert stats["ratio/num_tokens"].item() == 5
    assert stats["ratio/num_seqs"].item() == 2
    for value in stats.values():
        assert value.dim() == 0 and value.dtype == torch.float64 and not value.requires_grad


def test_bool_mask_and_float32_give_same_result():
    logp, old, mask = _hand_batch()
    a = ratio_stats(logp, old, mask)
    b = ratio_stats(logp.float(), old.float(), mask.bool())
    for key in RATIO_KEYS:
        assert a[key].item() == pytest.approx(b[key].item(), rel=1e-5)


def test_identical_policies():
    logp = torch.randn(3, 4)
    stats = ratio_stats(logp, logp.clone(), torch.ones(3, 4, dtype=torch.bool))
    assert stats["ratio/token_mean"].item() == 1.0 and stats["ratio/seq_mean"].item() == 1.0
    for key in ("ratio/token_var", "ratio/seq_var", "ratio/seq_prod_logvar", "ratio/chi2_token", "ratio/chi2_seq"):
        assert stats[key].item() == 0.0


def test_small_chi2_is_precise():
    # lr = +-1e-6 on two tokens: E[w^2] - 1 = (e^{2e-6} + e^{-2e-6})/2 - 1 = cosh(2e-6) - 1 ~ 2e-12
    logp = torch.tensor([[1e-6, -1e-6]], dtype=torch.float64)
    stats = ratio_stats(logp, torch.zeros_like(logp), torch.ones(1, 2))
    assert stats["ratio/chi2_token"].item() == pytest.approx(math.cosh(2e-6) - 1, rel=1e-6)


def test_clamping_keeps_values_finite():
    # per-token log ratio 100 is clamped to 5 (max_log_ratio); the sequence log product 5+5 = 10
    # is clamped to 5 for chi2_seq: chi2_seq = e^10 - 1, chi2_token = e^10 - 1
    logp = torch.tensor([[100.0, 100.0]])
    stats = ratio_stats(logp, torch.zeros_like(logp), torch.ones(1, 2), max_log_ratio=5.0)
    assert stats["ratio/token_mean"].item() == pytest.approx(math.exp(5.0))
    assert stats["ratio/chi2_token"].item() == pytest.approx(math.exp(10.0) - 1)
    assert stats["ratio/chi2_seq"].item() == pytest.approx(math.exp(10.0) - 1)
    assert stats["ratio/seq_prod_logvar"].item() == 0.0


@pytest.mark.parametrize("shape", [(0, 0), (2, 3), (0, 5)])
def test_empty_gives_zeros(shape):
    logp = torch.full(shape, NAN)
    stats = ratio_stats(logp, logp, torch.zeros(shape, dtype=torch.bool))
    for key in RATIO_KEYS:
        assert stats[key].item() == 0.0, key


def test_shape_errors():
    with pytest.raises(ValueError, match="old_logp_BT"):
        ratio_stats(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask_BT"):
        ratio_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(6))
    with pytest.raises(ValueError, match="floating-point"):
        ratio_stats(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="max_log_ratio"):
        ratio_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), max_log_ratio=0.0)


def test_token_ratio_var_is_ratio_stats_token_var_bit_for_bit():
    from moe_gspo.algos.ratios import ratio_stats, token_ratio_var

    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        logp, old = -torch.rand(6, 9, generator=g) * 3, -torch.rand(6, 9, generator=g) * 3
        mask = torch.rand(6, 9, generator=g) < 0.6
        assert torch.equal(token_ratio_var(logp, old, mask), ratio_stats(logp, old, mask)["ratio/token_var"])

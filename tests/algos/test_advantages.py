"""Tests of group_advantages: hand-computed values, population std, constant groups, reward scaling
(group / batch / none), errors."""

import math

import pytest
import torch

from moe_gspo.algos import group_advantages


def test_hand_values_population_std():
    # group 0: [0, 1, 2] mean 1, population std sqrt(((-1)^2 + 0 + 1^2) / 3) = sqrt(2/3)
    #          -> advantages [-1/sqrt(2/3), 0, 1/sqrt(2/3)] = [-1.2247, 0, 1.2247]
    #          (the unbiased std would be 1 and give [-1, 0, 1])
    # group 1: [1, 0, 0] mean 1/3, population std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2)/3
    #          -> [(2/3) / (sqrt(2)/3), -(1/3) / (sqrt(2)/3), same] = [sqrt(2), -1/sqrt(2), -1/sqrt(2)]
    rewards = torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, group_size=3, eps=0.0)
    s = math.sqrt(2.0 / 3.0)
    expected = torch.tensor([-1 / s, 0.0, 1 / s, math.sqrt(2.0), -1 / math.sqrt(2.0), -1 / math.sqrt(2.0)],
                            dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_eps_is_added_to_std():
    # [1, 0]: mean 0.5, population std 0.5 -> (0.5) / (0.5 + 0.5) = 0.5 with eps = 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0]), group_size=2, eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))


def test_constant_group_gets_exact_zero():
    # 0.1 is not representable: mean of three 0.1s need not equal 0.1 bit for bit, but the
    # advantage must be exactly 0, not a rounding residue divided by eps.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, group_size=3)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert adv[6] > 0 and adv[7] < 0


def test_group_size_one_gives_zero():
    adv = group_advantages(torch.tensor([3.0, -1.0, 7.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(3))


def test_groups_are_contiguous_and_standardised():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(4 * 5, generator=gen, dtype=torch.float64)
    adv = group_advantages(rewards, group_size=5, eps=0.0).reshape(4, 5)
    torch.testing.assert_close(adv.mean(-1), torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(adv.std(-1, correction=0), torch.ones(4, dtype=torch.float64))


def test_dtypes():
    adv = group_advantages(torch.tensor([1, 0, 0, 1]), group_size=2)
    assert adv.dtype == torch.get_default_dtype()
    assert group_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), 2).dtype == torch.bfloat16


def test_scale_rewards_batch_and_none_hand_values():
    # groups [0, 1] and [0, 0, ...]: rewards [0, 1, 2, 2]; group means [0.5, 2]
    # none: [-0.5, 0.5, 0, 0]; batch: population std of [0, 1, 2, 2] = sqrt(11/16) (mean 1.25:
    # deviations^2 1.5625 + 0.0625 + 0.5625 + 0.5625 = 2.75, / 4) -> [-0.5, 0.5, 0, 0] / sqrt(11/16)
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    none = group_advantages(rewards, 2, eps=0.0, scale_rewards="none")
    torch.testing.assert_close(none, torch.tensor([-0.5, 0.5, 0.0, 0.0], dtype=torch.float64))
    batch = group_advantages(rewards, 2, eps=0.0, scale_rewards="batch")
    torch.testing.assert_close(batch, torch.tensor([-0.5, 0.5, 0.0, 0.0], dtype=torch.float64) / math.sqrt(11 / 16))
    group = group_advantages(rewards, 2, eps=0.0, scale_rewards="group")
    torch.testing.assert_close(group, torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    # eps is added to the batch std
    torch.testing.assert_close(group_advantages(rewards, 2, eps=0.25, scale_rewards="batch"),
                               none / (math.sqrt(11 / 16) + 0.25))


def test_scale_rewards_all_equal_batch_gives_zero():
    assert torch.equal(group_advantages(torch.full((6,), 0.7), 3, scale_rewards="batch"), torch.zeros(6))


@pytest.mark.parametrize(
    "rewards, group_size, match",
    [
        (torch.zeros(5), 2, "multiple of group_size"),
        (torch.zeros(2, 2), 2, "1-D"),
        (torch.zeros(4), 0, "group_size"),
        (torch.zeros(4), 2.0, "group_size"),
        (torch.tensor([0.0, float("nan")]), 2, "nan"),
    ],
)
def test_errors(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 2, scale_rewards="std")


def test_bessel_corrected_std_by_hand():
    # group [0, 1, 1, 1]: mean 0.75, squared deviations 0.5625 + 3 * 0.0625 = 0.75;
    # population std sqrt(0.75 / 4) = 0.4330, Bessel-corrected sqrt(0.75 / 3) = 0.5
    r = torch.tensor([0.0, 1.0, 1.0, 1.0])
    pop = group_advantages(r, 4, eps=0.0)
    bessel = group_advantages(r, 4, eps=0.0, std_correction=1)
    assert torch.allclose(bessel, torch.tensor([-1.5, 0.5, 0.5, 0.5]))
    assert torch.allclose(pop, bessel * (0.5 / 0.1875 ** 0.5))  # = bessel * sqrt(4 / 3)
    assert torch.allclose(group_advantages(r, 4, eps=0.0, scale_rewards="batch", std_correction=1), bessel)
    with pytest.raises(ValueError, match="std_correction"):
        group_advantages(r, 4, std_correction=2)

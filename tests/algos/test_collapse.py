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

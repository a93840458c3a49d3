"""moe_gspo.routing.router_stats: MaxVio, router entropy and margin on hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_gspo.routing.router_stats import (
    flip_by_margin, flip_rate_by_margin_bin, max_vio, router_summary, token_router_stats,
)


def _entropy(z):
    p = np.exp(np.asarray(z, np.float64))
    p /= p.sum()
    return float(-(p * np.log(p)).sum())


def test_token_stats_margin_is_the_kth_minus_next_logit_and_entropy_of_the_full_softmax():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0],      # sorted 3 2 | 1 0: margin 2 - 1 = 1
                           [1.0, 1.0, 1.0, 1.0],      # a tie across the boundary: margin 0, entropy ln 4
                           [0.5, -2.0, 0.25, 0.5]])   # sorted .5 .5 | .25 -2: margin 0.25
    stats = token_router_stats(logits, top_k=2)
    assert stats.dtype == torch.float32 and stats.shape == (3, 2)
    np.testing.assert_allclose(stats[:, 0].numpy(), [1.0, 0.0, 0.25])
    np.testing.assert_allclose(stats[:, 1].numpy(), [_entropy([3, 1, 2, 0]), math.log(4), _entropy([.5, -2, .25, .5])],
                               rtol=1e-6)
    # K = 1: the largest minus the second largest
    np.testing.assert_allclose(token_router_stats(logits, top_k=1)[:, 0].numpy(), [1.0, 0.0, 0.0])
    # bf16 logits are read as they are (the margin of the values the router compared)
    half = token_router_stats(logits.to(torch.bfloat16), top_k=2)
    np.testing.assert_allclose(half[:, 0].numpy(), [1.0, 0.0, 0.25])


def test_token_stats_edge_cases():
    z = torch.randn(5, 4)
    assert torch.isinf(token_router_stats(z, top_k=4)[:, 0]).all()  # every expert chosen: no boundary
    with pytest.raises(ValueError, match="top_k"):
        token_router_stats(z, top_k=5)
    assert token_router_stats(torch.zeros(0, 4), top_k=2).shape == (0, 2)


@pytest.mark.parametrize("num_experts", [4, 8, 16, 64])
def test_token_stats_entropy_equals_the_last_axis_log_softmax(num_experts):
    """The short-axis CPU path (fewer than 16 experts: the transposed copy's first axis) gives the entropy
    of the plain last-axis log-softmax to float32 rounding; from 16 experts on it is the last-axis kernel
    itself, bit for bit. (The two reductions are different kernels: on an AMX machine they agreed bit for bit
    at E = 8, on an AVX2-only one they do not; issue 51.)"""
    gen = torch.Generator().manual_seed(num_experts)
    for scale in (0.1, 1.0, 4.0, 10.0):
        z = torch.randn(1024, num_experts, generator=gen) * scale
        z[::7, 0] = float("-inf")  # a masked expert
        logp = torch.log_softmax(z, dim=-1)
        plain = -(logp.exp() * logp).sum(-1)  # NaN on the masked rows, on both paths
        got = token_router_stats(z, top_k=2)[:, 1]
        exact = num_experts >= 16  # >= 16: the last-axis kernel itself, the same computation twice
        torch.testing.assert_close(got, plain, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6, equal_nan=True)
        assert got[1:7].isfinite().all() and got[::7].isnan().all()


# 3 tokens, 2 layers, top-2 of 4 experts
IDS = np.array([[[0, 1], [0, 1]],
                [[0, 1], [2, 3]],
                [[0, 2], [0, 3]]])


def test_max_vio_hand_computed():
    # layer 0 loads [3, 2, 1, 0]: mean 1.5, (3 - 1.5) / 1.5 = 1; layer 1 loads [2, 1, 1, 2]: (2 - 1.5) / 1.5
    np.testing.assert_allclose(max_vio(IDS, 4), [1.0, 1 / 3])
    # verl's example: every slot on one expert of 4 -> 3 (= E - 1); perfect balance -> 0
    np.testing.assert_allclose(max_vio(np.full((5, 1, 2), 2), 4), [3.0])
    np.testing.assert_allclose(max_vio(np.array([[[0, 1]], [[2, 3]]]), 4), [0.0])
    assert np.isnan(max_vio(np.zeros((0, 2, 2), np.int64), 4)).all()
    with pytest.raises(ValueError, match="outside"):
        max_vio(IDS, 3)


def test_router_summary_keys_and_values():
    margin = np.array([[0.005, 0.5], [0.02, 0.001], [0.3, 0.2]])
    entropy = np.array([[1.0, 0.5], [1.2, 0.7], [0.8, 0.3]])
    m = router_summary("learner", topk_NLK=IDS, num_experts=4, margin_NL=margin, entropy_NL=entropy,
                       margin_threshold=0.01)
    assert m["router/max_vio_learner"] == pytest.approx([1.0, 1 / 3])
    assert m["router/max_vio_learner_mean"] == pytest.approx(2 / 3)
    assert m["router/max_vio_learner_max"] == pytest.approx(1.0)
    assert m["router/margin_learner"] == pytest.approx([0.325 / 3, 0.701 / 3])
    assert m["router/margin_learner_mean"] == pytest.approx(1.026 / 6)
    assert m["router/margin_small_frac_learner"] == pytest.approx([1 / 3, 1 / 3])
    assert m["router/margin_small_frac_learner_mean"] == pytest.approx(1 / 3)
    assert m["router/entropy_learner"] == pytest.approx([1.0, 0.5])
    assert m["router/entropy_learner_mean"] == pytest.approx(0.75)
    # only what is given; ids alone (a vLLM rollout) give the MaxVio keys
    ids_only = router_summary("rollout", topk_NLK=IDS, num_experts=4, margin_threshold=0.01)
    assert set(ids_only) == {"router/max_vio_rollout", "router/max_vio_rollout_mean", "router/max_vio_rollout_max"}
    empty = router_summary("rollout", topk_NLK=np.zeros((0, 2, 2), np.int64), num_experts=4,
                           margin_NL=np.zeros((0, 2)), entropy_NL=np.zeros((0, 2)), margin_threshold=0.01)
    assert all(np.isnan(v).all() for v in empty.values())
    assert len(empty["router/margin_rollout"]) == 2


def test_flip_by_margin():
    margin = np.array([[0.001, 0.5], [0.005, 0.02], [0.3, 0.009]])
    diff = np.array([[True, False], [False, False], [True, True]])
    m = flip_by_margin(margin, diff, 0.01)
    assert m["router/flip_frac_small_margin"] == pytest.approx(2 / 3)   # margins .001, .005, .009
    assert m["router/flip_frac_large_margin"] == pytest.approx(1 / 3)   # margins .5, .02, .3
    m = flip_by_margin(margin, diff, 0.0)
    assert math.isnan(m["router/flip_frac_small_margin"]) and m["router/flip_frac_large_margin"] == pytest.approx(0.5)


def test_flip_rate_by_margin_bin():
    edges = [0.0, 0.01, 0.1, 1.0]
    margin = np.array([0.0, 0.005, 0.05, 0.09, 1.0, 2.0])
    flip = np.array([True, False, True, True, False, True])
    rate, count = flip_rate_by_margin_bin(margin, flip, edges)
    assert count.tolist() == [2, 2, 1]  # 1.0 lands in the last bin, 2.0 outside
    np.testing.assert_allclose(rate, [0.5, 1.0, 0.0])
    rate, count = flip_rate_by_margin_bin(np.array([0.5]), np.array([True]), edges)
    assert count.tolist() == [0, 0, 1] and np.isnan(rate[:2]).all()
    with pytest.raises(ValueError, match="increasing"):
        flip_rate_by_margin_bin(margin, flip, [0.0, 0.0, 1.0])

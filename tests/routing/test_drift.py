"""Tests for moe_gspo.routing.drift: routing-drift metrics with hand-computed expectations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_gspo.routing.drift import (
    common_rows,
    expert_load,
    per_token_flip_mask,
    per_token_layer_diff,
    routing_drift,
    topk_prob_l1,
    trace_drift,
)
from moe_gspo.routing.trace import RoutingTrace

# 3 tokens, 2 layers, top-2 of 4 experts.
#   token 0: same sets in both layers (order swapped)      -> intersections 2, 2
#   token 1: layer 0 {0,1} vs {0,2}; layer 1 equal          -> intersections 1, 2
#   token 2: both layers disjoint                           -> intersections 0, 0
A = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 2], [0, 3]]])
B = np.array([[[1, 0], [3, 2]], [[0, 2], [2, 3]], [[3, 0], [1, 2]]])


def test_hand_computed_metrics():
    m = routing_drift(A, B, num_experts=4)
    assert m["num_tokens"] == 3
    np.testing.assert_allclose(m["routing/layer_disagree"], [2 / 3, 1 / 3])
    assert m["routing/any_layer_flip"] == pytest.approx(2 / 3)
    assert m["routing/mean_layers_differing"] == pytest.approx(1.0)
    assert m["routing/topk_overlap"] == pytest.approx(7 / 12)
    assert m["routing/expert_change_frac"] == pytest.approx(5 / 12)
    # jaccard per (token, layer): 1, 1, 1/3, 1, 0, 0
    assert m["routing/jaccard"] == pytest.approx((3 + 1 / 3) / 6)
    np.testing.assert_allclose(m["routing/expert_load_a"], [[1 / 3, 1 / 2, 1 / 6, 0], [1 / 6, 0, 1 / 3, 1 / 2]])
    np.testing.assert_allclose(m["routing/expert_load_b"], [[1 / 2, 1 / 6, 1 / 6, 1 / 6], [0, 1 / 6, 1 / 2, 1 / 3]])
    np.testing.assert_allclose(m["routing/expert_load_diff"],
                               np.array(m["routing/expert_load_b"]) - np.array(m["routing/expert_load_a"]))
    np.testing.assert_allclose(np.sum(m["routing/expert_load_a"], axis=1), [1, 1])
    assert "routing/prob_kl" not in m and "routing/topk_prob_l1" not in m


def test_token_mask_and_per_token_masks():
    m = routing_drift(A, B, num_experts=4, token_mask_N=np.array([True, False, True]))
    assert m["num_tokens"] == 2
    np.testing.assert_allclose(m["routing/layer_disagree"], [0.5, 0.5])
    assert m["routing/any_layer_flip"] == pytest.approx(0.5)
    assert m["routing/mean_layers_differing"] == pytest.approx(1.0)
    assert per_token_layer_diff(A, B).tolist() == [[False, False], [True, False], [True, True]]
    assert per_token_flip_mask(A, B).tolist() == [False, True, True]


def test_identical_and_reordered_routing_has_no_drift():
    rng = np.random.default_rng(0)
    a = np.argsort(rng.random((50, 3, 16)), axis=-1)[..., :4]
    b = np.flip(a, axis=-1)          # same sets, other order
    m = routing_drift(a, b, num_experts=16)
    assert m["routing/layer_disagree"] == [0.0, 0.0, 0.0]
    assert m["routing/any_layer_flip"] == 0.0 and m["routing/mean_layers_differing"] == 0.0
    assert m["routing/topk_overlap"] == 1.0 and m["routing/jaccard"] == 1.0
    assert m["routing/expert_change_frac"] == 0.0
    assert np.abs(m["routing/expert_load_diff"]).max() == 0.0


def test_matches_python_sets_on_random_data():
    rng = np.random.default_rng(1)
    n, num_layers, k, e = 200, 3, 3, 6     # few experts so sets often partially overlap
    a = np.argsort(rng.random((n, num_layers, e)), axis=-1)[..., :k]
    b = np.argsort(rng.random((n, num_layers, e)), axis=-1)[..., :k]
    inter = np.array([[len(set(a[t, l]) & set(b[t, l])) for l in range(num_layers)] for t in range(n)])
    union = np.array([[len(set(a[t, l]) | set(b[t, l])) for l in range(num_layers)] for t in range(n)])
    m = routing_drift(a, b, num_experts=e)
    assert m["routing/topk_overlap"] == pytest.approx(inter.mean() / k)
    assert m["routing/jaccard"] == pytest.approx((inter / union).mean())
    np.testing.assert_allclose(m["routing/layer_disagree"], (inter < k).mean(0))
    assert m["routing/any_layer_flip"] == pytest.approx((inter < k).any(1).mean())
    assert all(0 < x < 1 for x in m["routing/layer_disagree"])     # the data is not degenerate


def test_empty_inputs_give_zeros():
    z = np.zeros((0, 2, 2), dtype=np.uint8)
    m = routing_drift(z, z, num_experts=4, probs_a_NLE=np.zeros((0, 2, 4)), probs_b_NLE=np.zeros((0, 2, 4)),
                      topk_probs_a_NLK=np.zeros((0, 2, 2)), topk_probs_b_NLK=np.zeros((0, 2, 2)))
    assert m["num_tokens"] == 0 and m["routing/layer_disagree"] == [0.0, 0.0]
    for key in ("routing/any_layer_flip", "routing/mean_layers_differing", "routing/topk_overlap",
                "routing/jaccard", "routing/expert_change_frac", "routing/prob_kl", "routing/topk_prob_l1"):
        assert m[key] == 0.0, key
    assert m["routing/expert_load_a"] == [[0.0] * 4] * 2
    masked = routing_drift(A, B, num_experts=4, token_mask_N=np.zeros(3, bool))
    assert masked["num_tokens"] == 0 and masked["routing/any_layer_flip"] == 0.0


def test_prob_kl_full_distributions():
    pa = np.array([[[0.5, 0.5]]])
    pb = np.array([[[0.25, 0.75]]])
    ids = np.array([[[0]]])
    m = routing_drift(ids, ids, num_experts=2, probs_a_NLE=pa, probs_b_NLE=pb)
    assert m["routing/prob_kl"] == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    same = routing_drift(ids, ids, num_experts=2, probs_a_NLE=pa, probs_b_NLE=pa)
    assert same["routing/prob_kl"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="probs_b_NLE"):
        routing_drift(ids, ids, num_experts=2, probs_a_NLE=pa)


def test_topk_prob_l1_hand_computed():
    a = np.array([[[0, 1]], [[2, 3]], [[0, 1]]])
    b = np.array([[[1, 2]], [[3, 2]], [[1, 0]]])
    wa = np.array([[[0.7, 0.3]], [[0.5, 0.5]], [[0.9, 0.1]]])
    wb = np.array([[[0.6, 0.4]], [[0.5, 0.5]], [[0.2, 0.8]]])
    # row 0: e0 .7 vs 0, e1 .3 vs .6, e2 0 vs .4 -> 1.4; row 1: same sets and weights -> 0;
    # row 2: e0 .9 vs .8, e1 .1 vs .2 -> 0.2
    assert topk_prob_l1(a, wa, b, wb) == pytest.approx((1.4 + 0.0 + 0.2) / 3)
    m = routing_drift(a, b, num_experts=4, topk_probs_a_NLK=wa, topk_probs_b_NLK=wb)
    assert m["routing/topk_prob_l1"] == pytest.approx(1.6 / 3)


def test_accepts_torch_and_validates():
    m = routing_drift(torch.from_numpy(A), torch.from_numpy(B), num_experts=4)
    assert m["routing/any_layer_flip"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="same shape"):
        routing_drift(A, B[:2], num_experts=4)
    with pytest.raises(ValueError, match="num_experts=3"):
        routing_drift(A, B, num_experts=3)
    with pytest.raises(ValueError, match="token_mask_N"):
        routing_drift(A, B, num_experts=4, token_mask_N=np.ones(2, bool))


def test_expert_load_rows_sum_to_one():
    rng = np.random.default_rng(2)
    ids = np.argsort(rng.random((30, 2, 10)), axis=-1)[..., :3]
    load = expert_load(ids, 10)
    np.testing.assert_allclose(load.sum(1), [1.0, 1.0])
    assert load[0, 4] == pytest.approx((ids[:, 0] == 4).sum() / 90)


# --------------------------------------------------------------------------------------------------
def _pair_of_traces():
    # seq 0: P=2, R=2; seq 1: P=1, R=2. Rollout routes P+R-1 rows, learner P+R rows.
    learner = [np.array([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]), np.array([[[0, 1]], [[2, 3]], [[4, 5]]])]
    rollout = [learner[0][:3].copy(), learner[1][:2].copy()]
    rollout[0][0, 0] = [0, 2]        # seq 0, position 0 (prompt) differs
    rollout[1][1, 0] = [3, 7]        # seq 1, position 1 (response) differs
    learner[0][3, 0] = [1, 0]        # learner-only row: never compared
    kw = dict(prompt_lens=[2, 1], response_lens=[2, 2], num_experts=8, layer_ids=[1])
    return (RoutingTrace.from_samples(rollout, probs=None, **kw),
            RoutingTrace.from_samples(learner, probs=None, **kw))


def test_common_rows_exact_indices():
    ro, le = _pair_of_traces()
    rows_a, rows_b, seq = common_rows(ro, le, tokens="all")
    assert rows_a.tolist() == [0, 1, 2, 3, 4] and rows_b.tolist() == [0, 1, 2, 4, 5]
    assert seq.tolist() == [0, 0, 0, 1, 1]
    rows_a, rows_b, _ = common_rows(ro, le, tokens="prompt")
    assert rows_a.tolist() == [0, 1, 3] and rows_b.tolist() == [0, 1, 4]
    rows_a, rows_b, _ = common_rows(ro, le, tokens="response")
    assert rows_a.tolist() == [2, 4] and rows_b.tolist() == [2, 5]


def test_trace_drift_token_selection():
    ro, le = _pair_of_traces()
    assert trace_drift(ro, le)["routing/any_layer_flip"] == pytest.approx(2 / 5)
    assert trace_drift(ro, le)["num_tokens"] == 5
    assert trace_drift(ro, le, tokens="prompt")["routing/any_layer_flip"] == pytest.approx(1 / 3)
    assert trace_drift(ro, le, tokens="response")["routing/any_layer_flip"] == pytest.approx(1 / 2)
    same = trace_drift(le, le)
    assert same["routing/any_layer_flip"] == 0.0 and same["num_tokens"] == 7


def test_trace_drift_mismatch_errors():
    ro, le = _pair_of_traces()
    one = RoutingTrace.from_samples([np.zeros((1, 1, 2), int)], [1], [1], 8, [1])
    with pytest.raises(ValueError, match="number of sequences"):
        trace_drift(ro, one)
    more_experts = RoutingTrace(topk_ids=le.topk_ids, seq_offsets=le.seq_offsets, prompt_lens=le.prompt_lens,
                                response_lens=le.response_lens, num_experts=16, layer_ids=le.layer_ids)
    with pytest.raises(ValueError, match="num_experts"):
        trace_drift(ro, more_experts)
    other_layer = RoutingTrace(topk_ids=le.topk_ids, seq_offsets=le.seq_offsets, prompt_lens=le.prompt_lens,
                               response_lens=le.response_lens, num_experts=8, layer_ids=[2])
    with pytest.raises(ValueError, match="layer_ids"):
        trace_drift(ro, other_layer)
    k3 = RoutingTrace(topk_ids=np.zeros((7, 1, 3), np.uint8), seq_offsets=le.seq_offsets,
                      prompt_lens=le.prompt_lens, response_lens=le.response_lens, num_experts=8, layer_ids=[1])
    with pytest.raises(ValueError, match="top-k K"):
        trace_drift(ro, k3)
    other_prompt = RoutingTrace(topk_ids=le.topk_ids, seq_offsets=le.seq_offsets, prompt_lens=[1, 1],
                                response_lens=[3, 2], num_experts=8, layer_ids=[1])
    with pytest.raises(ValueError, match=r"prompt_lens \(sequence 0"):
        trace_drift(ro, other_prompt)
    with pytest.raises(ValueError, match="tokens must be"):
        trace_drift(ro, le, tokens="completion")

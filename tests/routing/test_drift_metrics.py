"""moe_gspo.routing.drift_metrics (and the rows of moe_gspo.routing.rows) on a constructed batch: which routing rows `routing/*`, `routing_prompt/*`
and `update/*` use, the variance attribution, and NaN for empty subsets."""

import math

import numpy as np
import pytest
import torch

from moe_gspo.routing.drift_metrics import (flipped_response_mask, policy_update_drift, replayed_mismatch,
                                            rollout_vs_learner)
from moe_gspo.routing.rows import prompt_rows, response_rows, response_spans

# Three sequences, one MoE layer, top-1 of 4 experts. Groups: seqs 0 and 1 share a prompt (P = 3),
# seq 2 has its own (P = 2). Responses R = 2, 1, 2. Padded length S = 5.
P, R, GROUPS = [3, 3, 2], [2, 1, 2], [0, 0, 1]
S = 5


def _mask():
    m = torch.zeros(3, S, dtype=torch.bool)
    for b in range(3):
        m[b, P[b]:P[b] + R[b]] = True
    return m


def _routes(num_rows, flips=()):
    """Per sequence [T_b, 1, 1] expert ids: 0 everywhere, 1 at the (seq, row) pairs in `flips`."""
    out = [np.zeros((n, 1, 1), np.uint8) for n in num_rows]
    for b, t in flips:
        out[b][t] = 1
    return out


ROLLOUT_ROWS = [p + r - 1 for p, r in zip(P, R)]  # 4, 3, 3: the engine never runs the last token
LEARNER_ROWS = [p + r for p, r in zip(P, R)]      # 5, 4, 4


def _metrics(flips, learner_logp=None, group_ids=GROUPS):
    mask = _mask()
    rollout_logp = torch.where(mask, -1.0, 0.0)
    return rollout_vs_learner(rollout_logp_BS=rollout_logp,
                              learner_logp_BS=rollout_logp if learner_logp is None else learner_logp,
                              response_mask_BS=mask, rollout_routes=_routes(ROLLOUT_ROWS),
                              learner_routes=_routes(LEARNER_ROWS, flips), num_experts=4, group_ids=group_ids)


def test_row_spans():
    p, r = response_spans(_mask())
    assert p.tolist() == P and r.tolist() == R
    lo, hi = response_rows(p, r)
    assert lo.tolist() == [2, 2, 1] and hi.tolist() == [4, 3, 3]  # rows P-1 .. P+R-2
    lo, hi = prompt_rows(p, GROUPS)
    assert lo.tolist() == [0, 0, 0] and hi.tolist() == [2, 0, 1]  # seq 1 repeats seq 0's prompt


def test_prompt_and_response_rows_are_split():
    # learner flips: seq 0 row 1 (prompt), seq 1 row 0 (prompt of a repeated group member),
    # seq 0 row 3 (produces seq 0's last response log-prob), seq 2 row 0 (prompt)
    m = _metrics([(0, 1), (1, 0), (0, 3), (2, 0)])
    assert m["routing/num_tokens"] == 5                      # = response tokens
    assert m["routing/any_layer_flip"] == pytest.approx(1 / 5)
    assert m["routing/layer_disagree"] == pytest.approx([1 / 5])
    assert m["mismatch_ratio/flipped_token_frac"] == pytest.approx(1 / 5)  # same token set
    assert m["routing_prompt/num_tokens"] == 3               # rows 0-1 of group 0, row 0 of group 1
    assert m["routing_prompt/any_layer_flip"] == pytest.approx(2 / 3)
    # without groups every sequence's prompt counts: rows 0-1 of seqs 0 and 1, row 0 of seq 2
    m = _metrics([(0, 1), (1, 0), (0, 3), (2, 0)], group_ids=None)
    assert m["routing_prompt/num_tokens"] == 5 and m["routing_prompt/any_layer_flip"] == pytest.approx(3 / 5)
    # (pooling every row, as before, would have given 4 flips in 10 rows)


def test_one_token_prompts_give_nan_prompt_metrics():
    mask = torch.zeros(1, 3, dtype=torch.bool)
    mask[0, 1:3] = True  # P = 1, R = 2: rows 0-1 produce the response log-probs; no prompt row is left
    logp = torch.where(mask, -1.0, 0.0)
    m = rollout_vs_learner(rollout_logp_BS=logp, learner_logp_BS=logp, response_mask_BS=mask,
                           rollout_routes=_routes([2]), learner_routes=_routes([3]), num_experts=4)
    assert m["routing_prompt/num_tokens"] == 0 and math.isnan(m["routing_prompt/any_layer_flip"])
    assert m["routing/num_tokens"] == 2 and m["routing/any_layer_flip"] == 0.0


def test_variance_attribution_shares():
    # token ratios w = learner / rollout: [1, 2 | 1 | 1, 1]; only seq 0's second response token
    # (position 4, produced by row 3) has a routing flip. mean w = 1.2; squared deviations
    # [.04, .64, .04, .04, .04] sum to 0.8: the flipped token holds 0.8 of it, although the
    # variance *within* each subset is 0 for both.
    mask = _mask()
    learner = torch.where(mask, -1.0, 0.0)
    learner[0, 4] += math.log(2.0)
    m = _metrics([(0, 3)], learner_logp=learner)
    assert m["mismatch_ratio/token_var"] == pytest.approx(0.16)
    assert m["mismatch_ratio/token_var_share_flipped"] == pytest.approx(0.8)
    assert m["mismatch_ratio/token_var_share_agreed"] == pytest.approx(0.2)
    assert m["mismatch_ratio/token_var_flipped"] == 0.0 and m["mismatch_ratio/token_var_agreed"] == 0.0
    # no flipped token: the flipped subset is empty -> NaN, never 0
    m = _metrics([], learner_logp=learner)
    assert math.isnan(m["mismatch_ratio/token_var_share_flipped"])
    assert math.isnan(m["mismatch_ratio/token_var_flipped"])
    assert m["mismatch_ratio/token_var_share_agreed"] == pytest.approx(1.0)


def test_update_drift_uses_response_rows():
    old = _routes(LEARNER_ROWS)
    mask = _mask()
    # row 4 of seq 0 (its last token) produces no log-prob; rows 0-1 are prompt rows: not counted
    m = policy_update_drift(old, _routes(LEARNER_ROWS, [(0, 4), (0, 0), (1, 1)]), mask, num_experts=4)
    assert m["update/any_layer_change"] == 0.0
    m = policy_update_drift(old, _routes(LEARNER_ROWS, [(0, 2), (2, 1)]), mask, num_experts=4, prefix="x/")
    assert m["x/any_layer_change"] == pytest.approx(2 / 5)
    assert m["x/expert_change_frac"] == pytest.approx(2 / 5)  # K = 1


def test_replayed_mismatch_keys():
    mask = _mask()
    a = torch.where(mask, -1.0, 0.0)
    m = replayed_mismatch(rollout_logp_BS=a, replayed_logp_BS=a - 0.1 * mask, response_mask_BS=mask)
    assert set(m) == {k.replace("mismatch/", "mismatch_replayed/") for k in _metrics([]) if k.startswith("mismatch/")}
    assert m["mismatch_replayed/k1_kl"] == pytest.approx(0.1)


def test_flipped_response_mask_marks_the_token_each_flipped_row_produces():
    """Row t of a sequence produces token t + 1: a flip at row t marks [b, t + 1], only on response
    tokens, and rows that only one side has (or past the padded length) count as no flip."""
    rollout = _routes(ROLLOUT_ROWS)
    # seq 0: rows 1 (prompt token 2 predicted: not a response token) and 3 (-> token 4, response);
    # seq 1: row 2 (-> token 3, its only response token); seq 2: row 3, which the rollout side lacks
    learner = _routes(LEARNER_ROWS, flips=[(0, 1), (0, 3), (1, 2), (2, 3)])
    got = flipped_response_mask(rollout, learner, _mask())
    want = torch.zeros(3, S, dtype=torch.bool)
    want[0, 4] = want[1, 3] = True
    assert torch.equal(got, want)
    # a sequence without rows on one side, and a multi-layer top-2 routing differing in one layer only
    empty = [np.zeros((0, 1, 1), np.uint8)] + rollout[1:]
    assert torch.equal(flipped_response_mask(empty, learner, _mask())[0], torch.zeros(S, dtype=torch.bool))
    a = [np.tile(np.array([[[0, 1], [2, 3]]], np.uint8), (4, 1, 1))]
    b = [a[0].copy()]
    b[0][2, 1] = [3, 1]  # layer 1 of row 2 differs as a set; row 1's slots swap order only (same set)
    b[0][1, 0] = [1, 0]
    m = torch.zeros(1, 5, dtype=torch.bool)
    m[0, 1:] = True
    assert flipped_response_mask(a, b, m).tolist() == [[False, False, False, True, False]]

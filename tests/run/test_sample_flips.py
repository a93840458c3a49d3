"""samples.jsonl's `routing_flips` (moe_gspo.run.samples.token_flips): per response token, the MoE layers whose
top-k set differs on the row that produced it, None past either side's rows; checked against the row-by-row rule."""

from __future__ import annotations

import numpy as np

from moe_gspo.run.samples import token_flips


def _by_row(rollout_TLK, learner_TLK, prompt_len, response_len):
    out = []
    for j in range(response_len):
        row = prompt_len - 1 + j
        if row >= min(len(rollout_TLK), len(learner_TLK)):
            out.append(None)
            continue
        a, b = np.sort(rollout_TLK[row], axis=-1), np.sort(learner_TLK[row], axis=-1)
        out.append(int((a != b).any(axis=-1).sum()))
    return out


def test_token_flips_by_hand_and_by_row():
    r = np.array([[[0, 1], [2, 3]], [[1, 0], [2, 4]], [[5, 6], [7, 0]]], np.int16)  # [T=3, L=2, K=2]
    le = np.array([[[0, 1], [2, 3]], [[0, 1], [3, 2]], [[5, 7], [7, 1]], [[0, 1], [2, 3]]], np.uint8)
    # prompt of 2 tokens: response token j comes from row 1 + j; row 1: same sets (order ignored) in layer 0,
    # {2,4} vs {2,3} in layer 1; row 2: both layers differ; row 3: the rollout has no such row
    assert token_flips(r, le, 2, 3) == [1, 2, None]
    rng = np.random.default_rng(0)
    for _ in range(50):
        T, P, R = int(rng.integers(0, 12)), int(rng.integers(1, 8)), int(rng.integers(0, 8))
        a = rng.integers(0, 4, size=(T, 3, 2))
        b = rng.integers(0, 4, size=(int(rng.integers(0, 14)), 3, 2)).astype(np.uint8)
        assert token_flips(a, b, P, R) == _by_row(a, b, P, R)

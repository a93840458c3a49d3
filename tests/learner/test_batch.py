"""PackedBatch packing, selection, sharding and the per-rank micro-batch plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_gspo.learner.batch import PackedBatch, pad_token_frac, plan_shards
from moe_gspo.rollout.base import RolloutSample


def _sample(prompt, response, logp, routes=None):
    return RolloutSample(prompt_index=0, prompt_ids=np.array(prompt), response_ids=np.array(response),
                         response_logprobs=np.array(logp, dtype=np.float32), finish_reason="stop",
                         routes_TLK=routes)


def _two():
    return [_sample([5, 6], [7, 8, 9], [-0.5, -1.0, -1.5]), _sample([5, 6, 7, 8], [1], [-2.0])]


def test_from_samples_layout():
    b = PackedBatch.from_samples(_two(), [1.0, -1.0], pad_id=0)
    assert b.input_ids_BS.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 1]]
    assert b.response_mask_BS.tolist() == [[False, False, True, True, True], [False, False, False, False, True]]
    assert b.seq_lens_B.tolist() == [5, 5] and b.prompt_lens_B.tolist() == [2, 4]
    assert b.rollout_logp_BS.tolist() == [[0, 0, -0.5, -1.0, -1.5], [0, 0, 0, 0, -2.0]]
    assert b.advantages_B.dtype == torch.float32 and b.advantages_B.tolist() == [1.0, -1.0]
    assert b.rollout_routes is None


def test_from_samples_pads_and_keeps_routes():
    r0, r1 = np.zeros((4, 2, 2), np.uint8), np.ones((2, 2, 2), np.uint8)
    samples = [_sample([5, 6], [7, 8, 9], [-1, -1, -1], r0), _sample([5], [1], [-2.0], r1)]
    b = PackedBatch.from_samples(samples, np.array([0.5, 0.25]), pad_id=3)
    assert b.input_ids_BS[1].tolist() == [5, 1, 3, 3, 3]
    assert b.seq_lens_B.tolist() == [5, 2]
    assert b.rollout_routes[0] is r0 and b.rollout_routes[1] is r1


def test_from_samples_errors():
    with pytest.raises(ValueError, match="advantages"):
        PackedBatch.from_samples(_two(), [1.0], pad_id=0)


def test_a_sample_without_routes_among_others_gets_no_rows():
    """A sample without routes next to samples with routes (a DP merge or prefix-only request dropped them):
    an empty [0, L, K] array, i.e. no row known (R3 replays the learner's own routing for all its rows)."""
    r0 = np.zeros((1, 3, 2), np.uint16)
    mixed = [_sample([5], [6], [-1], r0), _sample([5], [6], [-1])]
    b = PackedBatch.from_samples(mixed, [0.0, 0.0], pad_id=0)
    assert b.rollout_routes[0] is r0
    assert b.rollout_routes[1].shape == (0, 3, 2) and b.rollout_routes[1].dtype == np.uint16
    assert b.pad_rows(3).rollout_routes[2].shape == (0, 3, 2)


def test_select_split_shard():
    samples = [_sample([5] * (i + 1), [6], [-float(i)]) for i in range(5)]
    b = PackedBatch.from_samples(samples, np.arange(5), pad_id=0)
    s = b.select([3, 1])
    assert s.seq_lens_B.tolist() == [5, 3] and s.advantages_B.tolist() == [3.0, 1.0]
    assert s.seq_len_padded == b.seq_len_padded
    chunks = b.split(2)
    assert [c.advantages_B.tolist() for c in chunks] == [[0, 1, 2], [3, 4]]
    assert [b.shard(r, 2).advantages_B.tolist() for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert b.shard(1, 8).num_seqs == 1 and b.shard(7, 8).num_seqs == 0
    with pytest.raises(ValueError, match="num_chunks"):
        b.split(6)
    with pytest.raises(ValueError, match="rank"):
        b.shard(2, 2)


def test_pad_rows_and_trim():
    b = PackedBatch.from_samples(_two(), [1.0, -1.0], pad_id=0)
    p = b.pad_rows(4)
    assert p.num_seqs == 4 and p.input_ids_BS[2:].eq(0).all()
    assert not p.response_mask_BS[2:].any() and p.seq_lens_B.tolist() == [5, 5, 0, 0]
    assert b.trim(7).input_ids_BS.shape == (2, 7)
    with pytest.raises(ValueError, match="cut real tokens"):
        b.trim(4)


def test_plan_shards_equal_shapes_on_every_rank():
    lens = [3, 9, 4, 2, 7]  # B=5 over 2 ranks: shards [0,1,2] and [3,4] (+1 dummy row)
    plans = [plan_shards(lens, dp_rank=r, dp_size=2, micro_batch_size=2) for r in range(2)]
    assert [p.indices.tolist() for p in plans] == [[0, 1, 2], [3, 4]]
    assert all(p.num_rows == 3 for p in plans)
    # micro-batch 0 holds rows {0,1} of rank 0 (lens 3, 9) and {3,4} of rank 1 (2, 7): max 9;
    # micro-batch 1 holds row 2 (len 4) and a dummy row: 4.
    for p in plans:
        assert [(m.start, m.stop, m.seq_len) for m in p.micro_batches] == [(0, 2, 9), (2, 3, 4)]
    whole = plan_shards(lens, dp_rank=0, dp_size=1)
    assert [(m.start, m.stop, m.seq_len) for m in whole.micro_batches] == [(0, 5, 9)]


# ---- same-support sampling supports (moe_gspo.algos.support) ------------------------------------------
def _with_support(sample, sizes, ids):
    sample.support_sizes_R = np.array(sizes, np.int32)
    sample.support_ids_N = np.array(ids, np.int32)
    return sample


def _two_with_supports():
    a, b = _two()  # responses [7, 8, 9] and [1]
    return [_with_support(a, [2, 1, 3], [7, 3, 8, 9, 2, 4]), _with_support(b, [2], [6, 1])]


def test_from_samples_places_supports_at_the_response_positions():
    b = PackedBatch.from_samples(_two_with_supports(), [1.0, -1.0], pad_id=0)
    assert b.support_sizes_BS.tolist() == [[0, 0, 2, 1, 3], [0, 0, 0, 0, 2]]
    assert [x.tolist() for x in b.support_ids] == [[7, 3, 8, 9, 2, 4], [6, 1]]
    b_N, t_N, ids_NK, valid_NK = b.support_index([1, 0])  # rows in that order: b_N indexes [1, 0]
    assert b_N.tolist() == [0, 1, 1, 1] and t_N.tolist() == [4, 2, 3, 4]
    assert [ids_NK[n][valid_NK[n]].tolist() for n in range(4)] == [[6, 1], [7, 3], [8], [9, 2, 4]]
    assert PackedBatch.from_samples(_two(), [0.0, 0.0], pad_id=0).support_index([0, 1]) is None


def test_supports_follow_select_trim_and_pad_rows():
    b = PackedBatch.from_samples(_two_with_supports(), [1.0, -1.0], pad_id=0)
    s = b.select([1])
    assert s.support_sizes_BS.tolist() == [[0, 0, 0, 0, 2]] and [x.tolist() for x in s.support_ids] == [[6, 1]]
    t = b.trim(7)
    assert t.support_sizes_BS.shape == (2, 7) and t.support_sizes_BS[:, 5:].sum() == 0
    p = b.pad_rows(4)
    assert p.support_sizes_BS.shape == (4, 5) and p.support_sizes_BS[2:].sum() == 0 and len(p.support_ids) == 4
    idx = p.support_index([0, 1, 2, 3])
    assert idx[0].tolist() == [0, 0, 0, 1]  # padding rows contribute no token


def test_from_samples_refuses_bad_supports():
    a, b = _two_with_supports()
    b.support_sizes_R = b.support_ids_N = None
    with pytest.raises(ValueError, match="some samples carry a sampling support"):
        PackedBatch.from_samples([a, b], [0.0, 0.0], pad_id=0)
    a, b = _two_with_supports()
    a.support_ids_N = np.array([7, 3, 5, 9, 2, 4], np.int32)  # token 8 is no longer in its support
    with pytest.raises(ValueError, match="sample 0: response token 1 .id 8. is not in its recorded support"):
        PackedBatch.from_samples([a, b], [0.0, 0.0], pad_id=0)


def test_pad_token_frac_counts_every_micro_batch_by_hand():
    """Issue 61: the share of computed positions that are padding. Lengths 3, 5, 8, 4 in one forward: 4 x 8 =
    32 positions for 20 tokens; in micro-batches of 2: 2 x 5 + 2 x 8 = 26; over 2 ranks, micro-batch 1: slot
    lengths max(3, 8) and max(5, 4), 2 x 8 + 2 x 5 = 26; 3 sequences over 2 ranks add a dummy row."""
    lens = [3, 5, 8, 4]
    assert pad_token_frac(lens) == pytest.approx(1 - 20 / 32)
    assert pad_token_frac(lens, micro_batch_size=2) == pytest.approx(1 - 20 / 26)
    assert pad_token_frac(lens, dp_size=2, micro_batch_size=1) == pytest.approx(1 - 20 / 26)
    assert pad_token_frac([3, 5, 8], dp_size=2) == pytest.approx(1 - 16 / 32)  # 2 ranks x 2 rows x 8
    assert pad_token_frac([7, 7]) == 0.0

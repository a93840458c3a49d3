"""Same-support log-probs (moe_gspo.algos.support): hand values of the renormalisation and of the sampler's
support, the compact per-token form and its checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_gspo.algos.support import (check_sample_support, flatten_supports, pad_supports, support_logprob,
                                    support_logprobs_of_rows, support_top_k, truncated_support)


def test_support_logprob_hand_values():
    # logits [2, 1, 0, -1]; support {0, 2}: log p_S(2) = 0 - log(e^2 + e^0), log p_S(0) = 2 - log(e^2 + 1)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    support_NK = logits[torch.tensor([[0, 2], [0, 2], [1, 1]])]
    valid_NK = torch.tensor([[True, True], [True, True], [True, False]])  # row 2: support {1} only
    target_N = logits[torch.tensor([2, 0, 1])]
    got = support_logprob(support_NK, valid_NK, target_N)
    want = [-math.log(math.e ** 2 + 1), 2 - math.log(math.e ** 2 + 1), 0.0]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    full = torch.log_softmax(logits, -1)[torch.tensor([2, 0, 1])]
    assert (got > full).all()  # the support left out mass: the renormalised value is larger


def test_support_logprob_over_the_full_vocabulary_is_log_softmax_and_has_its_gradient():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ids = torch.arange(7).expand(3, 7)
    tgt = torch.tensor([1, 4, 6])
    got = support_logprobs_of_rows(logits, tgt, ids, torch.tensor([7, 7, 7]))
    want = torch.log_softmax(logits, -1).gather(-1, tgt[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want)
    g1, = torch.autograd.grad(got.sum(), logits)
    g2, = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g1, g2)
    # a truncated support: no gradient reaches the logits outside it
    got = support_logprobs_of_rows(logits, torch.tensor([1, 2, 1]), torch.tensor([[1, 0, 2]] * 3),
                                   torch.tensor([2, 3, 1]))  # supports {1, 0}, {1, 0, 2}, {1}
    g, = torch.autograd.grad(got.sum(), logits)
    assert (g[:, 3:] == 0).all() and g[0, 2] == 0 and (g[2] == 0).all()  # a support of one: log p = 0
    assert (g[0, :2] != 0).all() and (g[1, :3] != 0).all()


def test_truncated_support_hand_example():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # top-p 0.6: 0.5 < 0.6 so token 1 joins; mass before token 2 is 0.8 >= 0.6
    ids, sizes, p = truncated_support(logits, temperature=1.0, top_p=0.6, k=4)
    assert ids.tolist() == [[0, 1, 2, 3]] and sizes.tolist() == [2]
    assert p.tolist()[0] == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)
    # top-k 3 first, then top-p on the renormalised top-3 (0.5/0.95 = 0.526 < 0.55; then 0.842 >= 0.55)
    ids, sizes, _ = truncated_support(logits, temperature=1.0, top_p=0.55, k=3)
    assert ids.shape == (1, 3) and sizes.tolist() == [2]
    ids, sizes, _ = truncated_support(logits, temperature=1.0, top_p=0.5, k=3)
    assert sizes.tolist() == [1]  # 0.5 / 0.95 reaches 0.5 alone
    # the nucleus is taken on the tempered probabilities: a high temperature flattens them, widening it
    _, sizes_hot, _ = truncated_support(logits, temperature=4.0, top_p=0.6, k=4)
    assert sizes_hot.tolist() == [3]
    # top-k alone keeps k; a k above the vocabulary keeps the vocabulary
    assert truncated_support(logits, temperature=1.0, top_p=1.0, k=2)[1].tolist() == [2]
    assert truncated_support(logits, temperature=1.0, top_p=1.0, k=9)[1].tolist() == [4]
    with pytest.raises(ValueError, match="temperature"):
        truncated_support(logits, temperature=0.0, top_p=0.5, k=2)


def test_support_top_k_rules():
    kw = dict(temperature=1.0, cap=8)
    assert support_top_k(top_p=1.0, top_k=0, **kw) == 0          # no truncation: same-support off
    assert support_top_k(top_p=0.9, top_k=0, **kw) == 8          # top-p alone: the cap is the top-k
    assert support_top_k(top_p=0.9, top_k=3, **kw) == 3
    assert support_top_k(top_p=1.0, top_k=3, **kw) == 3
    assert support_top_k(temperature=0.0, top_p=0.9, top_k=3, cap=8) == 0  # greedy
    with pytest.raises(ValueError, match="exceeds support_cap"):
        support_top_k(top_p=1.0, top_k=9, **kw)


def test_flatten_and_pad_supports_round_trip():
    ids_RK = np.array([[7, 3, 9], [4, 1, 0], [5, 6, 8]])
    sizes_R = np.array([2, 1, 3])
    flat = flatten_supports(ids_RK, sizes_R)
    assert flat.tolist() == [7, 3, 4, 5, 6, 8] and flat.dtype == np.int32
    ids_NK, valid_NK = pad_supports(torch.from_numpy(flat), torch.from_numpy(sizes_R))
    assert valid_NK.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert ids_NK[valid_NK].tolist() == flat.tolist()
    assert ids_NK[~valid_NK].tolist() == [7, 4, 4]  # padding repeats the token's first id
    with pytest.raises(ValueError, match="add up"):
        pad_supports(torch.from_numpy(flat[:-1]), torch.from_numpy(sizes_R))
    e_ids, e_valid = pad_supports(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert e_ids.shape == (0, 1) and e_valid.shape == (0, 1)


def test_check_sample_support():
    check_sample_support(np.array([3, 4]), np.array([3, 9, 4], np.int32), np.array([2, 1], np.int32))
    with pytest.raises(ValueError, match="response token 1 .id 4. is not in its recorded support"):
        check_sample_support(np.array([3, 4]), np.array([3, 4, 9], np.int32), np.array([2, 1], np.int32))
    with pytest.raises(ValueError, match="add up"):
        check_sample_support(np.array([3, 4]), np.array([3, 4], np.int32), np.array([2, 1], np.int32))
    with pytest.raises(ValueError, match="shape"):
        check_sample_support(np.array([3, 4]), np.array([3], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="empty support"):
        check_sample_support(np.array([3, 4]), np.array([3], np.int32), np.array([1, 0], np.int32))

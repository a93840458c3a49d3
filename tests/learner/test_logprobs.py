"""token_logprobs: alignment with the tokens, fp32, entropy, chunking, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from moe_gspo.learner.logprobs import token_logprobs


def test_hand_computed_alignment():
    # V=2; logits at position 0 predict token 1, position 1 predicts token 2.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[1, 1, 0]])
    logp, ent = token_logprobs(logits, ids, with_entropy=True)
    # position 1: uniform over 2 -> log(1/2); position 2: p(0) = 3/4 -> log(3/4)
    assert logp.tolist()[0] == pytest.approx([0.0, math.log(0.5), math.log(0.75)], abs=1e-6)
    h_uniform = math.log(2.0)
    h_34 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert ent.tolist()[0] == pytest.approx([0.0, h_uniform, h_34], abs=1e-6)


def test_matches_log_softmax_chunked_and_bf16():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g) * 3
    ids = torch.randint(0, 11, (3, 7), generator=g)
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    for chunk in (1, 11 * 4, 1 << 20):  # one row per chunk, 4 rows, everything at once
        logp, ent = token_logprobs(logits, ids, with_entropy=True, chunk_elements=chunk)
        assert torch.allclose(logp[:, 1:], ref, atol=1e-6) and (logp[:, 0] == 0).all()
        p = torch.softmax(logits, -1)[:, :-1]
        assert torch.allclose(ent[:, 1:], -(p * p.log()).sum(-1), atol=1e-5)
    lp16, _ = token_logprobs(logits.bfloat16(), ids)
    assert lp16.dtype == torch.float32
    ref16 = torch.log_softmax(logits.bfloat16().float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(lp16[:, 1:], ref16, atol=1e-5)


def test_gradient_flows_and_bad_ids_rejected():
    logits = torch.zeros(1, 3, 4, requires_grad=True)
    ids = torch.tensor([[0, 2, 3]])
    logp, _ = token_logprobs(logits, ids)
    logp.sum().backward()
    # d log softmax(z)[t] / dz = onehot(t) - softmax(z) = onehot - 1/4, at positions 0 and 1 only
    expected = torch.full((1, 3, 4), -0.25)
    expected[0, 0, 2] += 1
    expected[0, 1, 3] += 1
    expected[0, 2] = 0
    assert torch.allclose(logits.grad, expected)
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(torch.zeros(1, 2, 4), torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="same B, S"):
        token_logprobs(torch.zeros(1, 2, 4), torch.tensor([[0, 1, 2]]))


def test_support_renormalises_the_listed_tokens_only():
    from moe_gspo.algos.support import pad_supports

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 6, generator=g, requires_grad=True)
    ids = torch.tensor([[0, 2, 5, 1], [3, 3, 4, 0]])
    full, _ = token_logprobs(logits, ids)
    # tokens (0, 2) = 5 with support {5, 1}, (1, 3) = 0 with support {0, 3, 4}
    flat, sizes = torch.tensor([5, 1, 0, 3, 4]), torch.tensor([2, 3])
    ids_NK, valid_NK = pad_supports(flat, sizes)
    support = (torch.tensor([0, 1]), torch.tensor([2, 3]), ids_NK, valid_NK)
    logp, _ = token_logprobs(logits, ids, support=support, chunk_elements=6)
    want_02 = logits[0, 1, 5] - torch.logsumexp(logits[0, 1, [5, 1]], 0)
    want_13 = logits[1, 2, 0] - torch.logsumexp(logits[1, 2, [0, 3, 4]], 0)
    assert logp[0, 2].item() == pytest.approx(want_02.item(), abs=1e-6)
    assert logp[1, 3].item() == pytest.approx(want_13.item(), abs=1e-6)
    assert logp[0, 2] > full[0, 2] and logp[1, 3] > full[1, 3]
    other = torch.ones_like(logp, dtype=torch.bool)
    other[0, 2] = other[1, 3] = False
    assert torch.equal(logp[other], full[other])  # the others keep the full softmax
    grad, = torch.autograd.grad(logp[0, 2], logits)
    assert (grad[0, 1, [0, 2, 3, 4]] == 0).all() and (grad[0, 1, [1, 5]] != 0).all()
    with pytest.raises(ValueError, match="position 0"):
        token_logprobs(logits, ids, support=(torch.tensor([0]), torch.tensor([0]), ids_NK[:1], valid_NK[:1]))

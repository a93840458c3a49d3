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


# --- issue 40: ChunkedTokenLogprobs (non-fp32 logits keep no fp32 [T, V] copy for backward) ---

def _plain_fp32(logits_NV, tgt_N, chunk):
    """The plain autograd path of token_logprobs (what fp32 logits take), on [N, V]."""
    logps, ents = [], []
    for i in range(0, logits_NV.shape[0], chunk):
        x = logits_NV[i:i + chunk].float()
        lse = torch.logsumexp(x, dim=-1)
        logps.append(x.gather(-1, tgt_N[i:i + chunk, None]).squeeze(-1) - lse)
        p = torch.exp(x - lse[:, None])
        ents.append(lse - (p * x).sum(-1))
    return torch.cat(logps), torch.cat(ents)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_function_matches_plain_path_fp32(chunk):
    from moe_gspo.learner.logprobs import ChunkedTokenLogprobs
    g = torch.Generator().manual_seed(3)
    base = torch.randn(13, 37, generator=g, dtype=torch.float32) * 4
    tgt = torch.randint(0, 37, (13,), generator=g)
    w_lp, w_ent = torch.randn(13, generator=g), torch.randn(13, generator=g)
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    lp_a, ent_a = _plain_fp32(a, tgt, chunk)
    lp_b, ent_b = ChunkedTokenLogprobs.apply(b, tgt, True, chunk)
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)  # the same float32 ops
    ((lp_a * w_lp).sum() + (ent_a * w_ent).sum()).backward()
    ((lp_b * w_lp).sum() + (ent_b * w_ent).sum()).backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    # log-probs only (no entropy requested), and entropy only
    for use_lp, use_ent in ((True, False), (False, True)):
        a.grad = b.grad = None
        lp_a, ent_a = _plain_fp32(a, tgt, chunk)
        lp_b, ent_b = ChunkedTokenLogprobs.apply(b, tgt, use_ent, chunk)
        (lp_a.sum() * use_lp + ent_a.sum() * use_ent).backward()
        (lp_b.sum() * use_lp + (ent_b.sum() if use_ent else 0)).backward()
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def test_fp32_token_logprobs_keeps_the_plain_path():
    """fp32 logits do not take the autograd function (bit-identical to before issue 40)."""
    logits = torch.randn(2, 5, 9, requires_grad=True)
    ids = torch.randint(0, 9, (2, 5))
    logp, ent = token_logprobs(logits, ids, with_entropy=True)
    names = set()

    def walk(fn):
        if fn is None or fn in seen:
            return
        seen.add(fn)
        names.add(type(fn).__name__)
        for nxt, _ in fn.next_functions:
            walk(nxt)
    seen = set()
    walk(logp.grad_fn)
    walk(ent.grad_fn)
    assert not any("ChunkedTokenLogprobs" in n for n in names) and any("LogsumexpBackward" in n for n in names)


def test_bf16_equals_upcasting_first():
    g = torch.Generator().manual_seed(4)
    logits32 = (torch.randn(3, 6, 50, generator=g) * 3).bfloat16().float()
    ids = torch.randint(0, 50, (3, 6), generator=g)
    w = torch.randn(3, 6, generator=g)
    x16 = logits32.bfloat16().requires_grad_(True)
    x32 = logits32.clone().requires_grad_(True)
    for chunk in (50, 50 * 4, 1 << 20):
        x16.grad = x32.grad = None
        lp16, ent16 = token_logprobs(x16, ids, with_entropy=True, chunk_elements=chunk)
        lp32, ent32 = token_logprobs(x32, ids, with_entropy=True, chunk_elements=chunk)
        assert torch.equal(lp16, lp32) and torch.equal(ent16, ent32)  # exact: bf16 -> fp32 is exact
        ((lp16 * w).sum() + (ent16 * w).sum()).backward()
        ((lp32 * w).sum() + (ent32 * w).sum()).backward()
        assert x16.grad.dtype == torch.bfloat16
        # the fp32 gradient rounded to bf16 (what `.float()`'s backward gives), up to one bf16 ulp
        torch.testing.assert_close(x16.grad.float(), x32.grad.bfloat16().float(), rtol=1.6e-2, atol=1e-5)


def test_bf16_saves_only_its_logits_and_per_token_floats():
    N_B, S, V = 2, 64, 1000
    logits = torch.randn(N_B, S, V).bfloat16().requires_grad_(True)
    ids = torch.randint(0, V, (N_B, S))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel() * t.element_size(), tuple(t.shape)))
        return t

    for with_entropy in (False, True):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, ent = token_logprobs(logits, ids, with_entropy=with_entropy, chunk_elements=V * 16)
        T = N_B * S
        total = sum(b for _, b, _ in saved)
        assert total <= 2 * T * V + 64 * T, saved  # the bf16 logits + O(tokens)
        assert not any(dt == torch.float32 and b >= 4 * T * V // 8 for dt, b, _ in saved), saved
        loss = logp.sum() + (ent.sum() if with_entropy else 0)
        loss.backward()
        assert torch.isfinite(logits.grad.float()).all()
        logits.grad = None
    # the plain fp32 path, for comparison, keeps at least one fp32 [T, V] (and twice that with entropies)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits.detach().float().requires_grad_(True), ids, with_entropy=True, chunk_elements=V * 16)
    assert sum(b for dt, b, _ in saved if dt == torch.float32) >= 2 * 4 * N_B * S * V


def test_bf16_padded_vocabulary_slice_and_support():
    """The learner's logits are a slice `[..., :vocab]` of the padded vocabulary (a non-contiguous view)."""
    g = torch.Generator().manual_seed(5)
    full = (torch.randn(2, 4, 16, generator=g) * 2).bfloat16().requires_grad_(True)
    ids = torch.randint(0, 10, (2, 4), generator=g)
    logp, ent = token_logprobs(full[..., :10], ids, with_entropy=True, chunk_elements=20)
    ref = full.detach()[..., :10].float().requires_grad_(True)
    lp_r, ent_r = token_logprobs(ref, ids, with_entropy=True, chunk_elements=20)
    assert torch.equal(logp, lp_r) and torch.equal(ent, ent_r)
    (logp.sum() + ent.sum()).backward()
    (lp_r.sum() + ent_r.sum()).backward()
    assert (full.grad[..., 10:] == 0).all()
    torch.testing.assert_close(full.grad[..., :10].float(), ref.grad.bfloat16().float(), rtol=1.6e-2, atol=1e-5)

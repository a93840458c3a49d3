"""The transformers engine's sampler (moe_gspo.rollout.token_sampler): top-k / top-p draws, recorded
supports and same-support log-probs, checked against a teacher-forced forward of the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.token_sampler import TokenSampler, draw_tokens

PROMPTS = [[2, 5, 6, 7, 8], [2, 9], [2, 10, 11, 12, 13, 14]]


def _teacher_logits(model, sample) -> torch.Tensor:
    """[R, V] fp32 logits that predicted each response token."""
    ids = torch.as_tensor(np.concatenate([sample.prompt_ids, sample.response_ids]))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(sample.prompt_ids) - 1:-1]


def _supports(sample):
    ends = np.cumsum(sample.support_sizes_R)
    return [sample.support_ids_N[e - n:e] for e, n in zip(ends, sample.support_sizes_R)]


@pytest.mark.parametrize("sampling", [dict(top_p=0.8), dict(top_k=3), dict(top_k=5, top_p=0.5),
                                      dict(top_p=0.8, temperature=0.7)], ids=str)
def test_recorded_log_probs_are_the_support_renormalised_ones(engine32, model, sampling):
    samples = engine32.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=6, seed=4, **sampling))
    vocab = model.config.vocab_size
    for s in samples:
        logits = _teacher_logits(model, s)
        supports = _supports(s)
        assert s.support_ids_N.dtype == np.int32 and s.support_sizes_R.dtype == np.int32
        assert len(supports) == len(s.response_ids) and all(len(set(x.tolist())) == len(x) for x in supports)
        for t, (tok, support) in enumerate(zip(s.response_ids, supports)):
            assert tok in support and len(support) <= sampling.get("top_k", vocab)
            idx = torch.as_tensor(support, dtype=torch.long)
            want = logits[t, tok] - torch.logsumexp(logits[t, idx], 0)
            assert abs(float(s.response_logprobs[t]) - float(want)) <= 1e-5
            full = torch.log_softmax(logits[t], 0)[tok]
            assert s.response_logprobs[t] > full + 1e-4  # the support left out mass
    if "top_k" in sampling and "top_p" not in sampling:
        assert all((s.support_sizes_R == sampling["top_k"]).all() for s in samples)


def test_no_truncation_records_no_support_and_top_1_is_greedy(engine32):
    plain = engine32.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert all(s.support_ids_N is None and s.support_sizes_R is None for s in plain)
    greedy = engine32.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0, top_p=0.5))
    assert all(s.support_ids_N is None for s in greedy)  # greedy decoding has no support
    top1 = engine32.generate(PROMPTS, SamplingParams(max_new_tokens=4, top_k=1, seed=3))
    for g, t in zip(greedy, top1):
        assert np.array_equal(g.response_ids, t.response_ids)
        assert (t.support_sizes_R == 1).all() and np.array_equal(t.support_ids_N, t.response_ids.astype(np.int32))
        assert (t.response_logprobs == 0).all()  # a support of one token: probability 1


def test_draw_tokens_samples_the_renormalised_support():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log().expand(6000, 4)
    g = torch.Generator().manual_seed(0)
    tok, (ids, sizes) = draw_tokens(logits, temperature=1.0, top_p=1.0, k=2, generator=g)
    counts = torch.bincount(tok, minlength=4).tolist()
    assert counts[2] == counts[3] == 0 and (sizes == 2).all()
    assert abs(counts[0] / 6000 - 0.4 / 0.7) < 0.03
    tok, support = draw_tokens(logits, temperature=0.0, top_p=0.5, k=2, generator=g)
    assert support is None and (tok == 0).all()


def test_sampler_checks(engine32):
    with pytest.raises(ValueError, match="top_k=9 must be in .0, sampling.support_cap=8"):
        engine32.generate(PROMPTS, SamplingParams(top_k=9, support_cap=8))
    sampler = TokenSampler(SamplingParams(top_p=0.9, support_cap=4), pad_token_id=0, device="cpu")
    assert sampler.records_support and sampler.k == 4  # top-p alone: the cap is the top-k
    assert not TokenSampler(SamplingParams(), pad_token_id=0, device="cpu").records_support

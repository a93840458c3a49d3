"""Same-support log-probs: top-k / top-p sampling and the log-probs that match it (pure functions).

With top-p (nucleus) or top-k sampling, token t is drawn from a truncated support S_t, not from the
whole vocabulary. Importance ratios need the probability of the token under the distribution it was
drawn from, so both the rollout engine and the learner compute

    log p_S(y_t) = z_t[y_t] - logsumexp_{v in S_t} z_t[v]            (z = untempered logits)

over the SAME support S_t: the one the rollout sampled from, recorded per token with the sample
(slime's "top-p mask", PR #2102; DeepSeek-V3.2's "keep sampling mask"; vLLM's `return_sampling_mask`).
Where S_t leaves out probability mass, log p_S(y_t) > log p(y_t) (the full-softmax value).

The support, as the rollout samplers compute it (`truncated_support`; vLLM and transformers order
the two filters the same way):
1. top-k by logit, k = `support_top_k(...)`: `top_k`, or `support_cap` when only top-p is on
   (the cap bounds what is stored per token, and so acts as an implicit top-k);
2. then top-p on the TEMPERED probabilities renormalised over those k tokens: the smallest prefix of
   them (in descending order) whose mass reaches `top_p` (at least one token).

Temperature: the support is the sampler's (tempered) one, but the log-probs stay UNTEMPERED (the
project's convention, `moe_gspo.rollout.base`): with temperature != 1 the samples are still not drawn
from the distribution the log-probs describe (config_checks warns). Greedy decoding (temperature 0)
records no support.
"""

from __future__ import annotations

import numpy as np
import torch

DEFAULT_SUPPORT_CAP = 256
"""Default `rollout.support_cap`: most token ids kept per response token (4 bytes each, host memory)."""


def support_top_k(*, temperature: float, top_p: float, top_k: int, cap: int) -> int:
    """The k of the support's top-k filter, or 0 when sampling does not truncate (same-support off):
    greedy decoding, or top_p >= 1 with top_k == 0. `top_k` (when > 0) must not exceed `cap`."""
    if cap < 1:
        raise ValueError(f"support_cap={cap} must be >= 1")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = off)")
    if top_k > cap:
        raise ValueError(f"top_k={top_k} exceeds support_cap={cap}; raise the cap or lower top_k")
    if temperature == 0 or (top_p >= 1.0 and top_k == 0):
        return 0
    return top_k or cap


def truncated_support(logits_BV: torch.Tensor, *, temperature: float, top_p: float, k: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampling support of each row: `(ids_BK, sizes_B, probs_BK)`.

    `ids_BK` int64 [B, K] are the top-K token ids by logit (K = min(k, V)), in descending order;
    row b's support is `ids_BK[b, :sizes_B[b]]` (`sizes_B` int64, >= 1). `probs_BK` float32 are the
    tempered probabilities renormalised over the support (0 past `sizes_B`), what the sampler draws from.
    """
    if temperature <= 0:
        raise ValueError(f"truncated_support: temperature={temperature} must be > 0 (greedy has no support)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"truncated_support: top_p={top_p} must be in (0, 1]")
    K = min(int(k), logits_BV.shape[-1])
    if K < 1:
        raise ValueError(f"truncated_support: k={k} must be >= 1")
    vals_BK, ids_BK = logits_BV.float().topk(K, dim=-1)  # sorted, largest first
    probs_BK = torch.softmax(vals_BK / temperature, dim=-1)
    if top_p < 1.0:
        # mass of the tokens ranked before each one; a prefix of the ranking is kept (cumsum is monotone)
        mass_before_BK = torch.nn.functional.pad(probs_BK.cumsum(-1)[:, :-1], (1, 0))
        sizes_B = (mass_before_BK < top_p).sum(-1)
    else:
        sizes_B = torch.full(probs_BK.shape[:1], K, dtype=torch.long, device=probs_BK.device)
    keep_BK = torch.arange(K, device=probs_BK.device)[None, :] < sizes_B[:, None]
    probs_BK = probs_BK.masked_fill(~keep_BK, 0.0)
    return ids_BK, sizes_B, probs_BK / probs_BK.sum(-1, keepdim=True)


def support_logprob(support_logits_NK: torch.Tensor, valid_NK: torch.Tensor,
                    target_logit_N: torch.Tensor) -> torch.Tensor:
    """float32 [N]: `target_logit_N - logsumexp(support_logits_NK[valid_NK])` per row, i.e. the
    log-softmax of the target over its support only (columns outside `valid_NK` count as -inf).
    Differentiable in the logits. Each row needs at least one valid column."""
    masked_NK = support_logits_NK.float().masked_fill(~valid_NK, float("-inf"))
    return target_logit_N.float() - torch.logsumexp(masked_NK, dim=-1)


def support_logprobs_of_rows(logits_BV: torch.Tensor, targets_B: torch.Tensor, ids_BK: torch.Tensor,
                             sizes_B: torch.Tensor) -> torch.Tensor:
    """float32 [B]: each row's target log-prob renormalised over `ids_BK[b, :sizes_B[b]]` (untempered
    logits), what the rollout engine records for a token sampled from that support."""
    valid_BK = torch.arange(ids_BK.shape[-1], device=ids_BK.device)[None, :] < sizes_B[:, None]
    support_BK = logits_BV.gather(-1, ids_BK)
    target_B = logits_BV.gather(-1, targets_B[:, None].long()).squeeze(-1)
    return support_logprob(support_BK, valid_BK, target_B)


def flatten_supports(ids_RK: np.ndarray, sizes_R: np.ndarray) -> np.ndarray:
    """int32 [N = sum(sizes_R)]: the first `sizes_R[t]` ids of each row of `ids_RK`, concatenated in row
    order (the compact per-sample form, `RolloutSample.support_ids_N`)."""
    ids_RK, sizes_R = np.asarray(ids_RK), np.asarray(sizes_R)
    keep_RK = np.arange(ids_RK.shape[-1])[None, :] < sizes_R[:, None]
    return np.ascontiguousarray(ids_RK[keep_RK].astype(np.int32, copy=False))


def pad_supports(flat_ids_M: torch.Tensor, sizes_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact supports of N tokens (`flat_ids_M`: theirs concatenated, `sizes_N` > 0 each) as a padded
    `(ids_NK int64, valid_NK bool)`, K = max(sizes_N); padding columns repeat the token's first id."""
    sizes_N = sizes_N.long()
    N = sizes_N.shape[0]
    if int(sizes_N.sum()) != flat_ids_M.shape[0]:
        raise ValueError(f"pad_supports: the sizes add up to {int(sizes_N.sum())}, but {flat_ids_M.shape[0]} ids given")
    if N == 0:
        empty = torch.zeros((0, 1), dtype=torch.long, device=flat_ids_M.device)
        return empty, empty.bool()
    if int(sizes_N.min()) < 1:
        raise ValueError("pad_supports: every token's support needs at least one id")
    K = int(sizes_N.max())
    start_N = sizes_N.cumsum(0) - sizes_N
    col_K = torch.arange(K, device=sizes_N.device)
    valid_NK = col_K[None, :] < sizes_N[:, None]
    index_NK = start_N[:, None] + torch.where(valid_NK, col_K[None, :], 0)
    return flat_ids_M.long()[index_NK], valid_NK


def check_sample_support(response_ids_R: np.ndarray, support_ids_N: np.ndarray, support_sizes_R: np.ndarray,
                         where: str = "sample") -> None:
    """ValueError unless `support_sizes_R` has one size >= 1 per response token, the sizes add up to
    `len(support_ids_N)`, and every sampled token lies in its own support."""
    R = len(response_ids_R)
    sizes = np.asarray(support_sizes_R)
    if sizes.shape != (R,):
        raise ValueError(f"{where}: support_sizes_R has shape {sizes.shape} for {R} response tokens")
    if R and int(sizes.min()) < 1:
        raise ValueError(f"{where}: a response token has an empty support")
    if int(sizes.sum()) != len(support_ids_N):
        raise ValueError(f"{where}: support sizes add up to {int(sizes.sum())}, but support_ids_N has "
                         f"{len(support_ids_N)} ids")
    owner = np.repeat(np.arange(R), sizes)
    hit = np.zeros(R, dtype=bool)
    hit[owner[np.asarray(support_ids_N) == np.asarray(response_ids_R)[owner]]] = True
    if not hit.all():
        t = int(np.flatnonzero(~hit)[0])
        raise ValueError(f"{where}: response token {t} (id {int(response_ids_R[t])}) is not in its recorded support")

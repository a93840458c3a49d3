"""Importance-ratio statistics for a batch of response tokens (no gradient).

Per token the importance ratio is w_{i,t} = exp(logp_{i,t} - old_logp_{i,t}). Two sequence-level
ratios are summarised:
- the length-normalised GSPO ratio s_i = exp((1/|y_i|) sum_t log w_{i,t}) (Zheng et al. 2025,
  "Group Sequence Policy Optimization", arXiv 2507.18071, eq. for s_i(theta)), and
- the unnormalised sequence likelihood ratio prod_t w_{i,t}, whose variance grows like (1+chi2)^T
  with the response length while s_i stays bounded; `ratio/seq_prod_logvar` and `ratio/chi2_seq`
  measure that growth.

Conventions (shared with `policy_loss` and `mismatch`):
- `[B, T]` tensors hold response tokens only; `mask_BT` (bool, or numbers where nonzero = valid)
  marks the valid ones. Masked positions may hold garbage (nan, +-inf): they are replaced with
  `torch.where` before any arithmetic, so they never reach a result.
- Log ratios are clamped to +-`max_log_ratio` per token before `exp`; for `ratio/chi2_seq` the
  sequence log product is clamped to +-`max_log_ratio` as well, so every number stays finite
  (a saturated sequence contributes exp(2*max_log_ratio) - 1).
- Variances are population variances (divide by the count, not count - 1); a single unit gives 0.
- Sequences with no valid token are skipped; with no valid token at all every statistic is 0.
- chi2 values are computed as mean(expm1(2 log w)), which equals E[w^2] - 1 without the
  cancellation of subtracting 1 from a number close to 1.
- Statistics are computed in float64 and returned as detached 0-dim float64 tensors on the input's
  device (no host sync; call `float(v)` to log them).

Simplification: the statistics are plain sample moments over the tokens/sequences of the batch
(no importance weighting, no per-group averaging).
"""

from __future__ import annotations

import torch

RATIO_KEYS = (
    "ratio/token_mean",
    "ratio/token_var",
    "ratio/seq_mean",
    "ratio/seq_var",
    "ratio/seq_prod_logvar",
    "ratio/chi2_token",
    "ratio/chi2_seq",
    "ratio/num_tokens",
    "ratio/num_seqs",
)


def as_bool_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    """A bool mask from a bool or numeric mask (nonzero = valid token)."""
    if mask_BT.dtype == torch.bool:
        return mask_BT
    return mask_BT != 0


def check_token_tensors(mask_BT: torch.Tensor, **named: torch.Tensor | None) -> None:
    """Raise ValueError unless `mask_BT` and every named tensor are [B, T] tensors of one shape
    (the named ones floating point). None values are skipped."""
    if not isinstance(mask_BT, torch.Tensor) or mask_BT.dim() != 2:
        got = tuple(mask_BT.shape) if isinstance(mask_BT, torch.Tensor) else type(mask_BT).__name__
        raise ValueError(f"mask_BT must be a [B, T] tensor (bool or 0/1), got {got}")
    for name, tensor in named.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape [B, T], got {type(tensor).__name__}")
        if tensor.shape != mask_BT.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but mask_BT has shape {tuple(mask_BT.shape)}; "
                "pass per-token tensors of the same [B, T] shape"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor of log-probs, got {tensor.dtype}")


def check_max_log_ratio(max_log_ratio: float) -> None:
    """Raise ValueError unless `max_log_ratio` is a positive finite number."""
    if not (0.0 < float(max_log_ratio) < float("inf")):
        raise ValueError(f"max_log_ratio must be a positive finite number (e.g. 20.0), got {max_log_ratio}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask`, divided by `count` (0 when `count` is 0)."""
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return total / count.clamp(min=1).to(values.dtype)


def _token_moments(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor, limit: float):
    """(mask, clamped log ratio lr, tokens per row, tokens, token mean and population variance of w = exp(lr))."""
    mask = as_bool_mask(mask_BT)
    raw_lr = logp_BT.detach().double() - old_logp_BT.detach().double()
    lr = torch.where(mask, raw_lr, 0.0).clamp(-limit, limit)  # 0 at padding
    num_tok_B = mask.sum(-1)
    num_tokens = num_tok_B.sum()
    w = torch.exp(lr)
    token_mean = masked_mean(w, mask, num_tokens)
    token_var = masked_mean((w - token_mean) ** 2, mask, num_tokens)
    return mask, lr, num_tok_B, num_tokens, token_mean, token_var


def token_ratio_var(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                    max_log_ratio: float = 20.0) -> torch.Tensor:
    """`ratio/token_var` of `ratio_stats` alone (the same numbers, without the other statistics): the
    population variance of w = exp(logp - old_logp) over the valid tokens, a detached 0-dim float64 tensor."""
    check_token_tensors(mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT)
    check_max_log_ratio(max_log_ratio)
    with torch.no_grad():
        return _token_moments(logp_BT, old_logp_BT, mask_BT, float(max_log_ratio))[5]


def ratio_stats(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    max_log_ratio: float = 20.0,
    namespace: str = "ratio",
) -> dict[str, torch.Tensor]:
    """Statistics of the importance ratios exp(logp - old_logp) over the valid tokens of a batch.

    Args:
        logp_BT: [B, T] log-probs of the sampled tokens under the new policy.
        old_logp_BT: [B, T] log-probs of the same tokens under the old (behaviour) policy.
        mask_BT: [B, T] bool or 0/1 mask of valid response tokens (may be any sub-mask, e.g. the
            tokens whose routing flipped; a sequence's length is its number of masked-in tokens).
        max_log_ratio: per-token (and per-sequence, for chi2_seq) clamp of the log ratio.
        namespace: the keys' namespace (`mismatch_ratio` for learner vs rollout engine: the same names).

    Returns:
        dict with detached 0-dim float64 tensors:
        `ratio/token_mean`, `ratio/token_var`: mean and population variance of w over valid tokens;
        `ratio/seq_mean`, `ratio/seq_var`: same for the length-normalised s_i over valid sequences;
        `ratio/seq_prod_logvar`: population variance over sequences of sum_t log w_{i,t};
        `ratio/chi2_token`: E_tokens[w^2] - 1; `ratio/chi2_seq`: E_seqs[(prod_t w)^2] - 1;
        `ratio/num_tokens`, `ratio/num_seqs`: the counts they were computed over.
    """
    check_token_tensors(mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT)
    check_max_log_ratio(max_log_ratio)
    limit = float(max_log_ratio)
    with torch.no_grad():
        mask, lr, num_tok_B, num_tokens, token_mean, token_var = _token_moments(logp_BT, old_logp_BT, mask_BT, limit)
        seq_valid_B = num_tok_B > 0
        num_seqs = seq_valid_B.sum()

        chi2_token = masked_mean(torch.expm1(2.0 * lr), mask, num_tokens)

        log_prod_B = lr.sum(-1)
        s_B = torch.exp(log_prod_B / num_tok_B.clamp(min=1).double())
        seq_mean = masked_mean(s_B, seq_valid_B, num_seqs)
        seq_var = masked_mean((s_B - seq_mean) ** 2, seq_valid_B, num_seqs)
        log_prod_mean = masked_mean(log_prod_B, seq_valid_B, num_seqs)
        seq_prod_logvar = masked_mean((log_prod_B - log_prod_mean) ** 2, seq_valid_B, num_seqs)
        chi2_seq = masked_mean(torch.expm1(2.0 * log_prod_B.clamp(-limit, limit)), seq_valid_B, num_seqs)

    values = (
        token_mean,
        token_var,
        seq_mean,
        seq_var,
        seq_prod_logvar,
        chi2_token,
        chi2_seq,
        num_tokens.double(),
        num_seqs.double(),
    )
    return {f"{namespace}/{key.partition('/')[2]}": value for key, value in zip(RATIO_KEYS, values)}

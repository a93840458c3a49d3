"""Train-inference mismatch metrics between two log-prob sources for the same sampled tokens.

`a` is the policy that sampled the tokens (rollout engine, or the old policy) and `b` the one
that re-scores them (learner, or the new policy). With d = logp_a - logp_b and r = exp(-d) =
pi_b / pi_a, and tokens sampled from pi_a:
- k1 KL = mean(d) and k3 KL = mean(r - 1 - log r) both estimate KL(pi_a || pi_b) (Schulman 2020,
  "Approximating KL divergence", http://joschu.net/blog/kl-approx.html): k1 is unbiased but can be
  negative; k3 is unbiased and never negative.
- |d| (mean and max), and the fraction of "extreme" tokens with |d| > ln 2 and |d| > ln 5 (the
  probabilities differ by more than 2x / 5x), as reported in the Rollout Routing Replay paper
  (Ma et al. 2025, arXiv 2510.11370) and related train-inference mismatch studies; the whole curve
  F(tau) over a grid of tau is `extreme_frac_curve` (a separate function: `mismatch_metrics` returns
  scalars only).
- per-sequence PPL ratio exp(mean_t logp_a - mean_t logp_b) = PPL_b / PPL_a, averaged over
  sequences (1 = no mismatch; > 1 means b finds the sampled text less likely than a did).

Simplifications and conventions:
- Sample means over the valid tokens of the batch (sequences with no valid token are skipped for
  the PPL ratio); masked positions may hold garbage (replaced with `torch.where` first).
- The exponents of k3 and of the PPL ratio are clamped to +-`max_log_ratio` so the results stay
  finite; k1 and the |d| statistics use the unclamped differences.
- Computed in float64 without gradient, for any floating-point input dtype; returned as python
  floats. With no valid token every value is 0.0 (also `mismatch/ppl_ratio_mean`).
"""

from __future__ import annotations

import math

import torch

from moe_gspo.algos.ratios import as_bool_mask, check_max_log_ratio, check_token_tensors

MISMATCH_KEYS = (
    "mismatch/k1_kl",
    "mismatch/k3_kl",
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "mismatch/extreme_frac_ln2",
    "mismatch/extreme_frac_ln5",
    "mismatch/ppl_ratio_mean",
    "mismatch/num_tokens",
)


def mismatch_metrics(
    logp_a_BT: torch.Tensor,
    logp_b_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    max_log_ratio: float = 20.0,
    namespace: str = "mismatch",
) -> dict[str, float]:
    """Mismatch between log-probs `a` (sampler: rollout engine / old policy) and `b` (learner /
    new policy) of the same tokens.

    Args:
        logp_a_BT: [B, T] log-probs under the sampling policy pi_a.
        logp_b_BT: [B, T] log-probs of the same tokens under pi_b.
        mask_BT: [B, T] bool or 0/1 mask of valid response tokens.
        max_log_ratio: clamp of the exponents of k3 and of the PPL ratio.
        namespace: the keys' namespace (`mismatch_replayed` for R3's replayed pass: the same names).

    Returns:
        python floats keyed `mismatch/k1_kl`, `mismatch/k3_kl`, `mismatch/logp_abs_diff_mean`,
        `mismatch/logp_abs_diff_max`, `mismatch/extreme_frac_ln2`, `mismatch/extreme_frac_ln5`,
        `mismatch/ppl_ratio_mean`, `mismatch/num_tokens` (see the module docstring).
    """
    check_token_tensors(mask_BT, logp_a_BT=logp_a_BT, logp_b_BT=logp_b_BT)
    check_max_log_ratio(max_log_ratio)
    limit = float(max_log_ratio)
    with torch.no_grad():
        mask = as_bool_mask(mask_BT)
        num_tok_B = mask.sum(-1)
        num_tokens = num_tok_B.sum()
        seq_valid_B = num_tok_B > 0
        num_seqs = seq_valid_B.sum()
        denom_tok = num_tokens.clamp(min=1).double()

        d = torch.where(mask, logp_a_BT.detach().double() - logp_b_BT.detach().double(), 0.0)
        k1 = d.sum() / denom_tok
        log_r = (-d).clamp(-limit, limit)  # log(pi_b / pi_a), 0 at padding
        k3 = (torch.expm1(log_r) - log_r).sum() / denom_tok
        abs_d = d.abs()
        abs_mean = abs_d.sum() / denom_tok
        abs_max = abs_d.amax() if abs_d.numel() else abs_d.new_zeros(())
        ext2 = ((abs_d > math.log(2.0)) & mask).sum() / denom_tok
        ext5 = ((abs_d > math.log(5.0)) & mask).sum() / denom_tok
        mean_d_B = d.sum(-1) / num_tok_B.clamp(min=1).double()
        ppl_ratio_B = torch.exp(mean_d_B.clamp(-limit, limit))
        ppl_mean = torch.where(seq_valid_B, ppl_ratio_B, 0.0).sum() / num_seqs.clamp(min=1).double()

        stacked = torch.stack([k1, k3, abs_mean, abs_max, ext2, ext5, ppl_mean, num_tokens.double()])
        values = stacked.cpu().tolist()  # one host sync
    return {f"{namespace}/{key.partition('/')[2]}": float(value) for key, value in zip(MISMATCH_KEYS, values)}


EXTREME_TAUS = (1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
"""The tau grid of `extreme_frac_curve` (`mismatch/extreme_frac_curve`); tau = 2 and 5 are
`mismatch/extreme_frac_ln2` and `_ln5`."""


def extreme_frac_curve(logp_a_BT: torch.Tensor, logp_b_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                       taus=EXTREME_TAUS) -> list[float]:
    """F(tau), the Rollout Routing Replay paper's extreme-token fraction curve (Ma et al. 2025, arXiv
    2510.11370): per tau of `taus`, the share of the valid tokens whose probability ratio between the two
    sides lies beyond tau either way, |log p_a - log p_b| > ln tau (unclamped differences, as
    `mismatch_metrics`, whose `extreme_frac_ln2` / `_ln5` are its points at tau = 2 and 5, bit for bit).
    Non-increasing in tau; every value 0.0 with no valid token. Python floats, one per tau."""
    check_token_tensors(mask_BT, logp_a_BT=logp_a_BT, logp_b_BT=logp_b_BT)
    taus = [float(t) for t in taus]
    if not all(t > 1.0 for t in taus):
        raise ValueError(f"extreme_frac_curve: every tau must be > 1 (a probability ratio bound), got {taus}")
    with torch.no_grad():
        mask = as_bool_mask(mask_BT)
        denom_tok = mask.sum().clamp(min=1).double()
        abs_d = torch.where(mask, logp_a_BT.detach().double() - logp_b_BT.detach().double(), 0.0).abs()
        fracs = [((abs_d > math.log(t)) & mask).sum() / denom_tok for t in taus]
        values = torch.stack(fracs).cpu().tolist() if fracs else []
    return [float(v) for v in values]

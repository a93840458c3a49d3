"""Clipped policy-optimisation losses: GSPO, GSPO-token and GRPO, with an optional k3 KL penalty.

Papers:
- GSPO and GSPO-token: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071.
  Sequence ratio s_i = exp((1/|y_i|) sum_t (logp - old_logp)); objective
  (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i). GSPO-token uses
  s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})] and averages min(...) over the tokens of each
  sequence; with A_{i,t} = A_i it equals GSPO in value, clipping and gradient.
- GRPO: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300: PPO-clip per token with
  w_{i,t} = exp(logp - old_logp), averaged over the tokens of each sequence, then over sequences
  (`aggregation="seq_mean"`).
- Token-level mean: Yu et al. 2025, "DAPO", arXiv 2503.14476: GRPO's per-token terms averaged over
  all response tokens of the batch (`aggregation="token_mean"`); DAPO's decoupled clip range is the
  `clip_low` / `clip_high` pair here.
- KL penalty: k3 estimator of Schulman 2020, "Approximating KL divergence"
  (http://joschu.net/blog/kl-approx.html): per token exp(ref - logp) - (ref - logp) - 1, as in the
  GRPO paper; it estimates KL(pi_theta || pi_ref) from tokens sampled by the rollout policy.

What was simplified or chosen here:
- The loss is the NEGATIVE objective, a 0-dim tensor; the batch mean is over the sequences (or, for
  token_mean, the tokens) of this call only: averaging over micro-batches / data-parallel ranks is
  the caller's job (weight by `ratio/num_seqs` or `ratio/num_tokens`).
- GSPO and GSPO-token are sequence means by definition: `aggregation="token_mean"` is rejected
  for them. The KL term is averaged the same way as the policy term.
- Log ratios (and ref - logp for the KL) are clamped to +-`max_log_ratio` per token before `exp`,
  as verl does; a clamped token gets no gradient through its ratio (GSPO-token mirrors this so the
  GSPO identity also holds for clamped tokens).
- Masked positions may hold garbage (nan, +-inf): inputs are replaced with `torch.where` before any
  arithmetic, so neither the loss nor the gradient can see them. A sequence with no valid token
  contributes 0 and is left out of the mean; an all-masked batch gives a loss of 0 that is still
  connected to `logp_BT` (its gradient is zero).
- `old_logp_BT`, `advantages` and `ref_logp_BT` are treated as constants (detached).
- Computation is in float32, or float64 when `logp_BT` is float64.

Train-inference corrections (`moe_gspo.algos.rollout_correction`): `is_weights_BT` (detached
truncated importance weights pi_learner_old / pi_rollout) multiply the policy-gradient term of each
token: grpo and gspo_token multiply their per-token clipped terms; gspo, which has one term per
sequence, multiplies it by the mean weight of the sequence's valid tokens (for sequence-level weights,
constant within a sequence, GSPO and GSPO-token stay identical in value and gradient; for token-level
weights the values agree but GSPO-token gives token t's gradient its own weight while GSPO spreads
the mean weight). The KL term is not weighted. Rejection masks are and-ed into `mask_BT` by the caller.

Metrics (detached 0-dim float64 tensors on the input's device; `float(v)` to log):
- `loss/policy` (the negative clipped objective), `loss/kl` (the k3 KL, present whenever
  `ref_logp_BT` is given), `loss/total` (= policy + kl_coef * kl).
- Clipping units are sequences for gspo and tokens for gspo_token and grpo. A unit's clip *binds*
  when its ratio is above 1 + clip_high with A > 0, or below 1 - clip_low with A < 0: the min() then
  takes the clipped term and the unit gets no gradient. A unit outside the range with the other
  sign of A is not clipped (the unclipped term is smaller, its gradient flows).
  `clip/token_frac`: fraction of valid tokens whose clip binds (for gspo every token of a binding
  sequence, as the GSPO paper counts clipped tokens; verl's `pg_clipfrac`, the fraction of tokens
  where the clipped loss exceeds the unclipped one, is the same quantity);
  `clip/token_frac_low` / `_high`: its two sides (they sum to `clip/token_frac`);
  `clip/seq_frac`: fraction of valid sequences with at least one binding unit.
  `clip/out_of_range_frac` (`_low` / `_high`): fraction of valid tokens whose ratio lies outside
  [1 - clip_low, 1 + clip_high] whatever the sign of the advantage (an upper bound of the binding
  fraction; about twice it on mixed-sign advantages).
- The `ratio/...` statistics of `ratios.ratio_stats` on (logp_BT, old_logp_BT, mask_BT).
"""

from __future__ import annotations

import torch

from moe_gspo.algos.ratios import (
    as_bool_mask,
    check_max_log_ratio,
    check_token_tensors,
    masked_mean,
    ratio_stats,
)

ALGOS = ("gspo", "gspo_token", "grpo")
AGGREGATIONS = ("seq_mean", "token_mean")


def _validate(algo, advantages, mask_BT, clip_low, clip_high, kl_coef, ref_logp_BT, aggregation):
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "token_mean" and algo != "grpo":
        raise ValueError(
            f"aggregation='token_mean' applies to grpo only; {algo} averages over sequences by "
            "definition: use aggregation='seq_mean'"
        )
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor [B] or [B, T], got {type(advantages).__name__}")
    num_seqs, num_cols = mask_BT.shape
    if advantages.dim() == 2:
        if algo == "gspo":
            raise ValueError(
                "gspo needs one advantage per sequence: pass advantages of shape [B], or use "
                "algo='gspo_token' for per-token advantages [B, T]"
            )
        if advantages.shape != mask_BT.shape:
            raise ValueError(
                f"per-token advantages have shape {tuple(advantages.shape)}, expected "
                f"{(num_seqs, num_cols)} like mask_BT"
            )
    elif advantages.dim() != 1 or advantages.shape[0] != num_seqs:
        raise ValueError(
            f"advantages must have shape [B]={num_seqs} (or [B, T] for gspo_token/grpo), "
            f"got {tuple(advantages.shape)}"
        )
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be floating point, got {advantages.dtype}")
    if not 0.0 <= float(clip_low) < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) (the ratio floor is 1 - clip_low), got {clip_low}")
    if not float(clip_high) >= 0.0:
        raise ValueError(f"clip_high must be >= 0 (the ratio ceiling is 1 + clip_high), got {clip_high}")
    if not float(kl_coef) >= 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if float(kl_coef) > 0.0 and ref_logp_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logp_BT (reference-policy log-probs [B, T]); pass it or set kl_coef=0")


def policy_loss(
    algo: str,
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ref_logp_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "seq_mean",
    max_log_ratio: float = 20.0,
    is_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss of `algo` (negative objective, 0-dim) and its metrics.

    Args:
        algo: "gspo", "gspo_token" or "grpo".
        logp_BT: [B, T] log-probs of the sampled response tokens under the current policy (grad).
        old_logp_BT: [B, T] log-probs under the policy that sampled them (constant).
        advantages: [B] per-sequence, or [B, T] per-token (gspo_token and grpo only).
        mask_BT: [B, T] bool or 0/1 mask of valid response tokens (nonzero = valid).
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        ref_logp_BT: [B, T] reference-policy log-probs, needed when kl_coef > 0.
        kl_coef: weight of the k3 KL penalty added to the loss.
        aggregation: "seq_mean" (per-sequence token mean, then mean over sequences) or
            "token_mean" (mean over all valid tokens of the batch; grpo only).
        max_log_ratio: clamp of per-token log ratios before exp.
        is_weights_BT: [B, T] rollout-correction weights (treated as constants) multiplying the
            policy-gradient term of each token (see the module docstring); None = all 1.

    Returns:
        (loss, metrics): see the module docstring for the metric keys.
    """
    check_token_tensors(mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT, ref_logp_BT=ref_logp_BT,
                        is_weights_BT=is_weights_BT)
    check_max_log_ratio(max_log_ratio)
    _validate(algo, advantages, mask_BT, clip_low, clip_high, kl_coef, ref_logp_BT, aggregation)
    limit = float(max_log_ratio)
    ratio_lo, ratio_hi = 1.0 - float(clip_low), 1.0 + float(clip_high)

    dtype = torch.promote_types(logp_BT.dtype, torch.float32)
    mask = as_bool_mask(mask_BT)
    num_tok_B = mask.sum(-1)
    num_tokens = num_tok_B.sum()
    seq_valid_B = num_tok_B > 0
    num_seqs = seq_valid_B.sum()
    inv_len_B = 1.0 / num_tok_B.clamp(min=1).to(dtype)

    # Sanitise first: every later op sees finite zeros at masked positions, in value and gradient.
    logp = torch.where(mask, logp_BT.to(dtype), 0.0)
    old = torch.where(mask, old_logp_BT.detach().to(dtype), 0.0)
    raw_lr = logp - old
    lr = raw_lr.clamp(-limit, limit)

    # Advantages are 0 at masked positions and in empty rows, so their objective terms are 0.
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv_B = torch.where(seq_valid_B, adv, 0.0)
        adv_BT = torch.where(mask, adv_B[:, None], 0.0)
    else:
        adv_B = None
        adv_BT = torch.where(mask, adv, 0.0)

    # Rollout-correction weights: 1 where absent, 0 at masked positions.
    is_w_BT = None if is_weights_BT is None else torch.where(mask, is_weights_BT.detach().to(dtype), 0.0)

    def aggregate(values_BT: torch.Tensor) -> torch.Tensor:
        """Mean of per-token values (0 at masked positions) as the objective is averaged."""
        if aggregation == "token_mean":
            return values_BT.sum() / num_tokens.clamp(min=1).to(dtype)
        per_seq_B = values_BT.sum(-1) * inv_len_B
        return per_seq_B.sum() / num_seqs.clamp(min=1).to(dtype)

    if algo == "gspo":
        s_B = torch.exp(lr.sum(-1) * inv_len_B)
        objective_B = torch.minimum(s_B * adv_B, s_B.clamp(ratio_lo, ratio_hi) * adv_B)
        if is_w_BT is not None:  # one term per sequence: the mean weight of its tokens
            objective_B = objective_B * (is_w_BT.sum(-1) * inv_len_B)
        objective = objective_B.sum() / num_seqs.clamp(min=1).to(dtype)
        unit_ratio, unit_adv, unit_valid = s_B.detach(), adv_B, seq_valid_B
        token_ratio_BT = s_B.detach()[:, None].expand_as(lr)
    else:
        if algo == "gspo_token":
            s_B = torch.exp(lr.sum(-1) * inv_len_B).detach()
            # exp(logp - sg[logp]) is 1 in value and carries d/dlogp = 1; clamped tokens get none,
            # as in gspo where the clamp stops their gradient.
            unclamped = raw_lr.detach().abs() <= limit
            carrier = torch.where(unclamped, logp - logp.detach(), 0.0)
            ratio_BT = s_B[:, None] * torch.exp(carrier)
        else:
            ratio_BT = torch.exp(lr)
        objective_BT = torch.minimum(ratio_BT * adv_BT, ratio_BT.clamp(ratio_lo, ratio_hi) * adv_BT)
        if is_w_BT is not None:
            objective_BT = objective_BT * is_w_BT
        objective = aggregate(objective_BT)
        unit_ratio, unit_adv, unit_valid = ratio_BT.detach(), adv_BT, mask
        token_ratio_BT = ratio_BT.detach()

    loss_policy = -objective
    loss = loss_policy
    kl = None
    if ref_logp_BT is not None:
        ref = torch.where(mask, ref_logp_BT.detach().to(dtype), 0.0)
        log_ref_ratio = (ref - logp).clamp(-limit, limit)
        k3_BT = torch.where(mask, torch.expm1(log_ref_ratio) - log_ref_ratio, 0.0)
        kl = aggregate(k3_BT)
        if float(kl_coef) > 0.0:
            loss = loss_policy + float(kl_coef) * kl

    with torch.no_grad():
        bind_low = (unit_ratio < ratio_lo) & (unit_adv < 0) & unit_valid
        bind_high = (unit_ratio > ratio_hi) & (unit_adv > 0) & unit_valid
        if algo == "gspo":  # every token of a binding sequence counts
            bind_low, bind_high = bind_low[:, None] & mask, bind_high[:, None] & mask
        out_low = (token_ratio_BT < ratio_lo) & mask
        out_high = (token_ratio_BT > ratio_hi) & mask
        metrics = {
            "loss/policy": loss_policy.detach().double(),
            "loss/total": loss.detach().double(),
        }
        if kl is not None:
            metrics["loss/kl"] = kl.detach().double()
        ones_BT = torch.ones_like(lr, dtype=torch.float64)
        for key, sel in (("clip/token_frac", bind_low | bind_high), ("clip/token_frac_low", bind_low),
                         ("clip/token_frac_high", bind_high), ("clip/out_of_range_frac", out_low | out_high),
                         ("clip/out_of_range_frac_low", out_low), ("clip/out_of_range_frac_high", out_high)):
            metrics[key] = masked_mean(ones_BT, sel, num_tokens)
        ones_B = torch.ones_like(inv_len_B, dtype=torch.float64)
        metrics["clip/seq_frac"] = masked_mean(ones_B, (bind_low | bind_high).any(-1), num_seqs)
    metrics.update(ratio_stats(logp_BT, old_logp_BT, mask_BT, max_log_ratio=limit))
    return loss, metrics

"""Train-inference rollout corrections: truncated importance weights (TIS) and rejection masks (MIS).

The rollout engine samples with pi_rollout (its own kernels, dtype and, for an MoE, its own expert
choices); the learner's clipped objective is anchored at pi_learner_old (the learner's log-probs of
the same tokens with the same weights). When the two differ the policy gradient is off-policy. Both
corrections are computed from the per-token log ratio

    lr_t = log pi_learner_old(y_t) - log pi_rollout(y_t)        (`old_logp_BT - rollout_logp_BT`)

and never from the current policy pi_theta, so they are constants of the update (detached).

Sources:
- Yao, Liu, Zhang et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (https://fengyao.notion.site/off-policy-rl): truncated importance sampling (TIS),
  w_t = min(pi_learner_old / pi_rollout, C) multiplying the token's policy-gradient term.
- verl's `rollout_correction` (`verl/trainer/ppo/rollout_corr_helper.py`, Liu, Li et al. 2025,
  "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"):
  the names used here. `rollout_is` = token | sequence truncated weights (sequence: the product of
  the token ratios), `rollout_rs` = token | sequence | geometric rejection (a masked unit leaves the
  loss, numerator and denominator), `rollout_rs_threshold_lower` defaulting to 1 / upper.
- Masked importance sampling: IcePop (Ling team 2025, "Small Leak Can Sink a Great Ship: Boost RL
  Training on MoE with IcePop") masks tokens whose ratio leaves [lower, upper] (`rollout_rs=token`);
  slime's MIS helper and verl's `geometric` mode mask whole sequences by the geometric mean of their
  token ratios, exp(mean_t lr_t) (`rollout_rs=geometric`), which, unlike the product, does not grow
  with the response length (thresholds like 1.001 / 0.999 are typical).

Which probabilities: `old_logp_BT` is exactly what the loss uses as pi_old. Without replay and under
R2 that is the learner's natural-routing pass; under R3 it is the pass that replays the rollout
engine's experts, so the weights then correct only the numerical (kernel / dtype) part of the
mismatch, not the routing part R3 already removed: expect weights closer to 1 and fewer masked
units than without replay.

How the outputs are used (`moe_gspo.algos.policy_loss`): `is_weights_BT` multiplies each token's
clipped policy-gradient term (gspo: its sequence term is multiplied by the mean weight of its
tokens; for `rollout_is=sequence` that is the sequence weight itself); `keep_BT` is and-ed into the
loss mask, so rejected tokens (or whole sequences) leave the objective, its normalisation (sequence
lengths, number of sequences) and the KL term alike.

Differences from verl, on purpose:
- Statistics are per unit (tokens for `token`, sequences for `sequence` / `geometric`); verl
  broadcasts sequence weights to tokens and averages over tokens, which weights long responses more.
- The effective sample size is that of the applied (truncated) weights, (sum w)^2 / (N sum w^2)
  over units; verl also clamps the weights from below at 1 / threshold before computing it.
- No batch normalisation of the weights and no per-token "veto" (verl's `rollout_token_veto_threshold`);
  `rollout_rs=token` with a small lower bound rejects the same tokens, not their whole sequence.
- Empty inputs give NaN statistics (nothing to measure), never 0.

Off-policy sequence masking (OPSM, `opsm_mask`; DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier
of Open Large Language Models", arXiv 2512.02556, §3.1 "Off-Policy Sequence Masking"; slime
`--use-opsm` / `--opsm-delta`, `slime/utils/ppo_utils.py::compute_opsm_mask`). Unlike the corrections
above it is computed from the CURRENT policy inside every update (`Learner.train_step`), as the paper
defines it: the binary mask M_{i,t} multiplying the GRPO term of token t of response i is 0 when
A_i < 0 and

    (1 / |o_i|) sum_t [log pi_rollout(o_t) - log pi_theta(o_t)] > delta,

1 otherwise. pi_rollout ("pi_old" in the paper) is the sampling probability the inference engine
returned, so the drift covers both the train-inference mismatch and the staleness of later
mini-batches; only negative-advantage sequences are masked ("highly off-policy negative samples can
be detrimental"). What is simplified / differs:
- The paper gives no value of delta (a hyper-parameter "that controls the threshold of policy
  divergence"); the default 1e-4 is slime's `--opsm-delta` default (also used by Miles).
- Per-sequence advantages (GRPO's, equal on every token of a response), as this learner has.
- The mask multiplies the policy-gradient term only (as in the paper's formula and in slime, where
  `pg_loss * opsm_mask`): masked sequences stay in the normalisation (1 / G, 1 / |o_i|) and in the KL
  term, unlike `rollout_rs`, which removes rejected units from the loss altogether.
- slime reports `opsm_clipfrac` as the sum over samples of (masked / response length); here
  `rollout_corr/opsm_masked_seq_frac` is the share of valid sequences masked and
  `rollout_corr/opsm_masked_token_frac` the share of valid tokens in masked sequences (per
  mini-batch; the step's row holds their mean over mini-batches).

Conventions: `[B, T]` response-token tensors, `mask_BT` nonzero = valid; masked positions may hold
garbage (replaced with `torch.where` first). Log ratios are clamped to +-`max_log_ratio` before `exp`
(verl's safety bound of 20); the rejection test compares unclamped log ratios with the log thresholds.
Metrics are detached 0-dim float64 tensors (`float(v)` to log).
"""

from __future__ import annotations

import math

import torch

from moe_gspo.algos.ratios import as_bool_mask, check_max_log_ratio, check_token_tensors

IS_LEVELS = ("none", "token", "sequence")
RS_LEVELS = ("none", "token", "sequence", "geometric")
DEFAULT_IS_THRESHOLD = 2.0
"""verl's default truncation of the importance weights (`rollout_is_threshold`)."""
DEFAULT_OPSM_DELTA = 1e-4
"""OPSM's drift threshold delta: slime's `--opsm-delta` default (DeepSeek-V3.2 publishes no value)."""


def _nan(like: torch.Tensor) -> torch.Tensor:
    return torch.full((), math.nan, dtype=torch.float64, device=like.device)


def _unit_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over `valid` entries (float64), NaN when there are none."""
    count = valid.sum()
    if int(count) == 0:
        return _nan(values)
    return torch.where(valid, values.double(), 0.0).sum() / count.double()


def _log_ratios(old_logp_BT, rollout_logp_BT, mask_BT):
    check_token_tensors(mask_BT, old_logp_BT=old_logp_BT, rollout_logp_BT=rollout_logp_BT)
    mask = as_bool_mask(mask_BT)
    lr = torch.where(mask, old_logp_BT.detach().double() - rollout_logp_BT.detach().double(), 0.0)
    return mask, lr


def rollout_is_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    level: str,
    threshold: float = DEFAULT_IS_THRESHOLD,
    max_log_ratio: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights pi_learner_old / pi_rollout (TIS), detached.

    Args:
        old_logp_BT: [B, T] learner old-policy log-probs of the sampled tokens (the loss's pi_old).
        rollout_logp_BT: [B, T] the rollout engine's log-probs of the same tokens.
        mask_BT: [B, T] valid response tokens.
        level: "token" (w_t = min(exp(lr_t), threshold)) or "sequence" (every token of sequence i
            gets W_i = min(exp(sum_t lr_t), threshold)).
        threshold: truncation C (> 0); verl's default is 2.0.
        max_log_ratio: clamp of the log ratio (token, or sequence sum) before exp.

    Returns:
        (weights_BT float32, 0 at invalid positions; metrics), metrics over the units (tokens or
        sequences with >= 1 valid token):
        `rollout_corr/is_raw_mean`, `rollout_corr/is_raw_max`: the untruncated ratio (verl's
        `rollout_is_mean` / `rollout_is_max`); `rollout_corr/is_weight_mean`: the applied weight;
        `rollout_corr/is_truncated_frac`: units whose ratio exceeded the threshold;
        `rollout_corr/is_ess`: effective sample size of the applied weights, (sum w)^2 / (N sum w^2),
        in (0, 1]. NaN when there is no unit.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is level must be 'token' or 'sequence', got {level!r}")
    if not float(threshold) > 0.0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    check_max_log_ratio(max_log_ratio)
    limit = float(max_log_ratio)
    with torch.no_grad():
        mask, lr = _log_ratios(old_logp_BT, rollout_logp_BT, mask_BT)
        if level == "token":
            unit_lr, unit_valid = lr, mask
        else:
            unit_lr, unit_valid = lr.sum(-1), mask.any(-1)
        raw = torch.exp(unit_lr.clamp(-limit, limit))
        applied = raw.clamp(max=float(threshold))
        weights_BT = applied if level == "token" else applied[:, None].expand_as(lr)
        weights_BT = torch.where(mask, weights_BT, 0.0).to(torch.float32)

        valid_any = bool(unit_valid.any())
        w = torch.where(unit_valid, applied, 0.0)
        metrics = {
            "rollout_corr/is_raw_mean": _unit_mean(raw, unit_valid),
            "rollout_corr/is_raw_max": (torch.where(unit_valid, raw, 0.0).amax().double()
                                        if valid_any else _nan(lr)),
            "rollout_corr/is_weight_mean": _unit_mean(applied, unit_valid),
            "rollout_corr/is_truncated_frac": _unit_mean((raw > float(threshold)).double(), unit_valid),
            "rollout_corr/is_ess": ((w.sum() ** 2 / (unit_valid.sum() * (w ** 2).sum())).double()
                                    if valid_any else _nan(lr)),
        }
    return weights_BT, metrics


def rollout_rs_mask(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    level: str,
    threshold: float,
    threshold_lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rejection mask: keep a unit when its ratio pi_learner_old / pi_rollout lies in [lower, upper].

    Args:
        old_logp_BT, rollout_logp_BT, mask_BT: as in `rollout_is_weights`.
        level: "token" (ratio exp(lr_t), IcePop-style token masking), "sequence" (the product
            exp(sum_t lr_t)) or "geometric" (the geometric mean exp(mean_t lr_t)); sequence levels
            keep or reject every token of a sequence together.
        threshold: upper bound (> 1). threshold_lower: lower bound in (0, 1); None = 1 / threshold.

    Returns:
        (keep_BT bool, False at invalid positions; metrics):
        `rollout_corr/rs_masked_token_frac`: valid tokens rejected (verl's `rollout_rs_masked_fraction`);
        `rollout_corr/rs_masked_seq_frac`: valid sequences with >= 1 rejected token;
        `rollout_corr/rs_frac_high` / `_low`: units whose ratio is above upper / below lower.
        NaN when there is no valid token.
    """
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"rollout_rs level must be 'token', 'sequence' or 'geometric', got {level!r}")
    upper = float(threshold)
    lower = 1.0 / upper if threshold_lower is None else float(threshold_lower)
    if not (upper > 1.0 and 0.0 < lower < 1.0):
        raise ValueError(f"rollout_rs bounds must satisfy 0 < lower < 1 < upper, got lower={lower}, upper={upper}")
    with torch.no_grad():
        mask, lr = _log_ratios(old_logp_BT, rollout_logp_BT, mask_BT)
        num_tok_B = mask.sum(-1)
        seq_valid_B = num_tok_B > 0
        if level == "token":
            unit_lr, unit_valid = lr, mask
        elif level == "sequence":
            unit_lr, unit_valid = lr.sum(-1), seq_valid_B
        else:
            unit_lr, unit_valid = lr.sum(-1) / num_tok_B.clamp(min=1).double(), seq_valid_B
        high = unit_lr > math.log(upper)
        low = unit_lr < math.log(lower)
        keep_unit = ~(high | low)
        keep_BT = (keep_unit if level == "token" else keep_unit[:, None].expand_as(mask)) & mask
        rejected_BT = mask & ~keep_BT
        metrics = {
            "rollout_corr/rs_masked_token_frac": _unit_mean(rejected_BT.double(), mask),
            "rollout_corr/rs_masked_seq_frac": _unit_mean(rejected_BT.any(-1).double(), seq_valid_B),
            "rollout_corr/rs_frac_high": _unit_mean(high.double(), unit_valid),
            "rollout_corr/rs_frac_low": _unit_mean(low.double(), unit_valid),
        }
    return keep_BT, metrics


def opsm_mask(
    logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    delta: float = DEFAULT_OPSM_DELTA,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-policy sequence masking (DeepSeek-V3.2; see the module docstring): keep every token of
    sequence i unless A_i < 0 and drift_i = mean_t (rollout_logp - logp) over its valid tokens > delta.

    Args:
        logp_BT: [B, T] CURRENT-policy log-probs of the sampled tokens (read detached).
        rollout_logp_BT: [B, T] the rollout engine's log-probs of the same tokens.
        advantages_B: [B] one advantage per sequence.
        mask_BT: [B, T] valid response tokens.
        delta: the drift threshold (>= 0); a sequence is masked only when its drift is strictly above.

    Returns:
        (keep_BT bool, False at invalid positions; metrics over the valid sequences / tokens):
        `rollout_corr/opsm_masked_seq_frac`: sequences masked; `rollout_corr/opsm_masked_token_frac`:
        valid tokens of masked sequences; `rollout_corr/opsm_kl_mean`: mean drift_i (a k1 estimate of
        KL(pi_rollout || pi_theta) per token, averaged per sequence, all advantages). NaN when there is
        no valid sequence.
    """
    check_token_tensors(mask_BT, logp_BT=logp_BT, rollout_logp_BT=rollout_logp_BT)
    if not float(delta) >= 0.0:
        raise ValueError(f"opsm delta must be >= 0 (a drift threshold), got {delta}")
    num_seqs = mask_BT.shape[0]
    if tuple(advantages_B.shape) != (num_seqs,):
        raise ValueError(f"advantages_B has shape {tuple(advantages_B.shape)}, expected [B] = ({num_seqs},)")
    with torch.no_grad():
        mask = as_bool_mask(mask_BT)
        diff = torch.where(mask, rollout_logp_BT.detach().double() - logp_BT.detach().double(), 0.0)
        num_tok_B = mask.sum(-1)
        seq_valid_B = num_tok_B > 0
        drift_B = diff.sum(-1) / num_tok_B.clamp(min=1).double()
        masked_B = seq_valid_B & (advantages_B.detach().to(drift_B.device) < 0) & (drift_B > float(delta))
        keep_BT = mask & ~masked_B[:, None]
        metrics = {
            "rollout_corr/opsm_masked_seq_frac": _unit_mean(masked_B.double(), seq_valid_B),
            "rollout_corr/opsm_masked_token_frac": _unit_mean((mask & masked_B[:, None]).double(), mask),
            "rollout_corr/opsm_kl_mean": _unit_mean(drift_B, seq_valid_B),
        }
    return keep_BT, metrics


def rollout_correction(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    rollout_is: str = "none",
    rollout_is_threshold: float | None = None,
    rollout_rs: str = "none",
    rollout_rs_threshold: float | None = None,
    rollout_rs_threshold_lower: float | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], dict[str, torch.Tensor]]:
    """Both corrections at once (names as verl's config): `((is_weights_BT or None, keep_BT or None), metrics)`.

    `rollout_is="none"` gives no weights, `rollout_rs="none"` no mask; the IS statistics are over all
    valid units (rejected ones included). `rollout_is_threshold=None` means 2.0.
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS}, got {rollout_is!r}")
    if rollout_rs not in RS_LEVELS:
        raise ValueError(f"rollout_rs must be one of {RS_LEVELS}, got {rollout_rs!r}")
    weights, keep, metrics = None, None, {}
    if rollout_is != "none":
        thr = DEFAULT_IS_THRESHOLD if rollout_is_threshold is None else rollout_is_threshold
        weights, m = rollout_is_weights(old_logp_BT, rollout_logp_BT, mask_BT, level=rollout_is,
                                        threshold=thr, max_log_ratio=max_log_ratio)
        metrics.update(m)
    if rollout_rs != "none":
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold (the upper bound of the kept ratios)")
        keep, m = rollout_rs_mask(old_logp_BT, rollout_logp_BT, mask_BT, level=rollout_rs,
                                  threshold=rollout_rs_threshold, threshold_lower=rollout_rs_threshold_lower)
        metrics.update(m)
    return (weights, keep), metrics

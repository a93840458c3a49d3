"""PPO-clip losses on a sequence or a token ratio: GSPO, GSPO-token and GRPO.

Papers:
- GSPO and GSPO-token: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071.
  Sequence ratio s_i = exp((1/|y_i|) sum_t (logp - old_logp)); objective
  (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i). GSPO-token uses
  s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})] and averages min(...) over the tokens of each
  sequence; with A_{i,t} = A_i it equals GSPO in value, clipping and gradient.
- GRPO: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300: PPO-clip per token with
  w_{i,t} = exp(logp - old_logp); its per-token terms are aggregated per `loss_agg_mode` (the paper:
  `seq-mean-token-mean`; DAPO's `token-mean`, Yu et al. 2025, arXiv 2503.14476, whose decoupled
  clip range is the `clip_low` / `clip_high` pair here).

What was simplified or chosen here:
- GSPO and GSPO-token are sequence means by definition (only `seq-mean-token-mean`).
- A token whose log ratio was clamped to +-max_log_ratio gets no gradient through its ratio;
  GSPO-token mirrors GSPO's clamp so that the identity also holds for clamped tokens.
- Rollout-correction weights (`is_w_BT`): grpo and gspo_token multiply their per-token clipped
  terms; gspo, which has one term per sequence, multiplies it by the mean weight of the sequence's
  valid tokens (sequence-level weights keep GSPO == GSPO-token; token-level weights keep the values
  equal, but GSPO-token gives token t's gradient its own weight where GSPO spreads the mean).

Clip metrics: units are sequences for gspo and tokens for gspo_token and grpo. A unit's clip
*binds* when its ratio is above 1 + clip_high with A > 0, or below 1 - clip_low with A < 0 (the
min() then takes the clipped, constant term: no gradient). `clip/token_frac` counts the valid tokens
of binding units (for gspo every token of a binding sequence, as the GSPO paper counts clipped
tokens; verl's `pg_clipfrac` is the same quantity); `clip/out_of_range_frac` counts the tokens whose
(sequence, for gspo) ratio lies outside the range whatever the sign of A.
"""

from __future__ import annotations

import torch

from moe_gspo.algos.algo_spec import AlgoSpec
from moe_gspo.algos.loss_common import LossInputs, PolicyTerms, clip_metrics


def _ppo_min(ratio: torch.Tensor, adv: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)


def _binding(ratio: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, lo: float, hi: float):
    return (ratio < lo) & (adv < 0) & valid, (ratio > hi) & (adv > 0) & valid


def gspo_terms(inp: LossInputs, *, clip_low: float, clip_high: float, **_) -> PolicyTerms:
    lo, hi = 1.0 - float(clip_low), 1.0 + float(clip_high)
    s_B = torch.exp(inp.token_mean_per_seq(inp.lr))
    objective_B = _ppo_min(s_B, inp.adv_B, lo, hi)
    if inp.is_w_BT is not None:  # one term per sequence: the mean weight of its tokens
        objective_B = objective_B * inp.token_mean_per_seq(inp.is_w_BT)
    with torch.no_grad():
        s = s_B.detach()
        bind_low, bind_high = _binding(s, inp.adv_B, inp.seq_valid_B, lo, hi)
        out_low, out_high = (s < lo)[:, None] & inp.mask, (s > hi)[:, None] & inp.mask
        metrics = clip_metrics(inp, bind_low[:, None] & inp.mask, bind_high[:, None] & inp.mask, out_low, out_high)
    return PolicyTerms(metrics=metrics, objective_B=objective_B)


def _token_terms(inp: LossInputs, ratio_BT: torch.Tensor, clip_low: float, clip_high: float) -> PolicyTerms:
    lo, hi = 1.0 - float(clip_low), 1.0 + float(clip_high)
    objective_BT = _ppo_min(ratio_BT, inp.adv_BT, lo, hi)
    if inp.is_w_BT is not None:
        objective_BT = objective_BT * inp.is_w_BT
    with torch.no_grad():
        r = ratio_BT.detach()
        bind_low, bind_high = _binding(r, inp.adv_BT, inp.mask, lo, hi)
        metrics = clip_metrics(inp, bind_low, bind_high, (r < lo) & inp.mask, (r > hi) & inp.mask)
    return PolicyTerms(metrics=metrics, objective_BT=objective_BT)


def gspo_token_terms(inp: LossInputs, *, clip_low: float, clip_high: float, **_) -> PolicyTerms:
    s_B = torch.exp(inp.token_mean_per_seq(inp.lr)).detach()
    # exp(logp - sg[logp]) is 1 in value and carries d/dlogp = 1; clamped tokens get none, as in
    # gspo where the clamp stops their gradient.
    unclamped = inp.raw_lr.detach().abs() <= inp.limit
    carrier = torch.where(unclamped, inp.logp - inp.logp.detach(), 0.0)
    return _token_terms(inp, s_B[:, None] * torch.exp(carrier), clip_low, clip_high)


def grpo_terms(inp: LossInputs, *, clip_low: float, clip_high: float, **_) -> PolicyTerms:
    return _token_terms(inp, torch.exp(inp.lr), clip_low, clip_high)


def _sequence_clip_advice(clip_low: float, clip_high: float) -> str | None:
    if clip_high >= 0.05:
        return ("that is a token-level range; GSPO's sequence ratio is length-normalised and lives near 1, the paper "
                "uses (3e-4, 4e-4). Nothing will be clipped.")
    return None


def _token_clip_advice(clip_low: float, clip_high: float) -> str | None:
    if clip_high < 0.01:
        return ("a sequence-level range applied to token ratios clips almost every token; the paper's GRPO baseline "
                "uses (0.2, 0.27).")
    return None


# Clip ranges: the GSPO paper's (Zheng et al. 2025, section 5.1; sequence ratios live near 1) for all three.
GSPO = AlgoSpec(name="gspo", terms=gspo_terms, level="sequence", clip="ratio", default_clip=(3e-4, 4e-4),
                per_token_advantages=False, clip_advice=_sequence_clip_advice,
                doc="sequence ratio (geometric mean of the token ratios), PPO clip on it (Zheng et al. 2025)")
GSPO_TOKEN = AlgoSpec(name="gspo_token", terms=gspo_token_terms, level="sequence", clip="ratio",
                      default_clip=(3e-4, 4e-4), clip_advice=_sequence_clip_advice,
                      doc="GSPO's token-wise variant: sg[sequence ratio] x a token carrier, takes per-token advantages")
GRPO = AlgoSpec(name="grpo", terms=grpo_terms, level="token", clip="ratio", default_clip=(0.2, 0.27),
                clip_advice=_token_clip_advice,
                doc="token ratio, PPO clip per token (Shao et al. 2024, DeepSeekMath)")

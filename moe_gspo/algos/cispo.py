"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1 report, MiniMax 2025, arXiv 2506.13585; verl
`cispo`, TRL `loss_type="cispo"`, slime, NeMo-RL `use_cispo`).

Instead of clipping the token update (PPO/GRPO, where a clipped token loses its gradient), CISPO clips
the importance weight and detaches it, so every token keeps a policy-gradient term:

    J = 1/(sum_i |y_i|) sum_{i,t} sg(r^_{i,t}) A_{i,t} log pi_theta(y_{i,t}),
    r^ = clip(w, 1 - eps_low, 1 + eps_high),   w = pi_theta / pi_old per token.

Gradient of token t: r^_{i,t} A_{i,t} grad log pi(y_{i,t}). The paper aggregates with
`token-mean` (the default here); any token-level `loss_agg_mode` is accepted.

What was simplified or chosen here:
- The term is written sg(r^) * A * exp(log pi - sg[log pi]) instead of sg(r^) * A * log pi: the same
  gradient, but the VALUE is sum r^ A (the clipped-weight objective, equal to GRPO's where no ratio is
  out of range) rather than a number that depends on the size of log pi (what verl and TRL log as
  the loss). So `loss/policy` is comparable across algorithms.
- Defaults: clip_low = 1.0 (ratio floor 0: no lower truncation; the paper sets eps_low "large",
  verl's example clip_ratio_low=10), clip_high = 0.27 (this project's GRPO upper bound, so that CISPO
  and GRPO differ only in what the clip does; the paper tunes eps_high, verl's example uses 0.2,
  TRL/ScaleRL cap the weight at 4-5 instead of 1 + eps).
- The gradient flows through log pi of every valid token, also where the log ratio was clamped to
  +-max_log_ratio (the weight then sits at a bound); rollout-correction weights multiply the term.

Identities (tested): where every token's ratio lies inside [1 - eps_low, 1 + eps_high], CISPO equals
GRPO in value and gradient (same aggregation). Where a GRPO clip binds (w > 1 + eps_high with A > 0, or
w < 1 - eps_low with A < 0) the values still agree (both take the bound) but GRPO's gradient is 0
and CISPO's is (1 +- eps) A grad log pi; where a ratio is out of range on the other side the values
differ (GRPO keeps w A, CISPO r^ A).

Clip metrics (units: tokens): `clip/token_frac` (+ `_low`, `_high`, `clip/seq_frac`) is 0 by
construction — no clip ever takes a token's gradient away, which is CISPO's point; `clip/out_of_range_frac`
(+ `_low`, `_high`) is the fraction of tokens whose weight was truncated, whatever the sign of A
(verl's CISPO `pg_clipfrac`; TRL's `cispo_clip_ratio` counts only w > cap with A > 0).
"""

from __future__ import annotations

import torch

from moe_gspo.algos.algo_spec import AlgoSpec
from moe_gspo.algos.loss_common import LossInputs, PolicyTerms, clip_metrics, grad_carrier


def cispo_terms(inp: LossInputs, *, clip_low: float, clip_high: float, **_) -> PolicyTerms:
    lo, hi = 1.0 - float(clip_low), 1.0 + float(clip_high)
    w = torch.exp(inp.lr).detach()
    weight_BT = w.clamp(min=lo, max=hi)
    objective_BT = torch.where(inp.mask, weight_BT * inp.adv_BT * grad_carrier(inp), 0.0)
    if inp.is_w_BT is not None:
        objective_BT = objective_BT * inp.is_w_BT
    with torch.no_grad():
        none = torch.zeros_like(inp.mask)
        metrics = clip_metrics(inp, none, none, (w < lo) & inp.mask, (w > hi) & inp.mask)
    return PolicyTerms(metrics=metrics, objective_BT=objective_BT)


CISPO = AlgoSpec(name="cispo", terms=cispo_terms, level="token", clip="weight", default_clip=(1.0, 0.27),
                 default_agg="token-mean",
                 doc="clipped, detached token weights times grad log pi: no token loses its gradient (MiniMax-M1 2025)")

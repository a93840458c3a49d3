"""GMPO: Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673; verl `geo_mean`, TRL
`experimental.gmpo`).

GRPO averages the per-token clipped terms arithmetically; GMPO takes their geometric mean per
sequence, with the PPO clip applied per token in log space, one-sided per the sign of A_i:

    J = (1/G) sum_i sgn(A_i) * prod_t |min(w_{i,t} A_i, clip(w_{i,t}, e^-eps_low, e^eps_high) A_i)|^(1/|y_i|)
      = (1/G) sum_i A_i * exp((1/|y_i|) sum_t l~_{i,t}),
    l~_{i,t} = min(l_{i,t}, eps_high) if A_i > 0,  max(l_{i,t}, -eps_low) if A_i < 0,   l = log w.

`clip_low` / `clip_high` are the LOG-space bounds eps_low / eps_high (the ratio range is
(e^-eps_low, e^eps_high)); default 0.4 / 0.4, the paper's (e^-0.4, e^0.4), as verl's GMPO example
and TRL's `GMPOConfig(epsilon=0.4)`. The gradient of token t is A_i * s~_i / |y_i| * grad log pi(y_t)
(s~_i = the clipped geometric mean) for tokens whose clip does not bind, 0 for the others.

Identities (tested): with bounds that never bind GMPO equals GSPO without clipping in value and
gradient (GSPO's sequence ratio is the geometric mean of the token ratios); on one-token responses
GMPO(eps_low, eps_high) equals GRPO and GSPO with the ratio range (e^-eps_low, e^eps_high).

What was simplified or chosen here:
- One advantage per sequence (as the paper; verl averages per-token advantages, which we reject).
- Sequence-level: only `seq-mean-token-mean` (a mean over sequences), like GSPO.
- Log ratios are first clamped to +-max_log_ratio (verl's GMPO does not clamp); a clamped token gets
  no gradient.
- Rollout-correction weights multiply each sequence's term by the arithmetic mean of its tokens'
  weights, as for GSPO here (verl's `geo_mean` uses their geometric mean), so that the GMPO == GSPO
  identity holds with corrections too.

Clip metrics (units: tokens): `clip/token_frac` = tokens whose clip binds (l > eps_high with A > 0,
l < -eps_low with A < 0: no gradient), as TRL's GMPO `clip_ratio/region_mean`; verl's `geo_mean`
`pg_clipfrac` instead counts out-of-range tokens with A > 0 on either side. `clip/out_of_range_frac`
= tokens with l outside [-eps_low, eps_high] whatever the sign of A.
"""

from __future__ import annotations

import torch

from moe_gspo.algos.algo_spec import AlgoSpec
from moe_gspo.algos.loss_common import LossInputs, PolicyTerms, clip_metrics


def gmpo_terms(inp: LossInputs, *, clip_low: float, clip_high: float, **_) -> PolicyTerms:
    lo, hi = -float(clip_low), float(clip_high)
    lr, adv_BT = inp.lr, inp.adv_BT
    bind_high = (lr > hi) & (adv_BT > 0) & inp.mask
    bind_low = (lr < lo) & (adv_BT < 0) & inp.mask
    # a binding token contributes its bound: a constant, no gradient
    clipped = torch.where(bind_high, torch.full_like(lr, hi), torch.where(bind_low, torch.full_like(lr, lo), lr))
    s_B = torch.exp(inp.token_mean_per_seq(clipped))
    objective_B = inp.adv_B * s_B
    if inp.is_w_BT is not None:
        objective_B = objective_B * inp.token_mean_per_seq(inp.is_w_BT)
    with torch.no_grad():
        metrics = clip_metrics(inp, bind_low, bind_high, (lr < lo) & inp.mask, (lr > hi) & inp.mask)
    return PolicyTerms(metrics=metrics, objective_B=objective_B)


GMPO = AlgoSpec(name="gmpo", terms=gmpo_terms, level="sequence", clip="log", default_clip=(0.4, 0.4),
                per_token_advantages=False,
                doc="geometric mean of the token ratios, clipped per token in log space (Zhao et al. 2025)")

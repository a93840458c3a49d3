"""SAPO: Soft Adaptive Policy Optimization (Gao et al., Qwen team 2025, arXiv 2511.20347; verl `sapo`,
TRL `loss_type="sapo"`). Evaluated by its authors on Qwen3 MoE models (Qwen3-30B-A3B) and Qwen3-VL.

A smooth, temperature-controlled gate replaces the hard clip of the token ratio w = pi_theta/pi_old:

    J = (1/G) sum_i (1/|y_i|) sum_t f(w_{i,t}) A_{i,t},   f(w) = (4/tau) sigmoid(tau (w - 1)),
    tau = tau_pos if A > 0 else tau_neg   (paper: tau_pos = 1.0, tau_neg = 1.05; SAPO's options,
    `algo.options.tau_pos` / `algo.options.tau_neg`).

d f(w) / d theta = g(w) * w * grad log pi with the gate weight g(w) = 4 sigmoid(tau(w-1)) (1 - sigmoid(tau(w-1)))
= sech^2(tau (w - 1) / 2): the factor by which SAPO scales the token's UNCLIPPED policy gradient
w A grad log pi. g = 1 on policy (w = 1), so the first mini-batch's gradient equals GRPO's; it decays
smoothly as w leaves 1 and never reaches 0 (GRPO's binding clip is a jump to 0). As tau -> 0, f(w) -> 2/tau +
(w - 1) and SAPO tends to GRPO without clipping (tested).

What was simplified or chosen here:
- The value is the paper's f(w) A, so at w = 1 a token contributes 2A/tau (not A as the clipped
  losses do); only the gradient is comparable across algorithms at equal ratios.
- Any token-level `loss_agg_mode` is accepted; the default is the paper's (and TRL's, verl's forced)
  `seq-mean-token-mean`. `clip_low` / `clip_high` do not apply (rejected at config time).
- Log ratios are clamped to +-max_log_ratio before exp; a clamped token gets no gradient.

Gate metrics (units: valid tokens; no `clip/*` metric, SAPO has no clip range — verl logs
`pg_clipfrac` = 0 for it, TRL nothing): `gate/weight_mean`, the mean gate weight g (1 = every token
keeps its full unclipped gradient); `gate/token_frac_below_half`, the fraction of tokens with g < 0.5,
i.e. whose gradient the gate more than halves: |w - 1| > 2 acosh(sqrt 2) / tau = 1.76 / tau, so at the
paper's tau ~ 1 only w > 2.76 (the lower side is unreachable, w > 0) — the paper's gate is very soft.
It plays the role of a hard clip's binding fraction (for which the weight is 0) but is not the same
quantity.
"""

from __future__ import annotations

import torch

from moe_gspo.algos.algo_spec import AlgoOption, AlgoSpec
from moe_gspo.algos.loss_common import LossInputs, PolicyTerms

GATE_WEIGHT_LEVEL = 0.5
"""`gate/token_frac_below_half` counts tokens whose gate weight is below this."""


def sapo_terms(inp: LossInputs, *, tau_pos: float, tau_neg: float, **_) -> PolicyTerms:
    w = torch.exp(inp.lr)
    tau = torch.where(inp.adv_BT > 0, float(tau_pos), float(tau_neg)).to(w.dtype)
    x = tau * (w - 1.0)
    objective_BT = torch.where(inp.mask, (4.0 / tau) * torch.sigmoid(x) * inp.adv_BT, 0.0)
    if inp.is_w_BT is not None:
        objective_BT = objective_BT * inp.is_w_BT
    with torch.no_grad():
        xd = x.detach().double()
        gate = 4.0 * torch.sigmoid(xd) * torch.sigmoid(-xd)  # sech^2(x / 2), no cancellation
        count = inp.num_tokens.clamp(min=1).double()
        metrics = {"gate/weight_mean": torch.where(inp.mask, gate, 0.0).sum() / count,
                   "gate/token_frac_below_half": ((gate < GATE_WEIGHT_LEVEL) & inp.mask).sum().double() / count}
    return PolicyTerms(metrics=metrics, objective_BT=objective_BT)


SAPO = AlgoSpec(name="sapo", terms=sapo_terms, level="token", clip="none",
                options=(AlgoOption(name="tau_pos", default=1.0, gt=0.0,  # the paper's temperatures
                                    doc="gate temperature for tokens with A > 0, the paper's 1.0"),
                         AlgoOption(name="tau_neg", default=1.05, gt=0.0,
                                    doc="gate temperature for tokens with A <= 0, the paper's 1.05")),
                doc="a soft sigmoid gate on the token ratio instead of a clip (Gao et al. 2025, Qwen team)")

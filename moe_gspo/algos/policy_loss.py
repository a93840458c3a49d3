"""`policy_loss(algo, ...)`: the policy-optimisation loss of every algorithm, with an optional KL
penalty, as one pure function returning `(loss, metrics)`.

Algorithms: the `AlgoSpec`s of `moe_gspo.algos.registry` (built-ins: gspo, gspo_token and grpo in
`ppo_clip`, gmpo, cispo, sapo; one module each, with its paper, formula and simplifications; `python -m
moe_gspo.train --help` lists them), or a plug-in `module:Spec` / `file.py:Spec`. Each spec says what
this function needs to know: its terms, its level, what its clip range means, its default aggregation,
its own options (`options=`, checked and passed on to its terms).

"level": a sequence-level method has one term per sequence (its token mean already inside the
ratio) and only the `seq-mean-token-mean` aggregation; a token-level method's per-token terms are
aggregated per `loss_agg_mode` (`moe_gspo.algos.aggregation`: token-mean, seq-mean-token-mean,
seq-mean-token-sum, seq-mean-token-sum-norm; the old `aggregation` values seq_mean / token_mean are
aliases). The default mode is each paper's (`AlgoSpec.default_agg`).

KL penalty (`ref_logp_BT`, `kl_coef`, `kl_estimator` k1 | k2 | k3, `moe_gspo.algos.kl`): per-token
estimates of KL(pi_theta || pi_ref), aggregated like the policy term (sequence-level methods:
seq-mean-token-mean), added as `kl_coef * kl`.

Entropy bonus (`entropy_BT`, `entropy_coef`): the per-token entropy of the current policy's
next-token distribution (differentiable), aggregated like the policy term and SUBTRACTED as
`entropy_coef * entropy` (verl's `entropy_coeff`, aggregated by its `loss_agg_mode` as here; TRL's
`entropy_coef`, always a token mean over the micro-batch): a bonus against the premature collapse of
the policy onto deterministic answers (Williams & Peng 1991, "Function optimization using
connectionist reinforcement learning algorithms"; Mnih et al. 2016, A3C, arXiv 1602.01783).

Conventions (all algorithms):
- The loss is the NEGATIVE objective, a 0-dim tensor; the mean is over the sequences (or tokens) of
  this call only: averaging over micro-batches / data-parallel ranks is the caller's job (weight by
  `aggregation.num_units`).
- Log ratios (and log pi - log pi_ref for the KL) are clamped to +-`max_log_ratio` per token before
  `exp`, as verl does.
- Masked positions may hold garbage (nan, +-inf): inputs are replaced with `torch.where` before any
  arithmetic, so neither the loss nor the gradient can see them. A sequence with no valid token
  contributes 0 and is left out of the mean; an all-masked batch gives a loss of 0 that is still
  connected to `logp_BT` (its gradient is zero).
- `old_logp_BT`, `advantages`, `ref_logp_BT` and `is_weights_BT` are treated as constants (detached).
- Computation is in float32, or float64 when `logp_BT` is float64.
- Train-inference corrections (`moe_gspo.algos.rollout_correction`): `is_weights_BT` (detached
  truncated weights pi_learner_old / pi_rollout) multiply each token's policy-gradient term (a
  sequence-level method: its sequence term by the mean weight of its valid tokens). The KL term is
  not weighted. Rejection masks are and-ed into `mask_BT` by the caller.

Metrics (detached 0-dim float64 tensors on the input's device; `float(v)` to log):
- `loss/policy` (the negative objective), `loss/kl` (the KL estimate, present whenever `ref_logp_BT`
  is given), `loss/entropy` (the aggregated entropy, present whenever `entropy_BT` is given),
  `loss/total` (= policy + kl_coef * kl - entropy_coef * entropy).
- Clipped methods (all but sapo): `clip/token_frac` (+ `_low`, `_high`): tokens whose clip binds,
  i.e. takes the gradient away (for a sequence-level clip every token of a binding sequence; 0 for
  cispo by construction); `clip/seq_frac`: sequences with a binding token; `clip/out_of_range_frac`
  (+ `_low`, `_high`): tokens whose ratio (gspo: sequence ratio; gmpo: log ratio vs the log bounds;
  cispo: the truncated weights) lies outside the range whatever the sign of A. Each module says how
  its numbers relate to verl's and TRL's.
- sapo: `gate/weight_mean`, `gate/token_frac_below_half` (see `moe_gspo.algos.sapo`).
- The `ratio/...` statistics of `ratios.ratio_stats` on (logp_BT, old_logp_BT, mask_BT).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moe_gspo.algos import aggregation as agg
from moe_gspo.algos.kl import KL_ESTIMATORS, kl_estimate
from moe_gspo.algos.loss_common import prepare
from moe_gspo.algos.plugin_terms import call_terms
from moe_gspo.algos.ratios import check_max_log_ratio, check_token_tensors, ratio_stats
from moe_gspo.algos.registry import BUILTIN_ALGOS, AlgoSpec, algo_names, get_algo

ALGOS = BUILTIN_ALGOS
"""The built-in algorithms (`moe_gspo.algos.registry`)."""
AGGREGATIONS = tuple(agg.ALIASES)
"""The old `aggregation` names (aliases of `aggregation.LOSS_AGG_MODES`)."""


def _check_clip(spec: AlgoSpec, clip_low, clip_high) -> None:
    algo, kind = spec.name, spec.clip
    if kind == "none":
        if clip_low is not None or clip_high is not None:
            raise ValueError(f"{algo} has no clip range (its AlgoSpec.clip is 'none'); pass clip_low=None, clip_high=None")
        return
    if clip_low is None or clip_high is None:
        raise ValueError(f"{algo} needs clip_low and clip_high")
    if kind == "ratio" and not 0.0 <= float(clip_low) < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) (the ratio floor is 1 - clip_low), got {clip_low}")
    if not float(clip_low) >= 0.0:
        raise ValueError(f"clip_low must be >= 0, got {clip_low}")
    if not float(clip_high) >= 0.0:
        raise ValueError(f"clip_high must be >= 0 (the ratio ceiling is 1 + clip_high), got {clip_high}")


def _check_advantages(spec: AlgoSpec, advantages, mask_BT: torch.Tensor) -> None:
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor [B] or [B, T], got {type(advantages).__name__}")
    num_seqs, num_cols = mask_BT.shape
    if advantages.dim() == 2:
        if not spec.per_token_advantages:
            takers = [n for n in algo_names() if get_algo(n).per_token_advantages]
            raise ValueError(f"{spec.name} needs one advantage per sequence: pass advantages of shape [B], or use "
                             f"an algorithm that takes per-token advantages [B, T]: {', '.join(takers)}")
        if advantages.shape != mask_BT.shape:
            raise ValueError(f"per-token advantages have shape {tuple(advantages.shape)}, expected "
                             f"{(num_seqs, num_cols)} like mask_BT")
    elif advantages.dim() != 1 or advantages.shape[0] != num_seqs:
        raise ValueError(f"advantages must have shape [B]={num_seqs} (or [B, T] for the methods that take "
                         f"per-token advantages), got {tuple(advantages.shape)}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be floating point, got {advantages.dtype}")


def policy_loss(
    algo: str | AlgoSpec,
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = None,
    ref_logp_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    aggregation: str | None = None,
    loss_scale_factor: float | None = None,
    options: Mapping[str, Any] | None = None,
    max_log_ratio: float = 20.0,
    is_weights_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of `algo` (negative objective, 0-dim) and its metrics.

    Args:
        algo: a registered algorithm's name, a plug-in `module:Spec` / `file.py:Spec`, or an `AlgoSpec`
            (`moe_gspo.algos.registry`).
        logp_BT: [B, T] log-probs of the sampled response tokens under the current policy (grad).
        old_logp_BT: [B, T] log-probs under the policy that sampled them (constant).
        advantages: [B] per-sequence, or [B, T] per-token (not gspo, gmpo).
        mask_BT: [B, T] bool or 0/1 mask of valid response tokens (nonzero = valid).
        clip_low, clip_high: the clip range (meaning per algorithm: `AlgoSpec.clip`); None for sapo.
        ref_logp_BT: [B, T] reference-policy log-probs, needed when kl_coef > 0.
        kl_coef: weight of the KL penalty added to the loss.
        kl_estimator: "k1", "k2" or "k3" (`moe_gspo.algos.kl`).
        loss_agg_mode: see `moe_gspo.algos.aggregation`; None = the algorithm's default.
        aggregation: the old name: "seq_mean" or "token_mean" (aliases of loss_agg_mode).
        loss_scale_factor: the constant L of seq-mean-token-sum-norm (required there only).
        options: the algorithm's own options by name (`AlgoSpec.options`, e.g. sapo's
            `{"tau_pos": 1.0, "tau_neg": 1.05}`); an option left out takes its default, a name the spec
            does not declare or a value out of its bounds is a ValueError. All of them reach its terms
            function as keywords.
        max_log_ratio: clamp of per-token log ratios before exp.
        is_weights_BT: [B, T] rollout-correction weights (constants) multiplying the policy-gradient
            term of each token; None = all 1.
        entropy_BT: [B, T] per-token entropy of the current policy (differentiable), needed when
            entropy_coef > 0.
        entropy_coef: weight of the entropy bonus subtracted from the loss.

    Returns:
        (loss, metrics): see the module docstring for the metric keys.
    """
    check_token_tensors(mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT, ref_logp_BT=ref_logp_BT,
                        is_weights_BT=is_weights_BT, entropy_BT=entropy_BT)
    check_max_log_ratio(max_log_ratio)
    spec = algo if isinstance(algo, AlgoSpec) else get_algo(algo)
    mode = spec.resolve_mode(loss_agg_mode, aggregation)
    agg.check_loss_scale_factor(mode, loss_scale_factor)
    _check_clip(spec, clip_low, clip_high)
    _check_advantages(spec, advantages, mask_BT)
    if not float(kl_coef) >= 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if float(kl_coef) > 0.0 and ref_logp_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logp_BT (reference-policy log-probs [B, T]); pass it or set kl_coef=0")
    if not float(entropy_coef) >= 0.0:
        raise ValueError(f"entropy_coef must be >= 0, got {entropy_coef}")
    if float(entropy_coef) > 0.0 and entropy_BT is None:
        raise ValueError("entropy_coef > 0 needs entropy_BT (the current policy's per-token entropy [B, T])")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    own = spec.resolve_options(options, prefix="options.")  # the spec's options, checked, defaults filled in

    inp = prepare(logp_BT, old_logp_BT, advantages, mask_BT, is_weights_BT=is_weights_BT,
                  max_log_ratio=max_log_ratio)
    terms = call_terms(spec, inp, clip_low=clip_low, clip_high=clip_high, **own)  # a plug-in: one-line errors

    def aggregate(values_BT: torch.Tensor) -> torch.Tensor:
        return agg.aggregate(values_BT, inp.mask, mode, loss_scale_factor=loss_scale_factor)

    if terms.objective_B is not None:
        objective = inp.seq_mean(terms.objective_B)
    else:
        objective = aggregate(terms.objective_BT)
    loss_policy = -objective
    loss = loss_policy
    kl = None
    if ref_logp_BT is not None:
        ref = torch.where(inp.mask, ref_logp_BT.detach().to(inp.dtype), 0.0)
        kl = aggregate(kl_estimate(inp.logp, ref, inp.mask, kl_estimator, max_log_ratio=inp.limit))
        if float(kl_coef) > 0.0:
            loss = loss_policy + float(kl_coef) * kl
    entropy = None
    if entropy_BT is not None:
        entropy = aggregate(torch.where(inp.mask, entropy_BT.to(inp.dtype), 0.0))
        if float(entropy_coef) > 0.0:
            loss = loss - float(entropy_coef) * entropy

    metrics = {"loss/policy": loss_policy.detach().double(), "loss/total": loss.detach().double()}
    if kl is not None:
        metrics["loss/kl"] = kl.detach().double()
    if entropy is not None:
        metrics["loss/entropy"] = entropy.detach().double()
    metrics.update(terms.metrics)
    metrics.update(ratio_stats(logp_BT, old_logp_BT, mask_BT, max_log_ratio=inp.limit))
    return loss, metrics

"""The sentences at the top of a run report: one per question the run answers, computed from its
metrics and stated as facts of this run (means over the logged steps), or saying what is missing.

- Routing: how often the rollout engine and the learner (natural routing) route the same response
  token differently (`routing/any_layer_flip`, and per MoE layer `routing/layer_disagree`).
- Rollout/learner ratio: token- vs sequence-level variance of the learner-old / rollout-engine
  probability ratio (`mismatch_ratio/token_var` ÷ `mismatch_ratio/seq_var`).
- New/old ratio: the same for the policy ratio inside the update (`ratio/token_var` ÷ `ratio/seq_var`).
- Did the drift matter (these open the report): the share of the learner/rollout token-ratio variance that
  the routing-flipped tokens carried next to their share of the tokens
  (`mismatch_ratio/token_var_share_flipped`, `mismatch_ratio/flipped_token_frac`); whether steps with more
  flips clipped more (Spearman correlation over steps of `routing/any_layer_flip` and `clip/token_frac`); and
  whether they were followed by a different change in reward (Spearman of `routing/any_layer_flip` at step t
  and `reward/mean`[t+1] − `reward/mean`[t]). The tests are two-sided with scipy's p-value; p ≥ 0.05 is
  worded "no association detected", never "did not matter", and an association is called a correlation
  across steps (a trend shared over training produces one too), not a cause. Fewer than
  `MIN_TEST_STEPS` paired steps, or a series that never varied, is said instead of a test.

The variance ratios are ratios of means, as in `analysis.load.headline_numbers`, so the sentences and
the headline table give the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from analysis.load import RunData, finite_mean, matrix_series, ratio_of_means, series, trace_layer_ids
from analysis.r3_report import r3_sentence


def _pct(fraction: float) -> str:
    """A fraction as a percentage with 3 significant digits: 0.01234 -> '1.23%'."""
    return f"{100 * fraction:.3g}%"


def _num(v: float) -> str:
    return f"{v:.3g}"


def _finite(records: list[dict[str, Any]], key: str) -> np.ndarray:
    vals = series(records, key)[1]
    return vals[np.isfinite(vals)]


def routing_sentence(records: list[dict[str, Any]], layer_ids: list[int] | None = None) -> str:
    """'Routing: X% of response tokens ... (per MoE layer Y% (layer a) to Z% (layer b))'; the per-layer
    part is the lowest and highest per-layer mean over steps of routing/layer_disagree. `layer_ids`
    names the layers (model layer ids, e.g. from the traces; default: their index)."""
    flips = _finite(records, "routing/any_layer_flip")
    if flips.size == 0:
        return ("Routing, rollout engine vs learner: not measured (routing/any_layer_flip was never logged, "
                "so the rollout engine's routes were not compared with the learner's).")
    text = (f"Routing: {_pct(flips.mean())} of response tokens were routed differently by the rollout engine "
            "and the learner (natural routing) in at least one MoE layer (routing/any_layer_flip, mean over "
            f"{flips.size} step{'s' if flips.size != 1 else ''})")
    _, vals_SL = matrix_series(records, "routing/layer_disagree")
    layer_means = np.asarray([finite_mean(vals_SL[:, i]) for i in range(vals_SL.shape[1])]) if vals_SL.size \
        else np.zeros(0)
    ok = np.flatnonzero(np.isfinite(layer_means))
    if ok.size == 0:
        return text + "; per-layer disagreement not logged (routing/layer_disagree)."
    names = layer_ids if layer_ids is not None and len(layer_ids) == layer_means.size \
        else list(range(layer_means.size))
    lo, hi = ok[np.argmin(layer_means[ok])], ok[np.argmax(layer_means[ok])]
    if ok.size == 1:
        return text + f"; in its one MoE layer with data (layer {names[lo]}): {_pct(layer_means[lo])}."
    return (text + f"; per MoE layer {_pct(layer_means[lo])} (layer {names[lo]}) to {_pct(layer_means[hi])} "
            f"(layer {names[hi]}) (routing/layer_disagree, mean over steps).")


def variance_sentence(records: list[dict[str, Any]], prefix: str, what: str) -> str:
    """'<what>: the token-level ratio had N× the variance of the sequence-level one (mean
    <prefix>/token_var A ÷ mean <prefix>/seq_var B).' `prefix` is 'mismatch_ratio' or 'ratio'."""
    tok_key, seq_key = f"{prefix}/token_var", f"{prefix}/seq_var"
    tok, seq = finite_mean(_finite(records, tok_key)), finite_mean(_finite(records, seq_key))
    missing = [k for k, v in ((tok_key, tok), (seq_key, seq)) if not math.isfinite(v)]
    if missing:
        return f"{what}: token- vs sequence-ratio variance not measured ({' and '.join(missing)} never logged)."
    ratio = ratio_of_means(tok, seq)
    if not math.isfinite(ratio):
        return (f"{what}: the sequence-level ratio's variance was {_num(seq)} on average (mean {seq_key}), so "
                f"the token-level one's ({_num(tok)}, mean {tok_key}) cannot be expressed as a multiple of it.")
    return (f"{what}: the token-level ratio had {_num(ratio)}× the variance of the length-normalised "
            f"sequence-level ratio (mean {tok_key} {_num(tok)} ÷ mean {seq_key} {_num(seq)}).")


MIN_TEST_STEPS = 8
"""The fewest paired steps on which the drift sentences run a correlation test."""
ALPHA = 0.05

FLIP_KEY, CLIP_KEY, REWARD_KEY = "routing/any_layer_flip", "clip/token_frac", "reward/mean"
SHARE_KEY, FLIPPED_FRAC_KEY = "mismatch_ratio/token_var_share_flipped", "mismatch_ratio/flipped_token_frac"


def _by_step(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    """{step: finite value of the scalar `key`} (the last record of a step wins)."""
    steps, vals = series(records, key)
    return {int(s): float(v) for s, v in zip(steps, vals) if math.isfinite(v)}


def spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(Spearman ρ, two-sided p) of paired samples (scipy's, t-distribution p); NaNs when either is constant."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan, math.nan
    res = spearmanr(x, y)
    return float(res.statistic), float(res.pvalue)


def _association(x: np.ndarray, y: np.ndarray, x_name: str, y_name: str, unit: str) -> str:
    """The test's clause: 'no association detected (Spearman ρ = …, p = …, n = … steps)', 'a positive /
    negative association (…)', or why no test was run."""
    n = int(x.size)
    if n < MIN_TEST_STEPS:
        return f"too few {unit} to test ({n} with both {x_name} and {y_name}; at least {MIN_TEST_STEPS} needed)"
    for vals, name in ((x, x_name), (y, y_name)):
        if np.ptp(vals) == 0:
            return f"not testable: {name} was {_num(float(vals[0]))} on all {n} {unit}"
    rho, p = spearman(x, y)
    stats = f"Spearman ρ = {rho:.2f}, p = {p:.2g}, n = {n} {unit}"
    if p < ALPHA:
        return (f"a {'positive' if rho > 0 else 'negative'} association ({stats}; a correlation across steps, "
                "which a trend shared over training also produces, not evidence of cause)")
    return f"no association detected ({stats})"


def drift_variance_sentence(records: list[dict[str, Any]]) -> str:
    """'Drift and ratio variance: tokens routed differently ... were A% of the response tokens and carried B% of
    the learner/rollout token-ratio variance (B/A = k× their share ...)': means over the steps whose variance
    share is defined (steps with a flipped token)."""
    share, frac = _by_step(records, SHARE_KEY), _by_step(records, FLIPPED_FRAC_KEY)
    steps = sorted(set(share) & set(frac))
    if not steps:
        missing = SHARE_KEY if not share else FLIPPED_FRAC_KEY
        return ("Drift and ratio variance: not measured (no step with both " + SHARE_KEY + " and "
                + FLIPPED_FRAC_KEY + f"; {missing} " + ("never logged or never defined" if not share
                                                         else "never logged") + ").")
    s, f = float(np.mean([share[k] for k in steps])), float(np.mean([frac[k] for k in steps]))
    text = (f"Drift and ratio variance: tokens routed differently in at least one MoE layer were {_pct(f)} of "
            f"the response tokens and carried {_pct(s)} of the learner/rollout token-ratio variance (means over "
            f"the {len(steps)} step{'s' if len(steps) != 1 else ''} with such tokens of {FLIPPED_FRAC_KEY} and "
            f"{SHARE_KEY})")
    if f > 0:
        text += f", {_num(s / f)}× their share of the tokens"
    return text + "."


def drift_clip_sentence(records: list[dict[str, Any]]) -> str:
    """'Drift and clipping, per-step flip rate vs clipped-token fraction: <association>.'"""
    flips, clip = _by_step(records, FLIP_KEY), _by_step(records, CLIP_KEY)
    missing = [k for k, v in ((FLIP_KEY, flips), (CLIP_KEY, clip)) if not v]
    if missing:
        return f"Drift and clipping: not tested ({' and '.join(missing)} never logged)."
    steps = sorted(set(flips) & set(clip))
    x, y = np.asarray([flips[k] for k in steps]), np.asarray([clip[k] for k in steps])
    return (f"Drift and clipping, per-step share of routing-flipped tokens ({FLIP_KEY}) vs share of "
            f"clipped tokens ({CLIP_KEY}): " + _association(x, y, FLIP_KEY, CLIP_KEY, "steps") + ".")


def drift_reward_sentence(records: list[dict[str, Any]]) -> str:
    """'Drift and reward, flip rate of step t vs the change of reward/mean from t to t + 1: <association>.'"""
    flips, reward = _by_step(records, FLIP_KEY), _by_step(records, REWARD_KEY)
    missing = [k for k, v in ((FLIP_KEY, flips), (REWARD_KEY, reward)) if not v]
    if missing:
        return f"Drift and reward: not tested ({' and '.join(missing)} never logged)."
    steps = [k for k in sorted(flips) if k in reward and k + 1 in reward]
    x = np.asarray([flips[k] for k in steps])
    y = np.asarray([reward[k + 1] - reward[k] for k in steps])
    return (f"Drift and reward, a step's share of routing-flipped tokens ({FLIP_KEY}) vs the change of "
            f"{REWARD_KEY} from that step to the next: "
            + _association(x, y, FLIP_KEY, "the reward change", "step pairs") + ".")


def drift_verdicts(records: list[dict[str, Any]]) -> list[str]:
    """Whether the rollout/learner routing drift mattered: ratio variance, clipping, reward."""
    return [drift_variance_sentence(records), drift_clip_sentence(records), drift_reward_sentence(records)]


def run_verdicts(run: RunData) -> list[str]:
    """The report's verdict sentences, in order: whether drift mattered (`drift_verdicts`), whether routing
    replay worked (R3 runs, `analysis.r3_report`), routing, rollout/learner ratio, new/old ratio."""
    r3 = r3_sentence(run.records)  # R3 runs: did the replay work (issue 49)
    return [*drift_verdicts(run.records), *([r3] if r3 else []), routing_sentence(run.records, trace_layer_ids(run)),
            variance_sentence(run.records, "mismatch_ratio",
                              "Rollout/learner ratio (learner before the update vs rollout engine, natural routing)"),
            variance_sentence(run.records, "ratio", "New/old policy ratio (inside the update)")]

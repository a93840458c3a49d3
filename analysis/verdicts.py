"""The sentences at the top of a run report: one per question the run answers, computed from its
metrics and stated as facts of this run (means over the logged steps), or saying what is missing.

- Routing: how often the rollout engine and the learner (natural routing) route the same response
  token differently (`routing/any_layer_flip`, and per MoE layer `routing/layer_disagree`).
- Rollout/learner ratio: token- vs sequence-level variance of the learner-old / rollout-engine
  probability ratio (`mismatch_ratio/token_var` ÷ `mismatch_ratio/seq_var`).
- New/old ratio: the same for the policy ratio inside the update (`ratio/token_var` ÷ `ratio/seq_var`).

The variance ratios are ratios of means, as in `analysis.load.headline_numbers`, so the sentences and
the headline table give the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from analysis.load import RunData, finite_mean, matrix_series, ratio_of_means, series, trace_layer_ids


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


def run_verdicts(run: RunData) -> list[str]:
    """The report's verdict sentences, in order: routing, rollout/learner ratio, new/old ratio."""
    return [routing_sentence(run.records, trace_layer_ids(run)),
            variance_sentence(run.records, "mismatch_ratio",
                              "Rollout/learner ratio (learner before the update vs rollout engine, natural routing)"),
            variance_sentence(run.records, "ratio", "New/old policy ratio (inside the update)")]

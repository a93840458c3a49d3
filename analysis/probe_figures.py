"""The probe report's figures (`python -m moe_gspo.probe` JSON -> `analysis.report`): per-layer routing
disagreement, expert load, and the variance attribution of the learner/rollout token ratios. Built with
the helpers of `analysis.figures`, rendered by its `render_figures`."""

from __future__ import annotations

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure

from analysis.figure_kit import (
    FigureSpec, SkipFigure, _fig, _legend_below, _wrapped_title, layer_axis_label, layer_labels,
)
from analysis.figures import _load_heatmaps
from analysis.load import probe_value


def _probe_list(probe: dict, key: str) -> np.ndarray:
    if key not in probe:
        raise SkipFigure(f"probe has no '{key}'")
    try:
        return np.asarray(probe[key], np.float64)
    except (TypeError, ValueError) as e:
        raise SkipFigure(f"probe '{key}' is not numeric: {e}") from e


def fig_probe_layer_disagree(probe: dict) -> Figure:
    vals_L = _probe_list(probe, "routing/layer_disagree")
    labels = layer_labels(None, vals_L.size, probe)
    width = max(4.0, 0.3 * len(labels) + 2.5)
    fig, (ax,) = _fig(width=width)
    sns.barplot(x=labels, y=vals_L, ax=ax, color="C0")
    ax.set(xlabel=layer_axis_label(labels), ylabel="fraction of tokens")
    _wrapped_title(ax, "Per-layer routing disagreement, rollout engine vs learner", width)
    return fig


def fig_probe_expert_load(probe: dict) -> Figure:
    ro = _probe_list(probe, "routing/expert_load_rollout")
    le = _probe_list(probe, "routing/expert_load_learner")
    if ro.ndim != 2 or ro.shape != le.shape:
        raise SkipFigure(f"expert load shapes {ro.shape} / {le.shape} are not equal [L, E]")
    return _load_heatmaps(ro, le, layer_labels(None, ro.shape[0], probe), "probe")


def fig_probe_variance(probe: dict) -> Figure:
    """Bars: each token set's share of the token-ratio variance. The token fraction is not a third bar
    on that axis: a dashed mark on each bar shows the token set's share of the tokens, i.e. the
    variance share it would carry if its tokens varied like the others."""
    shares = [("routing flipped", probe_value(probe, "ratio/token_var_share_flipped")),
              ("routing agreed", probe_value(probe, "ratio/token_var_share_agreed"))]
    if not any(np.isfinite(v) for _, v in shares):
        raise SkipFigure("probe has no variance-share keys (ratio/token_var_share_flipped / _agreed)")
    fig, (ax,) = _fig(width=5.0)
    sns.barplot(x=[k for k, _ in shares], y=[0.0 if not np.isfinite(v) else v for _, v in shares], ax=ax,
                color="C2", label="share of the token-ratio variance")
    flipped = probe_value(probe, "ratio/flipped_token_frac")
    if np.isfinite(flipped):
        for x, frac in enumerate((flipped, 1.0 - flipped)):
            ax.hlines(frac, x - 0.4, x + 0.4, colors="k", linestyles="--", linewidth=1.2,
                      label="share of the tokens" if x == 0 else None)
    ax.set_ylim(0, 1)
    _legend_below(ax)
    ax.set(title="Learner/rollout token-ratio variance by routing", xlabel="response tokens whose routing",
           ylabel="fraction of the total")
    return fig


PROBE_FIGURES: list[FigureSpec] = [
    FigureSpec("probe_layer_disagree", "Probe: routing disagreement per layer",
               "Fraction of probed tokens whose top-k set differs between engine and learner.",
               fig_probe_layer_disagree),
    FigureSpec("probe_expert_load", "Probe: expert load (rollout, learner, difference)",
               "Share of routings per expert and layer in the probe.", fig_probe_expert_load),
    FigureSpec("probe_variance_attribution", "Probe: variance attribution",
               "Share of the learner/rollout token-ratio sum of squared deviations on response tokens with "
               "a routing flip and on tokens routed identically (bars); the dashed mark on each bar is that "
               "set's share of the tokens, the share it would carry at the average variance.",
               fig_probe_variance),
]


# --------------------------------------------------------------------------- rendering

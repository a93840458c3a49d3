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
    shares = [("routing flipped", probe_value(probe, "mismatch_ratio/token_var_share_flipped")),
              ("routing agreed", probe_value(probe, "mismatch_ratio/token_var_share_agreed"))]
    if not any(np.isfinite(v) for _, v in shares):
        raise SkipFigure("probe has no variance-share keys (mismatch_ratio/token_var_share_flipped / _agreed)")
    fig, (ax,) = _fig(width=5.0)
    sns.barplot(x=[k for k, _ in shares], y=[0.0 if not np.isfinite(v) else v for _, v in shares], ax=ax,
                color="C2", label="share of the token-ratio variance")
    flipped = probe_value(probe, "mismatch_ratio/flipped_token_frac")
    if np.isfinite(flipped):
        for x, frac in enumerate((flipped, 1.0 - flipped)):
            ax.hlines(frac, x - 0.4, x + 0.4, colors="k", linestyles="--", linewidth=1.2,
                      label="share of the tokens" if x == 0 else None)
    ax.set_ylim(0, 1)
    _legend_below(ax)
    ax.set(title="Learner/rollout token-ratio variance by routing", xlabel="response tokens whose routing",
           ylabel="fraction of the total")
    return fig


LOCALIZE_FLOOR = 1e-12
"""Where the depth figure draws an exact zero (bitwise equal) on its log axis."""


def fig_probe_localize_depth(probe: dict) -> Figure:
    """The divergence localiser's depth profile (`python -m moe_gspo.probe --localize`): per compared tensor,
    the relative error max |delta| / max |learner| against the layer (log y; exact zeros drawn at
    `LOCALIZE_FLOOR` with hollow markers; top-k ids: the share of rows whose sets differ), the tolerance
    dashed, the first divergence circled."""
    rel = probe.get("localize/rel_err")
    if not isinstance(rel, dict) or not rel:
        raise SkipFigure("probe has no 'localize/rel_err' (run the probe with --localize)")
    layer_ids = list(probe.get("localize/layer_ids") or range(max(len(v) for v in rel.values())))
    fig, (ax,) = _fig(width=6.5, height=3.8)
    x_final = len(layer_ids)
    for c, (name, vals) in enumerate(rel.items()):
        pts = [(j, v) for j, v in enumerate(vals) if v is not None]
        if not pts:
            continue
        xs = np.array([j for j, _ in pts], float)
        ys = np.array([v for _, v in pts], float)
        ax.plot(xs, np.where(ys > 0, ys, LOCALIZE_FLOOR), marker="o", color=f"C{c}", label=name,
                markerfacecolor="none" if name == "topk_ids" else f"C{c}")
    final = probe.get("localize/final") or {}
    for c, (name, d) in enumerate(final.items(), start=len(rel)):
        v = (d or {}).get("rel_err")
        if v is not None:
            ax.plot([x_final], [v if v > 0 else LOCALIZE_FLOOR], marker="s", linestyle="none", color=f"C{c}",
                    label=name)
    tol = probe.get("localize/tol")
    if isinstance(tol, (int, float)):
        ax.axhline(tol, color="k", linestyle="--", linewidth=1, label=f"tolerance {tol:g}")
    first = probe.get("localize/first_divergence")
    if isinstance(first, dict) and first.get("rel_err"):
        xf = x_final if first["layer"] == "final" else layer_ids.index(first["layer"])
        ax.plot([xf], [first["rel_err"]], marker="o", markersize=14, markerfacecolor="none", color="red",
                linestyle="none", label=f"first divergence: {first['tensor']}")
    ax.set_yscale("log")
    ax.set_xticks(list(range(len(layer_ids))) + ([x_final] if final else []),
                  [str(i) for i in layer_ids] + (["final"] if final else []))
    ax.set(xlabel="decoder layer", ylabel="max |delta| / max |learner|  (0 drawn at 1e-12)")
    _wrapped_title(ax, "Divergence localiser: rollout vs learner relative error by depth", 6.5)
    _legend_below(ax)
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
    FigureSpec("probe_localize_depth", "Probe: divergence localiser by depth",
               "Relative error (max |delta| / max |learner tensor|) of each compared tensor, rollout engine vs "
               "learner, per decoder layer, for the same tokens (probe --localize); exact zeros at 1e-12; the "
               "first (layer, tensor) above the tolerance circled.", fig_probe_localize_depth,
               applies=lambda probe: "localize/rel_err" in probe),
]


# --------------------------------------------------------------------------- rendering

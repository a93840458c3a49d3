"""Experiment 5's figure: each method's routing-induced gradient error (`grad_err_routing`, ||g - g_ref|| / ||g_ref||
against the same method's gradient with the routing change removed) against the three axes of the pre-registered
exponents: the mini-batch index k (staleness), the response length and the MoE depth; one line per method, log axes.

What a point is: per seed, the mean of the metric over that seed's rows at the axis value (rows k >= 1, every other
setting pooled: the step's mean relative error, as the tests' cells average it), then the mean over seeds with its
95% t CI (`analysis.stats.one_sample`, the tests' across-seed step): the seed is the unit of replication, as in
the tests. The lines describe; the exponents with their CIs are the tests' (tests.md). Unclipped variants are dashed
(GRPO's clip rarely acts at this lr, so GRPO and GRPO-noclip overlap). GRPO+R2 is its own reference (0 by
construction) and is left out, as are methods without a finite positive value.

Written by `python -m analysis.mechanism_tests ROWS --figure PNG` (temp file, then rename); `curves` returns what is
drawn, so a test can check the figure's data against the rows.
"""

from __future__ import annotations

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure

from analysis.stats import one_sample

FIGURE_AXES = ("k", "length", "depth")
"""The panels, left to right: staleness (T5), length (T1, T3), depth (T2, T4)."""

_AXIS_LABEL = {"k": "mini-batch index k (updates since pi_old)", "length": "response length L (tokens)",
               "depth": "MoE layers"}


def curves(rows: list[dict], axis: str, metric: str = "grad_err_routing") -> dict[str, dict[str, np.ndarray]]:
    """Per method (sorted), the arrays `x` (the axis values), `mean`, `lo`, `hi` (over seeds, 95% t CI) and `n`
    (seeds) of the per-seed mean of `metric` at each axis value, over rows with k >= 1 and a finite metric."""
    import pandas as pd

    if axis not in FIGURE_AXES:
        raise ValueError(f"axis {axis!r}: the figure's axes are {', '.join(FIGURE_AXES)}")
    df = pd.DataFrame(rows)
    if metric not in df:
        return {}
    df = df[df["k"] >= 1].copy()
    df[metric] = df[metric].astype(float)
    df = df[np.isfinite(df[metric])]
    out = {}
    for method in sorted(df["method"].unique()):
        d = df[df["method"] == method]
        if not (d[metric] > 0).any():  # 0 by construction (GRPO+R2): nothing to draw on a log axis
            continue
        per_seed = d.groupby([axis, "seed"])[metric].mean()
        xs, stats = [], []
        for x in sorted(d[axis].unique()):
            xs.append(x)
            stats.append(one_sample(per_seed.loc[x].to_numpy()))
        out[method] = {"x": np.asarray(xs, float), **{k: np.asarray([s[k] for s in stats], float)
                                                      for k in ("mean", "lo", "hi", "n")}}
    return out


def mechanism_figure(rows: list[dict], metric: str = "grad_err_routing") -> Figure:
    """Three panels (`FIGURE_AXES`), one line per method with its 95% t band over seeds; log-log."""
    fig = Figure(figsize=(13.0, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(FIGURE_AXES), sharey=True)
    per_axis = {a: curves(rows, a, metric) for a in FIGURE_AXES}
    methods = sorted({m for c in per_axis.values() for m in c})
    palette = dict(zip(methods, sns.color_palette("tab10", n_colors=max(len(methods), 1))))
    seeds = sorted({int(r["seed"]) for r in rows})
    for ax, axis in zip(axes, FIGURE_AXES):
        for method, c in per_axis[axis].items():
            ok = np.isfinite(c["mean"]) & (c["mean"] > 0)
            ax.plot(c["x"][ok], c["mean"][ok], marker="o", ms=3.5, color=palette[method], label=method,
                    ls="--" if method.endswith("-noclip") else "-")
            band = ok & np.isfinite(c["lo"]) & np.isfinite(c["hi"])
            lo = np.where(c["lo"] > 0, c["lo"], c["mean"] * 1e-3)  # a t band can cross 0: clip it for the log axis
            ax.fill_between(c["x"][band], lo[band], c["hi"][band], color=palette[method], alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(_AXIS_LABEL[axis])
        xs = sorted({float(x) for c in per_axis[axis].values() for x in c["x"]})
        if xs and len(xs) <= 8:
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
    means = np.concatenate([c["mean"] for cs in per_axis.values() for c in cs.values()] or [np.ones(1)])
    means = means[np.isfinite(means) & (means > 0)]
    if means.size:  # the means set the range; a wide band (few seeds) is cut at a quarter of the smallest mean
        axes[0].set_ylim(bottom=float(means.min()) / 4)
    axes[0].set_ylabel(f"{metric} (mean over seeds, 95% t CI)")
    if methods:
        axes[-1].legend(fontsize=8, loc="best")
    fig.suptitle(f"Routing-induced gradient error per method, {len(seeds)} seed(s) "
                 f"({seeds[0] if seeds else ''}-{seeds[-1] if seeds else ''}); rows k >= 1, other settings pooled",
                 fontsize=10)
    return fig


def drawn_lines(fig: Figure) -> dict[str, dict[str, np.ndarray]]:
    """Per panel axis name, per method label, the (x, y) drawn: what `mechanism_figure` put on the figure."""
    out = {}
    for ax, axis in zip(fig.axes, FIGURE_AXES):
        out[axis] = {ln.get_label(): np.vstack([ln.get_xdata(), ln.get_ydata()]).astype(float)
                     for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    return out

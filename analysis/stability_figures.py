"""Report figures an MoE infrastructure team reaches for when validating stability (issue 41).

- `extreme_frac_curve`: F(tau), the Rollout Routing Replay paper's extreme-token fraction curve (Ma et al.
  2025, arXiv 2510.11370): the share of response tokens whose rollout/learner probability ratio lies beyond
  tau, from `mismatch/extreme_frac_curve` (and `mismatch_replayed/extreme_frac_curve` under R3), the mean
  over the run's steps and over its last 10% of steps, against tau on the grid
  `moe_gspo.algos.mismatch.EXTREME_TAUS`.

`STABILITY_FIGURES` lists them as `analysis.figure_kit.FigureSpec`s for `analysis.report`; each is left out
silently for runs that never logged its metric (runs from before issue 41). `mean_curve` is shared with the
comparison report (`analysis.compare`, one line per arm).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from analysis.figure_kit import FigureSpec, SkipFigure, _fig, _legend_below, positive_or_nan
from analysis.load import RunData
from moe_gspo.algos.mismatch import EXTREME_TAUS

CURVE_KEY = "mismatch/extreme_frac_curve"
CURVE_KEY_REPLAYED = "mismatch_replayed/extreme_frac_curve"


def logged(run: RunData, key: str) -> bool:
    """Whether some step of the run logged `key`."""
    return any(key in r for r in run.records)


def curve_rows(records: list[dict], key: str, taus=EXTREME_TAUS) -> np.ndarray:
    """float64 [S, len(taus)]: the steps' F(tau) lists of `key` that have one value per tau (others, e.g. a
    run with another grid, are left out); nulls become NaN."""
    rows = []
    for r in records:
        v = r.get(key)
        if isinstance(v, list) and len(v) == len(taus):
            rows.append([np.nan if x is None else float(x) for x in v])
    return np.asarray(rows, np.float64).reshape(-1, len(taus))


def mean_curve(records: list[dict], key: str, *, last_frac: float | None = None) -> np.ndarray | None:
    """F(tau) averaged over steps (each step weighs the same; NaN steps left out), over the last
    `last_frac` of the logged steps when given; None when no step logged a curve."""
    rows = curve_rows(records, key)
    if not rows.shape[0]:
        return None
    if last_frac is not None:
        rows = rows[-max(1, int(round(rows.shape[0] * last_frac))):]
    with np.errstate(all="ignore"):
        finite = np.isfinite(rows)
        return np.where(finite.any(0), np.nansum(rows, 0) / np.maximum(finite.sum(0), 1), np.nan)


def tau_axis(ax) -> None:
    """The tau axis of an F(tau) plot: log scale, ticks at the grid's values."""
    ax.set_xscale("log")
    ax.set_xticks(list(EXTREME_TAUS), [f"{t:g}" for t in EXTREME_TAUS])
    ax.minorticks_off()
    ax.set_xlabel("τ (probability ratio bound)")


def fig_extreme_frac_curve(run: RunData) -> Figure:
    curves = [(CURVE_KEY, None, "natural routing, all steps", "C0", "-"),
              (CURVE_KEY, 0.1, "natural routing, last 10% of steps", "C0", "--"),
              (CURVE_KEY_REPLAYED, None, "replaying the rollout routes (R3), all steps", "C1", "-"),
              (CURVE_KEY_REPLAYED, 0.1, "replaying the rollout routes (R3), last 10% of steps", "C1", "--")]
    fig, (ax,) = _fig(width=6.4, height=3.8)
    drawn = 0
    values = []
    for key, last, label, color, style in curves:
        y = mean_curve(run.records, key, last_frac=last)
        if y is None or not np.isfinite(y).any():
            continue
        values.append(y)
        ax.plot(EXTREME_TAUS, positive_or_nan(y), marker="o", markersize=3, color=color, linestyle=style, label=label)
        drawn += 1
    if not drawn:
        raise SkipFigure(f"'{CURVE_KEY}' has no step with one finite value per τ of {list(EXTREME_TAUS)}")
    if any(np.nanmax(v) > 0 for v in values):
        ax.set_yscale("log")
    tau_axis(ax)
    for t in (2.0, 5.0):
        ax.axvline(t, color="0.6", linewidth=0.8, linestyle=":")
    ax.set(ylabel="F(τ): share of response tokens", title="Extreme-token fraction F(τ), rollout vs learner")
    _legend_below(ax)
    return fig


STABILITY_FIGURES: list[FigureSpec] = [
    FigureSpec("extreme_frac_curve", "Extreme-token fraction curve F(τ)",
               "F(τ) = share of response tokens with |log p_learner − log p_rollout| > ln τ (the R3 paper's "
               "extreme-token curve; mismatch/extreme_frac_curve), mean over steps (each step weighs the same) "
               "and over the last 10% of steps; under R3 also for the pass replaying the rollout routes. "
               "Dotted: τ = 2 and 5, the points logged as mismatch/extreme_frac_ln2 and _ln5. Points at 0 are "
               "left out of the log scale.", fig_extreme_frac_curve, applies=lambda run: logged(run, CURVE_KEY)),
]

"""The staleness figure (issue 47, experiment 3S): against N, the mini-batches (optimizer steps) per rollout on a
log2 axis, one line per method: left, the final reward; right, the experts changed by the first update (solid)
and by all N updates (dashed). Points: mean over seeds with a seed-bootstrap 95% CI. A Matplotlib `Figure` (no
pyplot state); `write_figures` saves the PNG (temp file, then rename).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure

from analysis import stats as st
from analysis.figure_kit import save_png
from analysis.phase_runs import PhaseRun


def _series(by_n, key: str, reps: int, seed: int, *names) -> tuple[list[int], np.ndarray, np.ndarray]:
    ns, pts, err = [], [], []
    for n, arm in by_n.items():
        vals = [r.scores[key] for r in arm.values() if math.isfinite(r.scores[key])]
        if not vals:
            continue
        e = st.bootstrap_ci(vals, how="mean", reps=reps, seed=st.stream_seed(seed, "fig", *names, n, key))
        ns.append(n), pts.append(e.point), err.append((e.point - e.lo, e.hi - e.point))
    err_2N = np.asarray(err, np.float64).T if err else np.zeros((2, 0))
    return ns, np.asarray(pts, np.float64), np.where(np.isfinite(err_2N), err_2N, 0.0)


def staleness_figure(by_method: Mapping[str, Mapping[int, Mapping[int, PhaseRun]]], *, reps: int = 2000,
                     seed: int = 0) -> Figure:
    """`by_method`: method -> N -> seed -> run (`analysis.staleness.staleness_arms`)."""
    fig = Figure(figsize=(11.0, 4.2), dpi=100, layout="constrained")
    ax_r, ax_e = fig.subplots(1, 2)
    palette = dict(zip(by_method, sns.color_palette("tab10", n_colors=len(by_method))))
    all_n = sorted({n for by_n in by_method.values() for n in by_n})
    for method, by_n in by_method.items():
        color = palette[method]
        ns, y, err = _series(by_n, "final_reward", reps, seed, method)
        ax_r.errorbar(ns, y, yerr=err, marker="o", capsize=3, color=color, label=method)
        for key, ls, what in (("expert_change", "-", "first update"), ("expert_change_all", "--", "all N updates")):
            ns, y, err = _series(by_n, key, reps, seed, method)
            if ns:
                ax_e.errorbar(ns, y, yerr=err, marker="o", capsize=3, color=color, ls=ls, label=f"{method}, {what}")
    for ax in (ax_r, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_n, [str(n) for n in all_n])
        ax.set_xlabel("mini-batches (optimizer steps) per rollout N")
        ax.legend(fontsize="x-small")
    ax_r.set(ylabel="final reward (last 10% of steps)", title="Final reward against staleness")
    ax_e.set(ylabel="share of activated experts changed", title="Experts changed per update (learner, natural routing)")
    return fig


def write_figures(by_method: Mapping[str, Mapping[int, Mapping[int, PhaseRun]]], out_dir: str | Path, *,
                  reps: int = 2000, seed: int = 0) -> list[Path]:
    return [save_png(staleness_figure(by_method, reps=reps, seed=seed), out_dir, "staleness.png")]

"""Report figures an MoE infrastructure team reaches for when validating stability (issue 41).

- `extreme_frac_curve`: F(tau), the Rollout Routing Replay paper's extreme-token fraction curve (Ma et al.
  2025, arXiv 2510.11370): the share of response tokens whose rollout/learner probability ratio lies beyond
  tau, from `mismatch/extreme_frac_curve` (and `mismatch_replayed/extreme_frac_curve` under R3), the mean
  over the run's steps and over its last 10% of steps, against tau on the grid
  `moe_gspo.algos.mismatch.EXTREME_TAUS`.
- `expert_load_steps`: per MoE layer, the load of each expert (its share of the layer's top-k slots on the
  response rows, `routing/expert_load_rollout` / `routing/expert_load_learner`) against the step, one heatmap
  per side, layers stacked (at most `MAX_LAYERS` of them, evenly spaced, for large models).
- `dead_experts`: `router/dead_experts` (learner side) per step.

`STABILITY_FIGURES` lists them as `analysis.figure_kit.FigureSpec`s for `analysis.report`; each is left out
silently for runs that never logged its metric (runs from before issue 41). `mean_curve` is shared with the
comparison report (`analysis.compare`, one line per arm).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from analysis.figure_kit import (
    FigureSpec, SkipFigure, _fig, _finite_max, _legend_below, _lines, layer_axis_label, layer_labels, positive_or_nan,
)
from analysis.load import RunData, matrix_series
from moe_gspo.algos.mismatch import EXTREME_TAUS

CURVE_KEY = "mismatch/extreme_frac_curve"
CURVE_KEY_REPLAYED = "mismatch_replayed/extreme_frac_curve"
DEAD_KEY = "router/dead_experts"
LOAD_KEYS = (("routing/expert_load_rollout", "rollout engine"), ("routing/expert_load_learner", "learner"))
MAX_LAYERS = 8


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


def f_tau_y_axis(ax, *, positive: bool) -> None:
    """The y axis of an F(tau) plot: log when some point is positive; else (no extreme token at any tau) a linear
    axis from 0 to 1 with a note, not matplotlib's +-0.04 around a flat line at 0 (issue 49)."""
    if positive:
        ax.set_yscale("log")
        return
    ax.set_ylim(0.0, 1.0)
    ax.text(0.5, 0.5, "F(τ) = 0 at every τ: no response token's |Δ log p| exceeded ln τ", ha="center", va="center",
            transform=ax.transAxes, fontsize="small", color="0.3")


def fig_extreme_frac_curve(run: RunData) -> Figure:
    curves = [(CURVE_KEY, None, "natural routing, all steps", "C0", "-"),
              (CURVE_KEY, 0.1, "natural routing, last 10% of steps", "C0", "--"),
              (CURVE_KEY_REPLAYED, None, "replaying the rollout routes (R3), all steps", "C1", "-"),
              (CURVE_KEY_REPLAYED, 0.1, "replaying the rollout routes (R3), last 10% of steps", "C1", "--")]
    fig, (ax,) = _fig(width=6.4, height=3.8)
    drawn = [(y, rest) for key, last, *rest in curves
             if (y := mean_curve(run.records, key, last_frac=last)) is not None and np.isfinite(y).any()]
    if not drawn:
        raise SkipFigure(f"'{CURVE_KEY}' has no step with one finite value per τ of {list(EXTREME_TAUS)}")
    logy = any(np.nanmax(y) > 0 for y, _ in drawn)  # all zeros (no extreme token at any τ): a linear axis at 0
    for y, (label, color, style) in drawn:
        ax.plot(EXTREME_TAUS, positive_or_nan(y) if logy else y, marker="o", markersize=3, color=color,
                linestyle=style, label=label)
    f_tau_y_axis(ax, positive=logy)
    tau_axis(ax)
    for t in (2.0, 5.0):
        ax.axvline(t, color="0.6", linewidth=0.8, linestyle=":")
    ax.set(ylabel="F(τ): share of response tokens", title="Extreme-token fraction F(τ), rollout vs learner")
    _legend_below(ax)
    return fig


def load_steps(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], loads [S, L, E]) of a per-layer expert-load key; empty arrays when no step has one."""
    steps, vals = matrix_series(records, key)
    if steps.size == 0 or vals.ndim != 3:
        return np.zeros(0, np.int64), np.zeros((0, 0, 0))
    return steps, vals


def shown_layers(num_layers: int, most: int = MAX_LAYERS) -> np.ndarray:
    """Indices of the layers a heatmap shows: all up to `most`, else `most` evenly spaced (first and last included)."""
    if num_layers <= most:
        return np.arange(num_layers)
    return np.unique(np.round(np.linspace(0, num_layers - 1, most)).astype(int))


def draw_load_steps(ax, steps: np.ndarray, loads_SLE: np.ndarray, layers: np.ndarray, labels: list[str], *,
                    vmax: float, title: str, ylabel: bool = True):
    """One heatmap: rows = (layer, expert) blocks of `layers`, columns = steps; returns the image."""
    S, _, E = loads_SLE.shape
    img = loads_SLE[:, layers, :].transpose(1, 2, 0).reshape(len(layers) * E, S)
    half = 0.5 if S == 1 else (steps[-1] - steps[0]) / (2 * (S - 1))
    im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=vmax,
                   extent=(steps[0] - half, steps[-1] + half, len(layers) * E, 0))
    ax.grid(False)
    for i in range(1, len(layers)):
        ax.axhline(i * E, color="w", linewidth=0.8)
    ax.set_yticks([(i + 0.5) * E for i in range(len(layers))], [labels[int(j)] for j in layers])
    ax.set(title=title, xlabel="training step")
    if ylabel:
        ax.set_ylabel(f"{layer_axis_label(labels)}; {E} experts each")
    return im


def fig_expert_load_steps(run: RunData) -> Figure:
    sides = [(name, *load_steps(run.records, key)) for key, name in LOAD_KEYS]
    sides = [s for s in sides if s[1].size]
    if not sides:
        raise SkipFigure("no step logged 'routing/expert_load_rollout' or 'routing/expert_load_learner' as "
                         "per-layer lists (the rollout routes were not recorded)")
    num_layers = sides[0][2].shape[1]
    labels, layers = layer_labels(run, num_layers), shown_layers(num_layers)
    vmax = _finite_max(*(v for _, _, v in sides))
    fig, axes = _fig(len(sides), width=5.6, height=float(np.clip(0.6 * len(layers) + 1.8, 3.0, 7.0)))
    for i, (ax, (name, steps, vals)) in enumerate(zip(axes, sides)):
        im = draw_load_steps(ax, steps, vals, layers, labels, vmax=vmax, title=name, ylabel=i == 0)
    fig.colorbar(im, ax=axes, label="share of the layer's top-k slots")
    shown = "" if len(layers) == num_layers else f", {len(layers)} of {num_layers} layers shown"
    fig.suptitle(f"Expert load per layer over training{shown}")
    return fig


def _window(run: RunData) -> str:
    value = ((run.config or {}).get("logging") or {}).get("dead_expert_window")
    return f"{value} steps" if isinstance(value, int) else "logging.dead_expert_window"


def fig_dead_experts(run: RunData) -> Figure:
    fig, (ax,) = _fig(width=6.0)
    if not _lines(ax, run, [(DEAD_KEY, f"learner, no token in the last {_window(run)}")]):
        raise SkipFigure(f"metric '{DEAD_KEY}' missing from all steps")
    _, loads = load_steps(run.records, LOAD_KEYS[1][0])
    total = f" of {loads.shape[1] * loads.shape[2]}" if loads.size else ""
    ax.set_ylim(bottom=-0.05 * max(ax.get_ylim()[1], 1))
    ax.set(title="Dead experts", xlabel="training step", ylabel=f"(MoE layer, expert) pairs{total}")
    return fig


STABILITY_FIGURES: list[FigureSpec] = [
    FigureSpec("extreme_frac_curve", "Extreme-token fraction curve F(τ)",
               "F(τ) = share of response tokens with |log p_learner − log p_rollout| > ln τ (the R3 paper's "
               "extreme-token curve; mismatch/extreme_frac_curve), mean over steps (each step weighs the same) "
               "and over the last 10% of steps; under R3 also for the pass replaying the rollout routes. "
               "Dotted: τ = 2 and 5, the points logged as mismatch/extreme_frac_ln2 and _ln5. Log y when a point is "
               "positive (points at 0 are then left out), else a linear axis from 0.", fig_extreme_frac_curve, applies=lambda run: logged(run, CURVE_KEY)),
    FigureSpec("expert_load_steps", "Expert load per layer over training",
               "Each expert's share of its layer's top-k slots on the response rows (routing/expert_load_rollout, "
               "routing/expert_load_learner) against the step, layers stacked (white lines), at most 8 layers "
               "shown: an expert that goes dark has stopped receiving tokens.", fig_expert_load_steps,
               applies=lambda run: logged(run, DEAD_KEY)),
    FigureSpec("dead_experts", "Dead experts",
               "router/dead_experts: (MoE layer, expert) pairs to which the learner's old-policy pass (natural "
               "routing) routed no response row in the last logging.dead_expert_window steps.", fig_dead_experts,
               applies=lambda run: logged(run, DEAD_KEY)),
]

"""The report figures' machinery: a figure's spec, rendering specs to PNG bytes in the report style, and
the small plotting helpers every figure module shares (`analysis.figures`, `router_figures`,
`probe_figures`, `eval_report`, `compare`). Figures are built with `Figure()` directly, never through
pyplot, so no GUI backend or global figure state is involved (rendering is Agg's)."""

from __future__ import annotations

import io
import os
import textwrap
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.load import TRACE_READ_ERRORS, RunData, series, trace_layer_ids

DPI = 100


class SkipFigure(Exception):
    """A figure cannot be drawn; the message is the reason shown in the report's Skipped section."""


@dataclass
class FigureSpec:
    name: str
    """File stem of the PNG."""
    title: str
    caption: str
    make: Callable[[Any], Figure]
    applies: Callable[[Any], bool] | None = None
    """False when the data's run never turns the figure's feature on (e.g. rollout corrections off in
    config.yaml): the figure is then left out silently instead of listed as skipped."""


@dataclass
class RenderedFigure:
    name: str
    title: str
    caption: str
    png: bytes


@dataclass
class SkippedFigure:
    name: str
    title: str
    reason: str


# --------------------------------------------------------------------------- helpers

def _fig(ncols: int = 1, width: float = 6.0, height: float = 3.4) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * (1 if ncols == 1 else 0.62 * ncols), height), dpi=DPI,
                 layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _need(run: RunData, *keys: str) -> None:
    """Skip unless at least one of `keys` appears in some record."""
    if not any(k in r for r in run.records for k in keys):
        names = " / ".join(f"'{k}'" for k in keys)
        raise SkipFigure(f"metric {names} missing from all steps" if len(keys) == 1
                         else f"metrics {names} missing from all steps")


def positive_or_nan(values: np.ndarray) -> np.ndarray:
    """Values for a log axis: non-positive entries become NaN (gaps) instead of being clipped."""
    values = np.asarray(values, np.float64)
    return np.where(values > 0, values, np.nan)


def _legend_below(ax) -> None:
    """The axes' legend under its x label, outside the plotting area (never over the data); the figure
    grows by the legend's rows so that the plot keeps its height."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    fig = ax.figure
    panel_in = fig.get_figwidth() / max(1, len(fig.axes))
    ncol = max(1, min(len(labels), int(panel_in * 14 / (max(map(len, labels)) + 4))))
    # anchored at the axes' bottom edge, pushed down (in font sizes, so independent of the figure's
    # height) past the tick labels and the x label; constrained layout then makes room for it
    ax.legend(handles, labels, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, 0),
              borderaxespad=3.6, ncol=ncol, frameon=False)
    extra, done = 0.17 * -(-len(labels) // ncol), getattr(fig, "_legend_rows_in", 0.0)
    if extra > done:
        fig.set_figheight(fig.get_figheight() + extra - done)
        fig._legend_rows_in = extra


def _fraction_axis(ax) -> None:
    """A y axis of fractions starts at 0 (all-zero series would otherwise get a symmetric -0.05..0.05);
    a sliver below 0, less than a tick step, keeps markers at 0 visible."""
    top = max(ax.get_ylim()[1], 0.01)
    ax.set_ylim(-0.03 * top, top)


def _lines(ax, run: RunData, keys_labels: list[tuple[str, str]], logy: bool = False) -> int:
    """Plot scalar series on ax (log y when `logy` and some value is positive), legend below the
    axes; returns how many series were drawn. With a single step the x axis spans step ± 1."""
    drawn, steps_seen = 0, set()
    logy = logy and any(np.any(series(run.records, k)[1] > 0) for k, _ in keys_labels)
    for key, label in keys_labels:
        steps, vals = series(run.records, key)
        if steps.size == 0:
            continue
        marker = "o" if steps.size <= 30 else None
        ax.plot(steps, positive_or_nan(vals) if logy else vals, marker=marker, markersize=3,
                label=label)
        steps_seen.update(steps.tolist())
        drawn += 1
    if logy:
        ax.set_yscale("log")
    if drawn:
        _legend_below(ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(steps_seen) == 1:
            (step,) = steps_seen
            ax.set_xlim(step - 1, step + 1)
    return drawn


def _wrapped_title(ax, text: str, width_in: float) -> None:
    """A title wrapped to the figure's width (about 13 characters per inch at the report's font)."""
    ax.set_title(textwrap.fill(text, max(20, int(13 * width_in))))


def _heat_height(num_layers: int, extra: float = 1.4) -> float:
    """Figure height (inches) for a heatmap with one row per layer, capped for 48+ layer models."""
    return float(np.clip(0.3 * num_layers + extra, 2.4, 6.5))


def layer_labels(run: RunData | None, num_layers: int, probe: dict | None = None) -> list[str]:
    ids = None
    if probe is not None and isinstance(probe.get("layer_ids"), list):
        ids = probe["layer_ids"]
    elif run is not None:
        ids = trace_layer_ids(run)
    if ids is None or len(ids) != num_layers:
        return [str(i) for i in range(num_layers)]
    return [str(i) for i in ids]


def layer_axis_label(labels: list[str]) -> str:
    return "MoE layer (model layer id)" if labels != [str(i) for i in range(len(labels))] \
        else "MoE layer (index)"


def _finite_max(*arrays: np.ndarray) -> float:
    """Largest finite entry (a colour-scale limit), at least 1e-12; 1.0 when nothing is finite."""
    vals = np.concatenate([np.ravel(a) for a in arrays])
    vals = vals[np.isfinite(vals)]
    return float(max(vals.max(), 1e-12)) if vals.size else 1.0


def save_png(fig: Figure, out_dir: str | Path, name: str) -> Path:
    """`fig` saved as `out_dir/name` (the folder made) through this process's own temporary sibling, then renamed
    (two writers never share a temp file; a failed save leaves none); at the figure's own dpi."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, tmp = out / name, out / f".{name}.tmp-{os.getpid()}"
    try:
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def figure_png(fig: Figure) -> bytes:
    """PNG bytes of a figure at the report's dpi."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


@contextmanager
def report_style() -> Iterator[None]:
    """The style every report figure is drawn in (seaborn's whitegrid axes, paper font sizes)."""
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices of metrics never logged
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # seaborn's cmap.set_bad call
        yield


def render_figures(specs: list[FigureSpec], data: Any) -> list[RenderedFigure | SkippedFigure]:
    """Draw each spec on `data`; a `SkipFigure` (or an unreadable trace file) becomes a SkippedFigure."""
    out: list[RenderedFigure | SkippedFigure] = []
    with report_style():
        for spec in specs:
            if spec.applies is not None and not spec.applies(data):
                continue
            try:
                fig = spec.make(data)
            except SkipFigure as e:
                out.append(SkippedFigure(spec.name, spec.title, str(e)))
                continue
            except TRACE_READ_ERRORS as e:  # unreadable trace file and the like
                out.append(SkippedFigure(spec.name, spec.title,
                                         f"could not read inputs: {type(e).__name__}: {e}"))
                continue
            out.append(RenderedFigure(spec.name, spec.title, spec.caption, figure_png(fig)))
    return out

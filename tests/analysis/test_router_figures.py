"""analysis.router_figures: the flip-vs-margin figure from routing traces with router margins, the
router diagnostics over steps, and what happens with traces that have no margins."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.figures import RenderedFigure, SkippedFigure, figure_png, render_figures
from analysis.load import load_run
from analysis.router_figures import ROUTER_FIGURES, fig_flip_vs_margin, flip_margin_pairs
from moe_gspo.routing.trace import RoutingTrace, save_trace
from synth_run import assert_real_png


def _write_run(run_dir: Path, *, rollout_margins: bool = True, steps=(0, 10)) -> Path:
    """Two sequences (P=2, R=3 and P=1, R=2), 2 MoE layers, top-1 of 4 experts; learner rows P+R,
    rollout rows P+R-1. Response rows: seq 0 rows 1..3, seq 1 rows 0..1 -> 5 rows x 2 layers = 10 pairs.
    The rollout differs from the learner at (seq 0 row 2, layer 0) and (seq 1 row 1, layer 1): both have
    learner margin < 0.001; seq 0 row 0 (a prompt row, not counted) differs too."""
    traces = run_dir / "traces"
    le_ids = [np.zeros((5, 2, 1), np.int64), np.zeros((3, 2, 1), np.int64)]
    ro_ids = [np.zeros((4, 2, 1), np.int64), np.zeros((2, 2, 1), np.int64)]
    ro_ids[0][0, :, 0] = 3          # prompt row: not a response row
    ro_ids[0][2, 0, 0] = 1
    ro_ids[1][1, 1, 0] = 2
    le_margin = [np.full((5, 2), 0.5), np.full((3, 2), 0.05)]
    le_margin[0][2, 0] = 0.0005     # flipped
    le_margin[1][1, 1] = 0.0002     # flipped
    le_margin[0][3, 1] = 0.002      # agreed, low margin
    ro_margin = [m[:len(r)] * 2 for m, r in zip(le_margin, ro_ids)]
    for step in steps:
        for name, ids, margins in (("learner", le_ids, le_margin),
                                   ("rollout", ro_ids, ro_margin if rollout_margins else None)):
            save_trace(traces / f"step_{step:06d}_{name}.npz",
                       RoutingTrace.from_samples(ids, [2, 1], [3, 2], 4, [1, 2], margins=margins))
    rows = [{"step": s, "router/max_vio_rollout_mean": 1.0 + s / 10, "router/max_vio_rollout_max": 2.0,
             "router/max_vio_learner_mean": 1.1, "router/max_vio_learner_max": 2.1,
             "router/margin_small_frac_rollout_mean": 0.05, "router/margin_small_frac_learner_mean": 0.04,
             "router/flip_frac_small_margin": 0.3, "router/flip_frac_large_margin": 0.001} for s in range(12)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text("logging:\n  router_margin_threshold: 0.003\n")
    return run_dir


def test_flip_margin_pairs_hand_counted(tmp_path):
    data = flip_margin_pairs(_write_run(tmp_path / "run"))
    assert data["steps"].tolist() == [0, 10]
    assert data["flip"].size == 20 and data["flip"].sum() == 4     # 10 pairs per step, 2 flips each
    assert np.sort(data["learner_margin"][data["flip"]]).tolist() == pytest.approx([0.0002, 0.0002, 0.0005, 0.0005],
                                                                                  rel=1e-3)
    np.testing.assert_allclose(data["rollout_margin"], 2 * data["learner_margin"], rtol=1e-3)
    assert "rollout_margin" not in flip_margin_pairs(_write_run(tmp_path / "ids_only", rollout_margins=False))


def test_router_figures_render(tmp_path):
    run = load_run(_write_run(tmp_path / "run"))
    out = render_figures(ROUTER_FIGURES, run)
    assert [type(o) for o in out] == [RenderedFigure, RenderedFigure]
    for o in out:
        (tmp_path / f"{o.name}.png").write_bytes(o.png)
        assert_real_png(tmp_path / f"{o.name}.png")
    # a run directory path works too, and a rollout without margins still gives the learner-binned figure
    fig = fig_flip_vs_margin(_write_run(tmp_path / "ids_only", rollout_margins=False))
    assert len(fig.axes[0].lines) == 2  # one binned line + the threshold
    assert figure_png(fig)[:4] == b"\x89PNG"


def test_runs_without_router_metrics_or_margins(synthetic_run, tmp_path):
    # a run from before the router diagnostics: both figures left out silently
    assert render_figures(ROUTER_FIGURES, load_run(synthetic_run)) == []
    # router/* logged but no trace with margins: listed as skipped, with the reason
    run_dir = _write_run(tmp_path / "run")
    for p in (run_dir / "traces").glob("*learner.npz"):
        p.unlink()
    skipped = {o.name: o.reason for o in render_figures(ROUTER_FIGURES, load_run(run_dir))
               if isinstance(o, SkippedFigure)}
    assert list(skipped) == ["flip_vs_margin"] and "router margins" in skipped["flip_vs_margin"]

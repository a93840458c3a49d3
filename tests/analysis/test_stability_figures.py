"""Issue 41's report figures (`analysis.stability_figures`, the comparison report's `cmp_*` counterparts): F(tau)
averaged by hand, drawn in the run report and one line per arm in the comparison report; left out for runs that
never logged the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.compare import ArmRun, build_comparison
from analysis.figure_kit import RenderedFigure, render_figures
from analysis.load import load_run
from analysis.report import build_report
from analysis.stability_figures import STABILITY_FIGURES, mean_curve
from synth_run import assert_real_png, write_synthetic_run

CURVES = [[0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0], [0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0],
          [0.1, None, 0.1, 0.1, 0.1, 0.05, 0.02], [0.2, 0.2, 0.1, 0.1, 0.0, 0.0, 0.0]]


def _with_curves(run_dir: Path, curves=CURVES, replayed: bool = False) -> Path:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["mismatch/extreme_frac_curve"] = curves[i % len(curves)]
        if replayed:
            r["mismatch_replayed/extreme_frac_curve"] = [x / 2 if x is not None else None for x in curves[i % len(curves)]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_mean_curve_hand_values():
    records = [{"step": i, "mismatch/extreme_frac_curve": c} for i, c in enumerate(CURVES)]
    records.append({"step": 9, "mismatch/extreme_frac_curve": [1.0, 1.0]})  # another grid: left out
    got = mean_curve(records, "mismatch/extreme_frac_curve")
    # tau = 1.25: the null of step 2 is left out, (0.4 + 0.2 + 0.2) / 3
    want = [1.1 / 4, 0.8 / 3, 0.6 / 4, 0.4 / 4, 0.2 / 4, 0.1 / 4, 0.02 / 4]
    assert got.tolist() == pytest.approx(want)
    assert mean_curve(records, "mismatch/extreme_frac_curve", last_frac=0.25).tolist() == pytest.approx(CURVES[3])
    assert mean_curve(records, "mismatch_replayed/extreme_frac_curve") is None


def test_run_report_draws_f_tau(tmp_path):
    run_dir = _with_curves(write_synthetic_run(tmp_path / "run", with_traces=False), replayed=True)
    out = render_figures(STABILITY_FIGURES, load_run(run_dir))
    names = [o.name for o in out if isinstance(o, RenderedFigure)]
    assert "extreme_frac_curve" in names
    paths = build_report(run_dir, tmp_path / "report")
    assert_real_png(tmp_path / "report" / "extreme_frac_curve.png")
    assert "extreme_frac_curve" in {p.stem for p in paths.figures}
    # an older run without the curve: left out silently, not listed as skipped
    old = build_report(write_synthetic_run(tmp_path / "old", with_traces=False), tmp_path / "old_report")
    assert "extreme_frac_curve" not in {p.stem for p in old.figures} | {s.name for s in old.skipped}


def test_comparison_draws_one_curve_per_arm(tmp_path):
    arm_runs = [ArmRun(arm, seed, _with_curves(write_synthetic_run(tmp_path / f"{arm}-s{seed}", seed=seed,
                                                                     with_traces=False), replayed=arm.endswith("r3")))
                for arm in ("gspo-none", "grpo-r3") for seed in (0, 1)]
    paths = build_comparison(arm_runs, tmp_path / "cmp")
    assert_real_png(tmp_path / "cmp" / "cmp_extreme_frac_curve.png")
    from analysis.compare_arms import load_arms
    from analysis.compare_figures import fig_extreme_frac_curve

    fig = fig_extreme_frac_curve(load_arms(arm_runs))
    labels = [l.get_label() for l in fig.axes[0].get_lines()]
    assert labels == ["gspo-none, natural (n=2)", "grpo-r3, natural (n=2)", "grpo-r3, replayed (n=2)"]
    # both seeds log the same curves: the arm's line is their mean over steps (zeros left off the log scale)
    want = mean_curve(load_run(arm_runs[0].run_dir).records, "mismatch/extreme_frac_curve")
    got = np.asarray(fig.axes[0].get_lines()[0].get_ydata(), float)
    np.testing.assert_allclose(got, np.where(want > 0, want, np.nan))
    replayed = np.asarray(fig.axes[0].get_lines()[2].get_ydata(), float)
    np.testing.assert_allclose(replayed, np.where(want > 0, want / 2, np.nan))
    assert "cmp_extreme_frac_curve" in {p.stem for p in paths.figures}


def test_an_all_zero_f_tau_sits_on_an_axis_from_0_to_1_with_a_note(tmp_path):
    """Issue 49: with no extreme token F(tau) was a flat line at 0 on matplotlib's +-0.04 axis, under a caption
    that named a log scale. Now: a linear axis from 0 to 1 and a note; the captions name both cases."""
    from analysis.compare_arms import load_arms
    from analysis.compare_figures import COMPARE_STABILITY_FIGURES, fig_extreme_frac_curve
    from analysis.stability_figures import fig_extreme_frac_curve as run_f_tau

    zeros = [[0.0] * 7]
    run_dir = _with_curves(write_synthetic_run(tmp_path / "a-s0", with_traces=False), curves=zeros)
    for fig in (run_f_tau(load_run(run_dir)), fig_extreme_frac_curve(load_arms([ArmRun("a", 0, run_dir)]))):
        ax = fig.axes[0]
        assert ax.get_yscale() == "linear" and ax.get_ylim() == (0.0, 1.0)
        assert [t.get_text() for t in ax.texts] == ["F(τ) = 0 at every τ: no response token's |Δ log p| exceeded ln τ"]
    positive = _with_curves(write_synthetic_run(tmp_path / "b-s0", with_traces=False))
    assert run_f_tau(load_run(positive)).axes[0].get_yscale() == "log"
    for spec in (*STABILITY_FIGURES, *COMPARE_STABILITY_FIGURES):
        if "extreme_frac_curve" in spec.name:
            assert "else a linear axis from 0" in spec.caption, spec.name


def _with_dead(run_dir: Path) -> Path:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["router/dead_experts"] = r["step"] % 3
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_shown_layers():
    from analysis.stability_figures import shown_layers

    assert shown_layers(3).tolist() == [0, 1, 2]
    assert shown_layers(48, 4).tolist() == [0, 16, 31, 47]


def test_expert_load_heatmap_and_dead_experts_in_both_reports(tmp_path):
    run_dir = _with_dead(write_synthetic_run(tmp_path / "run", with_traces=False))
    paths = build_report(run_dir, tmp_path / "report")
    names = {p.stem for p in paths.figures}
    assert {"expert_load_steps", "dead_experts"} <= names
    assert not {"expert_load_steps", "dead_experts"} & {s.name for s in paths.skipped}
    for name in ("expert_load_steps", "dead_experts"):
        assert_real_png(tmp_path / "report" / f"{name}.png")
    from analysis.stability_figures import fig_dead_experts, fig_expert_load_steps

    run = load_run(run_dir)
    fig = fig_expert_load_steps(run)
    image = fig.axes[1].images[0].get_array()  # learner: rows = (layer, expert), columns = steps
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = np.asarray([r["routing/expert_load_learner"] for r in rows])  # [S, L, E]
    np.testing.assert_allclose(np.asarray(image), want.transpose(1, 2, 0).reshape(-1, len(rows)))
    line = fig_dead_experts(run).axes[0].get_lines()[0]
    assert np.asarray(line.get_ydata()).tolist() == [r["step"] % 3 for r in rows]
    # the comparison report: dead experts one line per arm, the heatmaps per arm and side
    arm_runs = [ArmRun(arm, seed, _with_dead(write_synthetic_run(tmp_path / f"{arm}-s{seed}", seed=seed,
                                                                   with_traces=False)))
                for arm in ("gspo-none", "grpo-r3") for seed in (0, 1)]
    cmp = build_comparison(arm_runs, tmp_path / "cmp")
    assert {"cmp_dead_experts", "cmp_expert_load_steps"} <= {p.stem for p in cmp.figures}
    assert_real_png(tmp_path / "cmp" / "cmp_expert_load_steps.png")
    # runs from before issue 41 (no router/dead_experts): both left out silently
    old = build_report(write_synthetic_run(tmp_path / "old", with_traces=False), tmp_path / "old_report")
    assert not {"expert_load_steps", "dead_experts"} & ({p.stem for p in old.figures} | {s.name for s in old.skipped})

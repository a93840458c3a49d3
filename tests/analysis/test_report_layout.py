"""Readable reports (issue 22, item 6): ticks and axes that fit the data, legends and titles that do
not cover or lose anything, a probe figure that does not mix units, headers that name both sides'
engine and dtype, and no "skipped" noise for a feature the run never turned on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from analysis.eval_report import EVAL_FIGURES
from analysis.figures import RUN_FIGURES, SkipFigure, fig_mismatch, fig_update_change, report_style
from analysis.probe_figures import PROBE_FIGURES, fig_probe_variance
from analysis.load import HEADLINE_LABELS, PROBE_LABELS, load_run
from analysis.report import build_report, main
from synth_run import synthetic_probe, synthetic_record, write_degenerate_run, write_synthetic_run


@pytest.fixture(autouse=True)
def _style():
    with report_style():  # as the report draws them
        yield


def _draw(fig):
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig


def _figures(run, probe):
    for spec in RUN_FIGURES + EVAL_FIGURES + PROBE_FIGURES:
        try:
            yield spec.name, _draw(spec.make(probe if spec in PROBE_FIGURES else run))
        except SkipFigure:
            continue


def _one_step_run(tmp_path: Path, config: str = "") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rec = {k: v for k, v in synthetic_record(0, np.random.default_rng(0)).items()
           if not k.startswith("rollout_corr/")}  # as a run without rollout corrections logs
    (run / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    if config:
        (run / "config.yaml").write_text(config)
    return run


def test_a_single_measured_step_gets_integer_ticks_around_it(tmp_path):
    """update_change.png with one point had x ticks -0.045 ... 0.045."""
    fig = _draw(fig_update_change(load_run(_one_step_run(tmp_path))))
    line_ax = [ax for ax in fig.axes if ax.get_title() == "all layers"][0]
    assert line_ax.get_xlim() == (-1.0, 1.0)
    ticks = [t for t in line_ax.get_xticks() if -1 <= t <= 1]
    assert ticks == [-1.0, 0.0, 1.0]


def test_legends_are_outside_the_data_and_titles_inside_the_figure(tmp_path):
    """Legends sat over the data (update_change.png); probe_layer_disagree.png's title was cut."""
    run = load_run(write_synthetic_run(tmp_path / "run"))
    names = set()
    for name, fig in _figures(run, synthetic_probe()):
        width = fig.bbox.width
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:
                assert not legend.get_window_extent().overlaps(ax.get_window_extent()), name
                names.add(name)
            if ax.get_title():
                box = ax.title.get_window_extent()
                assert box.x0 >= 0 and box.x1 <= width, (name, ax.get_title())
        for text in fig.texts:  # suptitle
            box = text.get_window_extent()
            assert box.x0 >= 0 and box.x1 <= width, name
    assert {"reward", "eval", "update_change", "mismatch", "clip", "probe_variance_attribution"} <= names


def test_probe_variance_figure_has_only_variance_shares_as_bars():
    """probe_variance_attribution.png drew the flipped-token fraction as a third bar on the
    variance-share axis; it is now a dashed mark on each bar (that set's share of the tokens)."""
    probe = synthetic_probe()
    ax = _draw(fig_probe_variance(probe)).axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches if p.get_height() > 0)
    assert heights == sorted([probe["mismatch_ratio/token_var_share_flipped"], probe["mismatch_ratio/token_var_share_agreed"]])
    marks = sorted(round(float(seg[0][1]), 6) for coll in ax.collections for seg in coll.get_segments())
    assert marks == [probe["mismatch_ratio/flipped_token_frac"], round(1 - probe["mismatch_ratio/flipped_token_frac"], 6)]


def test_an_all_zero_fraction_axis_does_not_run_below_zero(tmp_path):
    """mismatch.png's extreme-token panel ran to -0.04 with all values 0."""
    run = load_run(write_degenerate_run(tmp_path / "run", 0.0))
    bottom, top = _draw(fig_mismatch(run)).axes[1].get_ylim()
    assert -0.05 * top < bottom <= 0 < top
    assert min(t for t in _draw(fig_mismatch(run)).axes[1].get_yticks() if bottom <= t <= top) == 0


@pytest.mark.parametrize("config,listed", [("algo:\n  rollout_is: none\n  rollout_rs: none\n", False),
                                           ("algo:\n  rollout_is: token\n", True)])
def test_rollout_corr_is_not_reported_skipped_on_a_default_run(tmp_path, capsys, config, listed):
    """"skipped figure rollout_corr" was printed on every default run."""
    run = _one_step_run(tmp_path, config)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert ("skipped figure rollout_corr" in err) == listed
    assert ("(`rollout_corr`)" in (tmp_path / "out" / "report.md").read_text()) == listed  # the Skipped section


def test_headers_name_both_sides_and_the_counts_are_explained(tmp_path):
    run = _one_step_run(tmp_path, "model:\n  params_dtype: auto\nrollout:\n  engine: vllm\n  dtype: bfloat16\n")
    md = build_report(run, tmp_path / "out").markdown.read_text()
    assert "Rollout: vllm engine in bfloat16; learner: Megatron-core in auto (float32 on CPU, bfloat16 on CUDA)" in md
    assert "| steps that measured the old→new change (one every logging.update_drift_every steps) | 1 |" in md
    assert "mean over the steps that measured it" in HEADLINE_LABELS["update_expert_change_mean"]
    probe = tmp_path / "drift.json"
    probe.write_text(json.dumps(dict(synthetic_probe(), learner_dtype="float32")))
    md = build_report(probe, tmp_path / "probe_out").markdown.read_text()
    assert "| rollout side | hf engine, bfloat16 |" in md and "| learner side | Megatron-core, float32 |" in md
    assert "response tokens probed" in PROBE_LABELS["num_tokens"]
    assert "prompt and response rows" in PROBE_LABELS["num_routed_tokens"]


def test_header_names_the_rollout_quantization(tmp_path):
    run = _one_step_run(tmp_path, "rollout:\n  engine: hf\n  dtype: bfloat16\n  quantization: fp8\n  fp8_scale: tensor\n")
    md = build_report(run, tmp_path / "out").markdown.read_text()
    assert "Rollout: hf engine in bfloat16 with FP8 (e4m3) weights, per-tensor scales (emulated); learner" in md
    probe = tmp_path / "drift.json"
    probe.write_text(json.dumps(dict(synthetic_probe(), quantization="fp8", fp8_scale=None)))
    md = build_report(probe, tmp_path / "probe_out").markdown.read_text()
    assert "| rollout side | hf engine, bfloat16 with FP8 (e4m3) weights, per-channel scales (emulated) |" in md

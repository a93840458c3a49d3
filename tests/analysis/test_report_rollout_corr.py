"""Issue 43: the run report shows the rollout-correction metrics (TIS = algo.rollout_is, MIS = algo.rollout_rs,
OPSM = algo.opsm) when present: a figure with one panel per correction used, a table of their means, and a header
line naming the corrections; a run without a correction says "not used" and never lists rollout_corr/is_ess as
missing."""

from __future__ import annotations

import json
from pathlib import Path

from analysis.figures import fig_rollout_corr
from analysis.load import load_run
from analysis.report import build_report, main
from test_report import md_table


def _run(tmp_path: Path, records: list[dict], config: str | None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (run / "config.yaml").write_text(config)
    return run


OPSM = [{"step": 0, "reward/mean": 0.1, "rollout_corr/opsm_masked_seq_frac": 0.25,
         "rollout_corr/opsm_masked_token_frac": 0.2, "rollout_corr/opsm_kl_mean": 0.001},
        {"step": 1, "reward/mean": 0.2, "rollout_corr/opsm_masked_seq_frac": 0.75,
         "rollout_corr/opsm_masked_token_frac": 0.4, "rollout_corr/opsm_kl_mean": 0.003}]
TIS_MIS = [{"step": s, "reward/mean": 0.1, "rollout_corr/is_raw_mean": 1.0, "rollout_corr/is_raw_max": 2.5 + s,
            "rollout_corr/is_weight_mean": 0.99, "rollout_corr/is_truncated_frac": 0.01 * s, "rollout_corr/is_ess": 0.9,
            "rollout_corr/rs_masked_token_frac": 0.02, "rollout_corr/rs_masked_seq_frac": 0.1,
            "rollout_corr/rs_frac_high": 0.01, "rollout_corr/rs_frac_low": 0.03} for s in range(2)]


def test_opsm_only_run_shows_its_metrics(tmp_path, capsys):
    run = _run(tmp_path, OPSM, "algo:\n  rollout_is: none\n  rollout_rs: none\n  opsm: true\n")
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "skipped figure rollout_corr" not in capsys.readouterr().err
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Rollout corrections: OPSM (algo.opsm)" in md
    assert md_table(md, "Rollout corrections (mean over steps)") == {
        "rollout_corr/opsm_masked_seq_frac": "0.5", "rollout_corr/opsm_masked_token_frac": "0.3",
        "rollout_corr/opsm_kl_mean": "0.002"}
    assert (tmp_path / "out" / "rollout_corr.png").is_file()
    fig = fig_rollout_corr(load_run(run))
    assert [ax.get_title() for ax in fig.axes] == ["OPSM: masked sequences"]
    assert {line.get_label() for line in fig.axes[0].lines} == {"sequences masked", "tokens masked",
                                                                "mean drift log π_rollout − log π_θ"}


def test_tis_and_mis_run_shows_all_panels_and_means(tmp_path):
    run = _run(tmp_path, TIS_MIS, "algo:\n  rollout_is: token\n  rollout_rs: sequence\n  opsm: false\n")
    md = build_report(run, tmp_path / "out").markdown.read_text()
    assert "Rollout corrections: TIS (algo.rollout_is: token), MIS (algo.rollout_rs: sequence)" in md
    table = md_table(md, "Rollout corrections (mean over steps)")
    assert table["rollout_corr/is_ess"] == "0.9" and table["rollout_corr/is_raw_max"] == "3"
    assert table["rollout_corr/is_truncated_frac"] == "0.005" and table["rollout_corr/rs_frac_low"] == "0.03"
    assert len(table) == 9  # 5 is_* and 4 rs_* metrics
    fig = fig_rollout_corr(load_run(run))
    assert [ax.get_title() for ax in fig.axes] == ["TIS: importance weights π_old / π_rollout",
                                                   "TIS truncation, MIS rejection"]


def test_run_without_a_correction_says_not_used(tmp_path, capsys):
    """No config.yaml (the figure used to be listed as skipped: 'rollout_corr/is_ess' missing) and the default
    config: neither is listed as skipped; the header says 'not used'."""
    recs = [{"step": 0, "reward/mean": 0.1}]
    for name, config, why in [("bare", None, "no rollout_corr/\\* metric logged; config.yaml has no algo section"),
                              ("default", "algo:\n  rollout_is: none\n  rollout_rs: none\n  opsm: false\n",
                               "algo.rollout_is and algo.rollout_rs none, algo.opsm false")]:
        (tmp_path / name).mkdir()
        run = _run(tmp_path / name, recs, config)
        assert main([str(run), "--out", str(tmp_path / name / "out")]) == 0
        err = capsys.readouterr().err
        md = (tmp_path / name / "out" / "report.md").read_text()
        assert "rollout_corr" not in err and "is_ess" not in md
        assert f"Rollout corrections: not used ({why})" in md
        assert "## Rollout corrections (mean over steps)" not in md

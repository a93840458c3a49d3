"""analysis.report: the run / probe reports build, their figures are real PNGs, the headline table
holds the recomputed numbers, and bad inputs degrade or fail as documented."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from analysis.figures import RUN_FIGURES, SkippedFigure, render_figures
from analysis.eval_report import EVAL_FIGURES
from analysis.probe_figures import PROBE_FIGURES
from analysis.load import HEADLINE_LABELS, PROBE_LABELS, ReportInputError, RunDataWarning, load_run
from analysis.report import build_report, fmt_number, main
from synth_run import (
    NUM_STEPS, assert_real_png, recompute_headline, write_degenerate_run, write_synthetic_run,
)

def md_table(md: str, heading: str) -> dict[str, str]:
    """quantity -> value of a two-column Markdown table under `## heading`."""
    lines = md.split(f"## {heading}\n", 1)[1].lstrip("\n").splitlines()
    table = list(itertools.takewhile(bool, lines))  # up to the first blank line
    rows = [line.strip("|").split(" | ") for line in table[2:]]
    return {k.strip(): v.strip() for k, v in rows}


@pytest.fixture(scope="module")
def full_report(synthetic_run, probe_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return build_report(synthetic_run, out, probe_path=probe_file)


def test_every_figure_is_drawn_as_png(full_report):
    names = {p.stem for p in full_report.figures}
    assert names == {s.name for s in RUN_FIGURES + EVAL_FIGURES + PROBE_FIGURES}
    assert full_report.skipped == []
    for p in full_report.figures:
        assert_real_png(p)


class _TagBalance(HTMLParser):
    """Checks that non-void elements close in order (a cheap well-formedness check)."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_html_is_self_contained(full_report):
    html = full_report.html.read_text()
    uris = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(uris) == len(full_report.figures)
    assert "<script" not in html and 'src="http' not in html
    assert "Skipped" not in html
    checker = _TagBalance()
    checker.feed(html)
    assert checker.errors == [] and checker.stack == []


def test_markdown_references_pngs(full_report):
    md = full_report.markdown.read_text()
    refs = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    assert sorted(refs) == sorted(p.name for p in full_report.figures)
    for ref in refs:
        assert (full_report.markdown.parent / ref).is_file()


def test_headline_table_equals_recomputation(full_report, synthetic_run):
    table = md_table(full_report.markdown.read_text(), "Headline numbers")
    want = recompute_headline(synthetic_run / "metrics.jsonl")
    assert len(table) == len(HEADLINE_LABELS) + 6  # + the last evaluation's rows (test_report_content)
    for key, label in HEADLINE_LABELS.items():
        assert table[label] == fmt_number(want[key], integer=key.startswith("num_")), key
    assert table[HEADLINE_LABELS["num_steps"]] == str(NUM_STEPS)


def test_probe_numbers_in_run_report(full_report, probe_file):
    table = md_table(full_report.markdown.read_text(), "Probe: headline numbers")
    probe = json.loads(probe_file.read_text())
    assert table[PROBE_LABELS["mismatch/k3_kl"]] == fmt_number(probe["mismatch/k3_kl"])
    assert table[PROBE_LABELS["num_tokens"]] == str(probe["num_tokens"])


def test_truncated_last_line_still_builds(tmp_path, capsys):
    run_dir = write_synthetic_run(tmp_path / "run", with_traces=False)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "reward/mean": 0.9, "clip/tok')
    assert main([str(run_dir), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert f"line {NUM_STEPS + 1}" in captured.err
    html_path = Path(captured.out.strip().splitlines()[-1])
    assert html_path == tmp_path / "out" / "report.html" and html_path.is_file()
    md = (tmp_path / "out" / "report.md").read_text()
    assert md_table(md, "Headline numbers")[HEADLINE_LABELS["num_steps"]] == str(NUM_STEPS)
    assert f"line {NUM_STEPS + 1}" in md  # listed under "Input notes"


def test_missing_traces_and_metric_are_listed_as_skipped(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", with_traces=False)
    dropped = ("mismatch_ratio/token_var_share_flipped", "mismatch_ratio/flipped_token_frac",
               "mismatch_ratio/token_var")
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k not in dropped}) + "\n" for r in rows))
    paths = build_report(run_dir)
    assert paths.html.parent == run_dir / "report"
    skipped = {s.name: s.reason for s in paths.skipped}
    assert set(skipped) == {"ratio_variance_length", "variance_attribution"}
    assert "traces" in skipped["ratio_variance_length"]
    assert "missing from all steps" in skipped["variance_attribution"]
    for text in (paths.html.read_text(), paths.markdown.read_text()):
        assert "Skipped" in text and "ratio_variance_length" in text and "variance_attribution" in text
    assert not (paths.html.parent / "variance_attribution.png").exists()
    for p in paths.figures:
        assert_real_png(p)


def test_expert_load_falls_back_to_rank_traces(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", num_ranks=2)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if not k.startswith("routing/expert_load")}) + "\n"
        for r in rows))
    paths = build_report(run_dir, tmp_path / "out")
    names = {p.stem for p in paths.figures}
    assert {"expert_load", "ratio_variance_length"} <= names and paths.skipped == []
    assert_real_png(tmp_path / "out" / "expert_load.png")
    shutil.rmtree(run_dir / "traces")  # neither metrics nor traces: skipped, with the reason
    spec = [s for s in RUN_FIGURES if s.name == "expert_load"]
    (skipped,) = render_figures(spec, load_run(run_dir))
    assert isinstance(skipped, SkippedFigure) and "no traces" in skipped.reason


@pytest.mark.parametrize("fill", [0.0, None], ids=["zeros", "nulls"])
def test_degenerate_values_still_build(tmp_path, fill):
    run_dir = write_degenerate_run(tmp_path / "run", fill)
    paths = build_report(run_dir)
    assert [s.name for s in paths.skipped] == ["eval", "ratio_variance_length", "samples"]  # no eval, traces, samples
    table = md_table(paths.markdown.read_text(), "Headline numbers")
    assert table[HEADLINE_LABELS["num_steps"]] == "3"
    assert table[HEADLINE_LABELS["update_token_seq_var_ratio"]] == "n/a"  # 0/0 or no values
    assert table[HEADLINE_LABELS["mismatch_token_seq_var_ratio"]] == "n/a"
    for p in paths.figures:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_only_report(probe_file, tmp_path):
    paths = build_report(probe_file, tmp_path / "probe_out")
    assert {p.stem for p in paths.figures} == {s.name for s in PROBE_FIGURES}
    for p in paths.figures:
        assert_real_png(p)
    table = md_table(paths.markdown.read_text(), "Probe: headline numbers")
    assert table[PROBE_LABELS["routing/any_layer_flip"]] == fmt_number(0.045)


def test_missing_run_dir_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "analysis.report", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_run_dir_without_metrics_or_traces_is_an_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("train: {steps: 1}\n")
    with pytest.raises(ReportInputError, match="nothing to report"):
        build_report(tmp_path / "run")


def test_only_garbage_metrics_is_an_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("not json\n")
    with pytest.warns(RunDataWarning, match="line 1"), pytest.raises(ReportInputError,
                                                                     match="no valid records"):
        build_report(tmp_path / "run")


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed")
def test_html_renders_in_headless_chromium(full_report, tmp_path):
    proc = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={tmp_path / 'chrome'}", "--enable-logging=stderr", "--v=0", "--dump-dom",
         full_report.html.resolve().as_uri()],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert "Expert-drift report" in dom
    assert dom.count("data:image/png;base64,") == len(full_report.figures)
    console_errors = [l for l in proc.stderr.splitlines() if "CONSOLE" in l and "ERROR" in l.upper()]
    assert console_errors == []

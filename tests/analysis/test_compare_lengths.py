"""Issue 43: analysis.compare warns (one stderr line and a line at the top of the report) when the runs compared
have different numbers of steps (20/30/10-step runs gave "steps to threshold −10"), and its positional arguments
have help text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.compare import main


def _run(root: Path, name: str, steps: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": i / steps}) + "\n"
                                             for i in range(steps)))
    return d


WARNING = ("the runs compared have different numbers of steps (10 steps: c seed 0; 20 steps: a seed 0, a seed 1; "
           "30 steps: b seed 0); steps to threshold, final reward and reward AUC then compare runs of different "
           "lengths")


def test_different_lengths_warn_once_on_stderr_and_in_the_report(tmp_path, capsys):
    runs = [_run(tmp_path, "a-s0", 20), _run(tmp_path, "a-s1", 20), _run(tmp_path, "b", 30), _run(tmp_path, "c", 10)]
    assert main([str(tmp_path / "out"), *map(str, runs), "--bootstrap-reps", "200"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [f"warning: {WARNING}"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"Warning: {WARNING}." in md.split("\n## ", 1)[0]  # at the top, before the tables


def test_equal_lengths_do_not_warn(tmp_path, capsys):
    runs = [_run(tmp_path, "a", 12), _run(tmp_path, "b", 12)]
    assert main([str(tmp_path / "out"), *map(str, runs), "--bootstrap-reps", "200"]) == 0
    assert "different numbers of steps" not in capsys.readouterr().err
    assert "different numbers of steps" not in (tmp_path / "out" / "report.md").read_text()


def test_positional_arguments_have_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "out_dir directory to write report.html, report.md and the figures into (created when missing)" in out
    assert "RUN_DIR training run directories; those named <arm>-s<seed>" in out

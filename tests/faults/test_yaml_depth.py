"""Issue 59, defect 7: YAML nested 1000 deep ended in a RecursionError (PyYAML composes recursively) in a config
file, an override, under `moe_gspo.launch` and in an ablation spec. Every YAML read goes through
`moe_gspo.yaml_limits.load_capped`, which counts the nesting from the parser's events before composing and refuses
more than MAX_DEPTH levels with one line naming the document and the cap (exit code 2 on the command line)."""

from __future__ import annotations

import json
import re
import time
import warnings

import pytest
import torch.distributed.run as torchrun

from moe_gspo.yaml_limits import MAX_DEPTH, load_capped, nesting_depth

DEEP = "[" * 1000 + "]" * 1000
CAP = f"its YAML nests lists and mappings more than {MAX_DEPTH} levels deep (a config nests three or four); flatten it"


def _one_line(capsys) -> list[str]:
    out = capsys.readouterr()
    return [l for l in (out.err + out.out).splitlines() if l.strip()]


def test_depth_is_counted_without_recursion_and_the_cap_is_exact():
    assert nesting_depth("a: {b: [1, [2]]}\nc: 3\n") == 4  # the document mapping is a level
    assert nesting_depth("a:\n  b:\n    c: [1]\n") == 4
    assert nesting_depth("[" * 200_000 + "]" * 200_000) == MAX_DEPTH + 1  # no RecursionError, stops early
    at_cap = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert nesting_depth(at_cap) == MAX_DEPTH
    nested = load_capped(at_cap, what="x")
    for _ in range(MAX_DEPTH - 1):
        nested = nested[0]
    assert nested == []
    with pytest.raises(ValueError, match=f"^x: {re.escape(CAP)}$"):
        load_capped("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), what="x")
    block = "".join("  " * i + f"k{i}:\n" for i in range(1000)) + "  " * 1000 + "v: 1\n"  # block style too
    with pytest.raises(ValueError, match=f"^y: {re.escape(CAP)}$"):
        load_capped(block, what="y")


def test_a_deep_config_file_and_override_are_one_line_exit_2(tmp_path, capsys):
    from moe_gspo.train import main

    cfg = tmp_path / "deep.yaml"
    cfg.write_text(f"train:\n  steps: {DEEP}\n")
    with pytest.raises(SystemExit) as e:  # moe_gspo.run.cli.fail: the line printed once, then exit status 2
        main(["--config", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    assert _one_line(capsys) == [f"error: config file {str(cfg)!r}: {CAP}"]
    with pytest.raises(SystemExit) as e:
        main(["--run-dir", str(tmp_path / "run"), f"model.tiny={DEEP}"])
    assert e.value.code == 2
    err = _one_line(capsys)
    assert len(err) == 1 and err[0].startswith("error: override 'model.tiny=[[[") and err[0].endswith(CAP), err
    assert not (tmp_path / "run").exists()


def test_a_deep_config_under_launch_is_one_line_before_any_worker(tmp_path, monkeypatch, capsys):
    from moe_gspo import launch

    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    cfg = tmp_path / "deep.yaml"
    cfg.write_text(f"rollout:\n  dtype: {DEEP}\n")
    t0 = time.time()
    code = launch.main(["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train", "--config", str(cfg)])
    assert (code, started, _one_line(capsys)) == (2, [], [f"error: config file {str(cfg)!r}: {CAP}"])
    code = launch.main(["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train", f"algo.options={DEEP}"])
    err = _one_line(capsys)
    assert (code, started, len(err)) == (2, [], 1) and err[0].endswith(CAP), err
    assert time.time() - t0 < 60


def test_a_deep_ablation_spec_is_one_line_exit_2(tmp_path, capsys):
    from moe_gspo.ablate import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"base_config: configs/tiny_cpu.yaml\nout_dir: {tmp_path / 'out'}\narms: {DEEP}\n")
    assert main(["--config", str(spec), "--dry-run"]) == 2
    assert _one_line(capsys) == [f"error: ablation spec {str(spec)!r}: {CAP}"]
    assert not (tmp_path / "out").exists()


def test_analysis_refuses_a_deep_run_config_with_one_line_exit_2(tmp_path, capsys):
    """analysis.load reads a run's config.yaml through the same loader: a deep one (crafted or broken: no training
    run writes it) is refused, one line naming the file and the cap, exit 2 in `analysis.report`; an unreadable
    but shallow one stays a warning (config.yaml is optional for the reports)."""
    from analysis import report
    from analysis.load import ReportInputError, load_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"train:\n  steps: {DEEP}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": 0.5}) + "\n"
                                               for i in range(2)))
    with pytest.raises(ReportInputError, match=re.escape(CAP)):
        load_run(run)
    assert report.main([str(run), "--out", str(tmp_path / "out")]) == 2
    lines = _one_line(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "config.yaml" in lines[0] and CAP in lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    (run / "config.yaml").write_text("train: [unclosed\n")  # broken but not crafted: a warning, the report builds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_run(run).config is None
    assert any("could not read config.yaml" in str(w.message) for w in caught)


def test_resume_reads_a_deep_previous_config_without_recursing(tmp_path):
    from moe_gspo.run.start import _previous_config

    (tmp_path / "config.yaml").write_text(f"train:\n  steps: {DEEP}\n")
    assert _previous_config(tmp_path) == ({}, "")
    (tmp_path / "config.yaml").write_text("train:\n  steps: 3\nalgo:\n  name: gspo\n")
    assert _previous_config(tmp_path) == ({"train.steps": 3, "algo.name": "gspo"}, "config.yaml")

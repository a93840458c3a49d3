"""A run's done.json is the matrix's word that it finished. A garbage one (not JSON, not an object, a step that
is not a step) is not "done": `--status` says "damaged" with why, a rerun fails the run without running it or
touching its files (the user moves the file aside), `--dry-run` says it will not run, and a run that exits 0
leaving a damaged one failed. Fake arm runner (tests/test_ablate.py's), no training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_gspo.ablate import arm_state, expand_arms, load_spec, main, run_ablation
from moe_gspo.run.ablation_arms import done_problem
from tests.test_ablate import FakeRunner, _write_spec

DAMAGED = [
    (b"\x00\x01garbage", "done.json is damaged: not JSON"),
    (b'{"step": 4', "done.json is damaged: not JSON"),
    (b"[1, 2]", "done.json is damaged: not a JSON object (a list)"),
    (b'"done"', "done.json is damaged: not a JSON object (a str)"),
    (b'{"step": "4"}', "done.json is damaged: step '4' is not a step number"),
    (b'{"step": -1}', "done.json is damaged: step '-1' is not a step number"),
]


def _matrix(tmp_path: Path):
    path = _write_spec(tmp_path, algos=["grpo"], routing_replay=["none"], seeds=[0, 1])
    return path, expand_arms(load_spec(path))


@pytest.mark.parametrize("text,why", DAMAGED)
def test_a_damaged_done_json_is_not_done(tmp_path, text, why):
    run = tmp_path / "run"
    run.mkdir()
    (run / "done.json").write_bytes(text)
    assert arm_state(run) == "damaged" and done_problem(run).startswith(why), done_problem(run)
    (run / "done.json").write_text(json.dumps({"step": 4, "wall_s": 1.0, "summary": {}}))
    assert arm_state(run) == "done" and done_problem(run) == ""


def test_status_says_damaged_with_why(tmp_path, capsys):
    spec, (s0, s1) = _matrix(tmp_path)
    s0.run_dir.mkdir(parents=True)
    (s0.run_dir / "done.json").write_bytes(b"\x00\x01garbage")
    assert main(["--config", str(spec), "--status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["grpo-none-s0", "damaged"], out
    assert "done.json is damaged: not JSON" in out[0] and out[0].endswith("not counted as done: move it aside to "
                                                                          "run it again"), out[0]
    assert out[-1] == "2 runs (1 arm x 2 seeds): 1 damaged, 1 not started (executor: local)"


def test_a_rerun_fails_the_damaged_run_without_running_or_touching_it(tmp_path, capsys):
    spec, (s0, s1) = _matrix(tmp_path)
    s0.run_dir.mkdir(parents=True)
    (s0.run_dir / "done.json").write_bytes(b"[1, 2]")
    (s0.run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    runner = FakeRunner()
    assert main(["--config", str(spec)], arm_runner=runner) == 1
    assert [name for name, _ in runner.calls] == ["grpo-none-s1"]  # s0 not run
    out = capsys.readouterr().out
    assert (f"FAILED grpo-none-s0: done.json is damaged: not a JSON object (a list); not run: move "
            f"{s0.run_dir / 'done.json'} aside to run it again") in out, out
    assert (s0.run_dir / "done.json").read_bytes() == b"[1, 2]" and sorted(p.name for p in s0.run_dir.iterdir()) == [
        "done.json", "metrics.jsonl"]  # nothing moved, nothing written
    assert not s0.run_dir.with_name(s0.run_dir.name + ".prev1").exists()


def test_dry_run_says_the_damaged_run_will_not_run(tmp_path, capsys):
    spec, (s0, s1) = _matrix(tmp_path)
    s0.run_dir.mkdir(parents=True)
    (s0.run_dir / "done.json").write_text("{")
    assert main(["--config", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["grpo-none-s0", "skip", "(damaged", "done.json)"], out
    assert out[1].startswith("    note: done.json is damaged: not JSON"), out
    assert "2 runs (1 arm x 2 seeds), 1 to run" in out[-1]


def test_exit_zero_leaving_a_damaged_done_json_is_a_failure(tmp_path):
    spec = load_spec(_matrix(tmp_path)[0])

    def runner(arm, cmd, log):
        (arm.run_dir / "done.json").write_text("not json")
        return 0

    results = run_ablation(spec, runner, progress=False, compare=False)
    assert [r.status for r in results] == ["failed", "failed"]
    assert results[0].message.startswith("exited 0 but its done.json is damaged: not JSON"), results[0].message


def test_the_analysis_pages_leave_a_damaged_done_json_out_with_one_line(tmp_path, capsys):
    """The matrix pages (analysis.phase / staleness / claims) counted any done.json file as finished, as ablate did:
    a damaged one is now left out with one warning line, the valid ones read."""
    import json
    import re

    from analysis.matrix_runs import finished_runs

    for name, done in (("grpo-none-p0-s0", '{"step": 3}'), ("grpo-none-p10-s0", "garbage"), ("grpo-none-p20-s0", "[1]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
        (tmp_path / name / "done.json").write_text(done)
    runs = finished_runs(tmp_path, re.compile(r"grpo-none-p\d+-s\d+$"))
    assert [r.name for r in runs] == ["grpo-none-p0-s0"]
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 2 and all(l.startswith("warning: grpo-none-p") and "left out, not finished" in l for l in err)
    assert "not JSON" in err[0] and "not a JSON object" in err[1]

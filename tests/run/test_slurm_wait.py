"""The SLURM executor's waiting loop against a scripted `squeue` (what a real one does in rare moments: a
requeued job's old result file, a job that leaves the queue without a result, a controller that does not
answer for a while). The jobs themselves run against a real SLURM in tests/run/test_slurm_ablation.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moe_gspo.ablate import expand_arms, parse_spec
from moe_gspo.run import slurm_executor as se
from moe_gspo.run.slurm_record import write_exit_record


class FakeQueue:
    """`squeue` on PATH printing `lines[k]` at its k-th call ("FAIL": exits 1, as when the controller is down)."""

    def __init__(self, tmp_path: Path, monkeypatch, lines: list[str]):
        self.dir, self.calls = tmp_path / "bin", tmp_path / "calls"
        self.dir.mkdir()
        for k, text in enumerate(lines):
            (self.dir / f"out{k}").write_text(text)
        script = self.dir / "squeue"
        script.write_text(f"""#!/bin/sh
n=$(cat {self.calls} 2>/dev/null || echo 0); echo $((n + 1)) > {self.calls}
f={self.dir}/out$n; [ -f "$f" ] || f={self.dir}/out{len(lines) - 1}
if [ "$(cat "$f")" = FAIL ]; then echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1; fi
cat "$f"
""")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{self.dir}:{os.environ['PATH']}")


def _setup(tmp_path: Path):
    spec = parse_spec({"base_config": "configs/tiny_cpu.yaml", "algos": ["gspo", "grpo"], "routing_replay": ["none"],
                       "seeds": [0], "out_dir": str(tmp_path / "abl"), "executor": "slurm", "slurm": {"time": "10"}})
    arms = expand_arms(spec)
    for arm in arms:
        arm.run_dir.mkdir(parents=True)
    return spec, arms


def _result(spec, job_id: str, value: int) -> None:
    """What the job (`ArmJob`) writes when its command returns `value`."""
    write_exit_record(se.results_dir(spec), job_id, 0, value)


def test_results_count_only_once_the_job_left_the_queue(tmp_path, monkeypatch, capsys):
    spec, arms = _setup(tmp_path)
    gspo, grpo = arms  # job 5_0 finishes (after a requeue left an old result); 5_1 vanishes without a result
    FakeQueue(tmp_path, monkeypatch, ["5_0|RUNNING\n5_1|RUNNING\n", "FAIL", "5_0|REQUEUED\n5_1|RUNNING\n",
                                      "5_0|COMPLETED\n", ""])
    _result(spec, "5_0", 143)  # the attempt SLURM requeued: not the job's last word
    (grpo.run_dir / "train.log").write_text("step 2/40\nslurmstepd: error: *** JOB 5 CANCELLED ***\n")
    polls = []

    def sleep(_):
        polls.append(len(polls))
        if len(polls) == 3:  # the requeued attempt finishes
            (gspo.run_dir / "done.json").write_text("{}")
            _result(spec, "5_0", 0)

    results, log, seen = {}, {}, []
    se._wait(spec, arms, {0: "5_0", 1: "5_1"}, {0: False, 1: True}, results, seen.append, log, 0.0, sleep)
    assert results[0].status == "finished" and results[0].message == "SLURM job 5_0", results[0]
    assert results[1].status == "failed" and results[1].message == (
        "SLURM job 5_1, left the queue without a result; train.log: slurmstepd: error: *** JOB 5 CANCELLED ***"), \
        results[1]
    assert [r.arm.name for r in seen] == ["gspo-none-s0", "grpo-none-s0"] and log["finished_now"] == ["gspo-none-s0"]
    assert capsys.readouterr().err.count("Unable to contact slurm controller") == 1  # one warning, then on


def test_a_controller_that_stays_away_ends_the_wait_with_one_error(tmp_path, monkeypatch):
    spec, arms = _setup(tmp_path)
    FakeQueue(tmp_path, monkeypatch, ["FAIL"])
    with pytest.raises(ValueError, match="Unable to contact slurm controller"):
        se._wait(spec, arms, {0: "7_0"}, {0: False}, {}, lambda r: None, {}, 0.0, lambda s: None)
    assert int((tmp_path / "calls").read_text()) == se._SQUEUE_TRIES


def test_jobs_are_recorded_and_a_rerun_attaches_to_live_ones(tmp_path, monkeypatch):
    spec, arms = _setup(tmp_path)
    se.record_jobs(spec, {"gspo-none-s0": {"job_id": "3_0", "submitted": "t"}})
    se.record_jobs(spec, {"gspo-none-s0": {"job_id": "4_0", "submitted": "t2"}})
    assert json.loads(se.jobs_file(spec).read_text()) == {"gspo-none-s0": [{"job_id": "3_0", "submitted": "t"},
                                                                           {"job_id": "4_0", "submitted": "t2"}]}
    FakeQueue(tmp_path, monkeypatch, ["3_0|CANCELLED\n4_0|PENDING\n9_9|RUNNING\n"])
    assert se.queue_states(["3_0", "4_0", "8_0"]) == {"3_0": "CANCELLED", "4_0": "PENDING"}

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


class FakeSubmitit:
    """submitit's SlurmExecutor as `run_on_slurm` uses it (monkeypatched in): `batch()` gives the jobs their ids
    when it closes, as sbatch's answer does (array job `first_id`, one `_k` per job in submission order)."""

    def __init__(self, first_id: str):
        self.first_id, self.submitted, self.params = first_id, [], {}

    def __call__(self, folder, max_num_timeout):  # submitit.SlurmExecutor(folder=..., max_num_timeout=...)
        self.folder = Path(folder)
        return self

    def update_parameters(self, **params):
        self.params.update(params)

    def batch(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            start = len(self.submitted)
            yield
            for k, job in enumerate(self.submitted[start:]):
                job.job_id = f"{self.first_id}_{k}"
        return ctx()

    def submit(self, fn):
        from types import SimpleNamespace

        job = SimpleNamespace(fn=fn, job_id=None)
        self.submitted.append(job)
        return job


@pytest.mark.parametrize("arm0", ["done", "attached"])
def test_only_the_arm_to_submit_is_submitted_and_reads_its_own_jobs_result(tmp_path, monkeypatch, arm0):
    """Arm 0 is done (or its recorded job 5_0 is still queued: attached to), arm 1 is to submit. Exactly one job is
    submitted, arm 1's, and arm 1's result is read from its own job id (6_0), not arm 0's; jobs.json names it
    under arm 1. (Fails if the executor paired arms and jobs by `enumerate` instead of submission order, or
    submitted an arm that is done or already queued.)"""
    import submitit

    spec, arms = _setup(tmp_path)
    gspo, grpo = arms
    fake = FakeSubmitit("6")
    monkeypatch.setattr(submitit, "SlurmExecutor", fake)
    for name in ("sbatch", "scancel"):  # require_slurm: present, never called
        stub = tmp_path / "stubs" / name
        stub.parent.mkdir(exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 1\n")
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'stubs'}:{os.environ['PATH']}")
    if arm0 == "done":
        (gspo.run_dir / "done.json").write_text('{"step": 3}')
        FakeQueue(tmp_path, monkeypatch, [""])
    else:
        se.record_jobs(spec, {gspo.name: {"job_id": "5_0", "submitted": "t"}})
        FakeQueue(tmp_path, monkeypatch, ["5_0|RUNNING\n", ""])  # live at the start, then both jobs ended
        _result(spec, "5_0", 0)  # arm 0's job: exit 0, but no done.json
    _result(spec, "6_0", 3)  # arm 1's job: exit code 3
    results = se.run_on_slurm(spec, arms, on_result=lambda r: None, log={}, poll_s=0.0, sleep=lambda s: None)
    assert [job.fn.run_dir for job in fake.submitted] == [str(grpo.run_dir)]  # exactly one job: arm 1's
    assert results[1].status == "failed" and results[1].message.startswith("SLURM job 6_0, exit code 3"), results[1]
    if arm0 == "done":
        assert results[0].status == "skipped"
    else:
        assert results[0].status == "failed" and results[0].message == (
            "SLURM job 5_0, exited 0 but wrote no done.json"), results[0]
    # submitit's files go to a new folder of this submission (a job loads its pickle from there, never from a
    # planted {out_dir}/slurm/6_0/)
    assert fake.folder.name == "%j" and fake.folder.parent.parent == se.slurm_dir(spec)
    assert fake.folder.parent.name.startswith("submitted-") and list(fake.folder.parent.iterdir()) == []
    jobs = {name: [r["job_id"] for r in recs] for name, recs in se.read_jobs(spec).items()}
    assert jobs == ({grpo.name: ["6_0"]} if arm0 == "done" else {gspo.name: ["5_0"], grpo.name: ["6_0"]})

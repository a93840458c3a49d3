"""An ablation directory is data (shared on clusters, copied between people): `ablate --status` and a rerun read
it as data only. A crafted pickle where submitit's result would be runs nothing, a job id that is not a SLURM id
is refused with one line, a malformed jobs.json is one line (and no SLURM talk under the local executor), and a
job's outcome comes from its JSON exit record, checked. Scheduler: none (stub `squeue` / `sbatch` / `scancel` on
PATH, as tests/run/test_slurm_wait.py)."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import yaml

from moe_gspo.ablate import expand_arms, main, parse_spec, run_ablation
from moe_gspo.run import slurm_executor as se
from moe_gspo.run.slurm_job import ArmJob
from moe_gspo.run.slurm_record import exit_record_path, read_exit_record, write_exit_record
from tests.run.test_slurm_wait import FakeQueue


class _Payload:
    """Unpickling this creates `path` (what a crafted result.pkl could do: any code)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _stub_slurm(tmp_path: Path, monkeypatch, queue: list[str]) -> Path:
    """squeue printing `queue[k]` at its k-th call; sbatch / scancel that only note they were called."""
    FakeQueue(tmp_path, monkeypatch, queue)
    calls = tmp_path / "sbatch_calls"
    for name in ("sbatch", "scancel"):
        stub = tmp_path / "bin" / name
        stub.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {calls}\nexit 1\n")
        stub.chmod(0o755)
    return calls


def _spec_file(tmp_path: Path, executor: str = "slurm") -> Path:
    raw = {"base_config": "configs/tiny_cpu.yaml", "algos": ["gspo", "grpo"], "routing_replay": ["none"],
           "seeds": [0], "out_dir": str(tmp_path / "abl"), "executor": executor, "slurm": {"time": "10"}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _plant(tmp_path: Path, job_id: str, jobs: object) -> Path:
    """jobs.json as given, and a crafted result pickle where submitit keeps job `job_id`'s; returns the file
    its payload would create."""
    slurm = tmp_path / "abl" / "slurm"
    (slurm / job_id).mkdir(parents=True)
    (slurm / "jobs.json").write_text(json.dumps(jobs))
    target = tmp_path / "PWNED"
    (slurm / job_id / f"{job_id}_0_result.pkl").write_bytes(pickle.dumps(_Payload(target)))
    return target


def test_the_crafted_pickle_is_live(tmp_path):
    """The planted file does run code when unpickled: the tests below would see it if anything loaded it."""
    target = _plant(tmp_path, "12345", {})
    pickle.loads((tmp_path / "abl" / "slurm" / "12345" / "12345_0_result.pkl").read_bytes())
    assert target.exists()


def test_status_never_unpickles_a_crafted_result(tmp_path, monkeypatch, capsys):
    target = _plant(tmp_path, "12345", {"gspo-none-s0": [{"job_id": "12345"}]})
    sbatch = _stub_slurm(tmp_path, monkeypatch, [""])  # the job left the queue
    assert main(["--config", str(_spec_file(tmp_path)), "--status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not target.exists()
    assert out[0].split()[:5] == ["gspo-none-s0", "failed", "job", "12345", "left"], out
    assert not sbatch.exists()


def test_a_rerun_waiting_for_the_job_never_unpickles_its_crafted_result(tmp_path, monkeypatch):
    target = _plant(tmp_path, "12345", {"gspo-none-s0": [{"job_id": "12345"}]})
    spec = parse_spec(yaml.safe_load(_spec_file(tmp_path).read_text()))
    gspo, grpo = expand_arms(spec)
    grpo.run_dir.mkdir(parents=True)
    (grpo.run_dir / "done.json").write_text('{"step": 3}')
    sbatch = _stub_slurm(tmp_path, monkeypatch, ["12345|RUNNING\n", ""])  # attached, then it ends
    monkeypatch.setattr(se, "make_executor", lambda spec, folder: pytest.fail("nothing is to be submitted"))
    results = run_ablation(spec, progress=False, compare=False, poll_s=0.0)
    assert not target.exists()
    assert [r.status for r in results] == ["failed", "skipped"]
    assert results[0].message == "SLURM job 12345, left the queue without a result", results[0].message
    assert not sbatch.exists()


@pytest.mark.parametrize("job_id", ["../../x", "12345/../../12345", "12345_0 ", "", 12345, None])
def test_a_job_id_that_is_not_a_slurm_id_is_refused_with_one_line(tmp_path, monkeypatch, capsys, job_id):
    target = _plant(tmp_path, "12345", {"gspo-none-s0": [{"job_id": job_id}]})
    sbatch = _stub_slurm(tmp_path, monkeypatch, [""])
    spec = _spec_file(tmp_path)
    for args in (["--status"], []):  # --status, and a rerun
        assert main(["--config", str(spec), *args]) == 2
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert len(err) == 1 and err[0].startswith(
            f"error: {tmp_path / 'abl' / 'slurm' / 'jobs.json'}: run 'gspo-none-s0' job 0: job_id {job_id!r} is not "
            "a SLURM job id"), err
    assert not target.exists() and not sbatch.exists()
    assert not (tmp_path / "abl" / "gspo-none-s0").exists()  # nothing started


@pytest.mark.parametrize("jobs,what", [
    ([{"job_id": "12345"}], "expected a JSON object of run name -> list of jobs, got a list"),
    ("12345", "expected a JSON object of run name -> list of jobs, got a str"),
    ({"gspo-none-s0": [{"submitted": "t"}]}, "run 'gspo-none-s0' job 0 has no job_id"),
    ({"gspo-none-s0": {"job_id": "12345"}}, "run 'gspo-none-s0': expected a list of jobs"),
    ({"gspo-none-s0": ["12345"]}, "run 'gspo-none-s0': expected a list of jobs"),
])
def test_a_malformed_jobs_json_is_one_line_and_the_local_executor_ignores_it(tmp_path, monkeypatch, capsys, jobs,
                                                                             what):
    _stub_slurm(tmp_path, monkeypatch, [""])
    jobs_file = tmp_path / "abl" / "slurm" / "jobs.json"
    jobs_file.parent.mkdir(parents=True)
    jobs_file.write_text(json.dumps(jobs))
    assert main(["--config", str(_spec_file(tmp_path)), "--status"]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: {jobs_file}: {what}"), err
    assert main(["--config", str(_spec_file(tmp_path, "local")), "--status"]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "jobs.json" not in text and "SLURM" not in text and "job " not in text, text
    assert captured.out.splitlines()[-1] == "2 runs (2 arms x 1 seed): 2 not started (executor: local)"


# ------------------------------------------------------------------------------------------- exit records

def _job_env(monkeypatch, job_id: str = "41", array: tuple[str, str] | None = ("40", "1")) -> None:
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1",
           "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    if array:
        env.update(SLURM_ARRAY_JOB_ID=array[0], SLURM_ARRAY_TASK_ID=array[1])
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_the_job_writes_its_exit_record_and_the_executor_reads_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the job changes to its cwd
    _job_env(monkeypatch)  # array job 40, task 1: job id 40_1
    spec = parse_spec(yaml.safe_load(_spec_file(tmp_path).read_text()))
    run = tmp_path / "abl" / "gspo-none-s0"
    exit3 = [sys.executable, "-c", "raise SystemExit(3)"]
    job = ArmJob(command=exit3, resume_command=exit3, run_dir=str(run), cwd=str(tmp_path),
                 result_dir=str(se.results_dir(spec)))
    assert job() == 3
    record = tmp_path / "abl" / "slurm" / "results" / "40_1_0.json"
    assert json.loads(record.read_text()) == {"job_id": "40_1", "task": 0, "exit_code": 3}
    assert se.job_result(spec, "40_1") == (3, "")
    assert se.job_result(spec, "40_2") is None  # no record yet

    broken = ArmJob(command=exit3, resume_command=exit3, run_dir=str(run), cwd=str(tmp_path / "gone"),
                    result_dir=str(se.results_dir(spec)))
    with pytest.raises(FileNotFoundError):  # the job raised: its record says so, the exception goes on to submitit
        broken()
    code, why = se.job_result(spec, "40_1")
    assert code is None and why.startswith("raised FileNotFoundError: [Errno 2] No such file or directory"), why


@pytest.mark.parametrize("text,why", [
    (b"\x80\x03cbuiltins\nopen\n", "not JSON"),
    (b"[0]", "not a JSON object (a list)"),
    (b'{"job_id": "7", "task": 0}', "expected the keys job_id, task, exit_code"),
    (b'{"job_id": "8", "task": 0, "exit_code": 0}', "it is the record of job '8' task 0, not '7' task 0"),
    (b'{"job_id": "7", "task": true, "exit_code": 0}', "it is the record of job '7' task True"),
    (b'{"job_id": "7", "task": 0, "exit_code": "0"}', "exit_code '0' is not an exit code"),
    (b'{"job_id": "7", "task": 0, "exit_code": 1e9}', "exit_code 1000000000.0 is not an exit code"),
    (b'{"job_id": "7", "task": 0, "exit_code": null}', "exit_code null without an error text"),
    (b'{"job_id": "7", "task": 0, "exit_code": 0, "x": 1}', "expected the keys job_id, task, exit_code"),
])
def test_a_damaged_exit_record_is_a_failed_job_not_a_result(tmp_path, text, why):
    path = exit_record_path(tmp_path, "7", 0)
    path.write_bytes(text)
    code, message = read_exit_record(path, "7", 0)
    assert code is None and message.startswith(f"damaged exit record {path}: {why}"), message


def test_an_error_text_is_shown_without_its_control_characters(tmp_path):
    write_exit_record(tmp_path, "7", 0, None, "Traceback\n  ...\nValueError: bad \x1b[2J\x07 value")
    assert read_exit_record(exit_record_path(tmp_path, "7", 0), "7", 0) == (None, "raised ValueError: bad ?[2J? value")
    with pytest.raises(ValueError, match="is not a SLURM job id"):
        exit_record_path(tmp_path, "../7", 0)
    assert os.listdir(tmp_path) == ["7_0.json"]

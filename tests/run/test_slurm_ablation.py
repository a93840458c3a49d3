"""`executor: slurm` against a real single-node SLURM (tests/_slurm.py: slurmctld + slurmd + munged on localhost,
started by the fixture, stopped by pid). Scheduler used: real SLURM (Debian's slurm-wlm), through submitit's
SlurmExecutor and sbatch. Skipped only where the SLURM binaries are missing (`.ci/run` installs them).

- a 2-arm x 1-seed x 3-step ablation: submitted (held), Ctrl-C leaves the jobs queued, `--status` shows them,
  a rerun attaches to them instead of submitting again, they run (each job writes its JSON exit record), the
  comparison report is written, and the runs' offline W&B files carry the ablation's group and tags;
- Ctrl-C with `--on-interrupt cancel` cancels the submitted jobs, and `--status` says so;
- a submission sbatch refuses (a partition that does not exist) is one error line, exit code 2;
- a job SLURM requeues after a time-out resumes its run from the checkpoint (submitit's Checkpointable).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests._slurm import local_slurm, missing_reason
from tests.run.test_ablation_wandb import offline_run_record

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = "real single-node SLURM (slurmctld + slurmd on localhost, tests/_slurm.py)"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]


@pytest.fixture(scope="module")
def slurm():
    print(f"scheduler: {SCHEDULER}")
    with local_slurm() as env:
        yield env


def _env(slurm: dict[str, str]) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **slurm)


def _spec(tmp_path: Path, **slurm_keys) -> Path:
    spec = {"base_config": "configs/tiny_cpu.yaml", "algos": ["gspo", "grpo"], "routing_replay": ["none"],
            "seeds": [0], "nproc": 1, "out_dir": str(tmp_path / "abl"), "executor": "slurm",
            "overrides": {"train.steps": 3, "train.export_hf": False, "eval.every": 0, "logging.progress": False,
                          "logging.trace_every": 0, "logging.samples_every": 0},
            "slurm": {"time": "00:30:00", "cpus_per_task": 1, "sbatch_flags": {"hold": True}, **slurm_keys}}
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _ablate(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_gspo.ablate", *args]


def _jobs(tmp_path: Path) -> dict[str, list[dict]]:
    return json.loads((tmp_path / "abl" / "slurm" / "jobs.json").read_text())


def _submit_and_interrupt(tmp_path: Path, slurm: dict[str, str], *flags: str) -> tuple[str, dict[str, str]]:
    """Start ablate, Ctrl-C it once its (held) jobs are recorded; returns its stderr and {run: job id}."""
    p = subprocess.Popen(_ablate("--config", str(_spec(tmp_path)), *flags), cwd=ROOT, env=_env(slurm),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    jobs_file = tmp_path / "abl" / "slurm" / "jobs.json"
    deadline = time.monotonic() + 300
    while not jobs_file.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out[-2000:] + err[-3000:]
    jobs = {name: recs[-1]["job_id"] for name, recs in _jobs(tmp_path).items()}
    assert sorted(jobs) == ["grpo-none-s0", "gspo-none-s0"] and all(len(r) == 1 for r in _jobs(tmp_path).values())
    return err, jobs


def _queue(slurm: dict[str, str]) -> dict[str, str]:
    r = subprocess.run(["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T"], env=_env(slurm),
                       capture_output=True, text=True, timeout=60, check=True)
    return dict(line.split("|", 1) for line in r.stdout.split())


def test_a_two_arm_ablation_runs_through_a_real_slurm_and_reports(slurm, tmp_path):
    t0 = time.monotonic()
    err, jobs = _submit_and_interrupt(tmp_path, slurm)
    line = [l for l in err.splitlines() if l.startswith("interrupted")]
    ids = " ".join(sorted(jobs.values()))
    assert len(line) == 1 and line[0].startswith(
        "interrupted by SIGINT; 0 of 2 runs finished (0 in this run, 0 before it); left the 2 SLURM jobs still "
        f"queued or running (--on-interrupt leave, the default; `scancel {ids}` cancels them). Rerun"), err[-3000:]
    queue = _queue(slurm)
    assert all(queue.get(j) == "PENDING" for j in jobs.values()), queue  # left: held in the queue

    st = subprocess.run(_ablate("--config", str(_spec(tmp_path)), "--status"), cwd=ROOT, env=_env(slurm),
                        capture_output=True, text=True, timeout=120)
    assert st.returncode == 0, st.stderr[-2000:]
    for name, job in jobs.items():
        assert any(l.split()[:4] == [name, "pending", "job", job] for l in st.stdout.splitlines()), st.stdout
    assert "2 runs (2 arms x 1 seed): 2 pending (executor: slurm)" in st.stdout

    rerun = subprocess.Popen(_ablate("--config", str(_spec(tmp_path))), cwd=ROOT, env=_env(slurm),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # it attaches to the queued jobs before they may start
    log = tmp_path / "rerun.err"
    while time.monotonic() < deadline and rerun.poll() is None:
        q = _queue(slurm)
        if all(q.get(j) == "PENDING" for j in jobs.values()):
            break
        time.sleep(0.5)
    time.sleep(15)  # the rerun has read the queue (it polls every 10 s); then the jobs may run
    subprocess.run(["scontrol", "release", *jobs.values()], env=_env(slurm), check=True, timeout=60,
                   capture_output=True)
    out, err = rerun.communicate(timeout=1500)
    log.write_text(err)
    assert rerun.returncode == 0, out[-3000:] + err[-5000:]
    assert "0 runs submitted to SLURM, 2 already queued or running" in err, err[-3000:]
    assert "runs: 2 finished, 0 skipped (already done), 0 failed" in out, out[-3000:]
    assert {name: recs[-1]["job_id"] for name, recs in _jobs(tmp_path).items()} == jobs  # nothing submitted twice
    assert all(len(r) == 1 for r in _jobs(tmp_path).values())
    report = tmp_path / "abl" / "comparison" / "report.html"
    assert report.is_file() and f"comparison report: {report}" in out
    for name, job in jobs.items():
        run = tmp_path / "abl" / name
        assert (run / "done.json").is_file()
        steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1, 2], steps
        rec = offline_run_record(run)  # W&B, offline: grouped by the ablation, the arm and its tags
        arm = name.rsplit("-s", 1)[0]
        assert (rec.run_group, rec.job_type) == ("abl", arm), rec
        assert set(rec.tags) == {f"algo={arm.split('-')[0]}", "replay=none", "seed=0"}, rec.tags
        pickles = list((tmp_path / "abl" / "slurm").glob(f"submitted-*/{job}/{job}_0_result.pkl"))
        assert len(pickles) == 1  # submitit's result, in the submission's own folder (never read by ablate)
        record = tmp_path / "abl" / "slurm" / "results" / f"{job}_0.json"  # the job's own exit record, read
        assert json.loads(record.read_text()) == {"job_id": job, "task": 0, "exit_code": 0}
    st = subprocess.run(_ablate("--config", str(_spec(tmp_path)), "--status"), cwd=ROOT, env=_env(slurm),
                        capture_output=True, text=True, timeout=120)
    assert "2 runs (2 arms x 1 seed): 2 done (executor: slurm)" in st.stdout, st.stdout
    print(f"scheduler: {SCHEDULER}; 2 runs x 3 steps through sbatch in {time.monotonic() - t0:.0f} s")


def test_ctrl_c_with_on_interrupt_cancel_cancels_the_jobs(slurm, tmp_path):
    err, jobs = _submit_and_interrupt(tmp_path, slurm, "--on-interrupt", "cancel")
    ids = " ".join(sorted(jobs.values()))
    assert f"cancelled the 2 SLURM jobs still queued or running (--on-interrupt cancel): {ids}" in err, err[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_queue(slurm).get(j) == "PENDING" for j in jobs.values()):
        time.sleep(0.5)
    queue = _queue(slurm)
    assert all(queue.get(j) in (None, "CANCELLED") for j in jobs.values()), queue
    st = subprocess.run(_ablate("--config", str(_spec(tmp_path)), "--status"), cwd=ROOT, env=_env(slurm),
                        capture_output=True, text=True, timeout=120)
    for name, job in jobs.items():
        row = next(l for l in st.stdout.splitlines() if l.startswith(name))
        assert row.split()[1:4] == ["failed", "job", job] and ("CANCELLED" in row or "left the queue" in row), row
    print(f"scheduler: {SCHEDULER}")


def test_a_submission_sbatch_refuses_is_one_error_line(slurm, tmp_path):
    spec = _spec(tmp_path, partition="no_such_partition")
    r = subprocess.run(_ablate("--config", str(spec)), cwd=ROOT, env=_env(slurm), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert errors == ["error: sbatch refused the jobs: sbatch: error: Batch job submission failed: Invalid partition "
                      "name specified"], r.stderr[-3000:]
    assert not (tmp_path / "abl" / "slurm" / "jobs.json").exists() and not (tmp_path / "abl" / "gspo-none-s0").exists()
    print(f"scheduler: {SCHEDULER}")


def test_a_job_requeued_after_a_time_out_resumes_its_run(slurm, tmp_path, monkeypatch):
    """The job decides at its start: the first attempt runs the fresh command (which checkpoints and hangs),
    SLURM's time-out signal requeues it (submitit), the second attempt finds the checkpoint and resumes."""
    import submitit

    from moe_gspo.run.slurm_job import ArmJob

    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    fresh = [sys.executable, "-c", f"import os, time; os.makedirs({str(run / 'checkpoints' / 'step_000001')!r}); "
             "print('fresh', flush=True); time.sleep(600)"]
    resume = [sys.executable, "-c", f"open({str(run / 'done.json')!r}, 'w').write('{{}}'); print('resumed')"]
    ex = submitit.SlurmExecutor(folder=tmp_path / "sub" / "%j", max_num_timeout=3)
    ex.update_parameters(time=30, job_name="requeue", ntasks_per_node=1)
    job = ex.submit(ArmJob(command=fresh, resume_command=resume, run_dir=str(run), cwd=str(tmp_path),
                           node_log_dir=str(tmp_path / "nodes")))
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_000001").is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    job._interrupt(timeout=True)  # what SLURM sends before the time limit (USR2), as submitit's own tests do
    deadline = time.monotonic() + 400
    states = []
    while not (run / "done.json").exists() and time.monotonic() < deadline:
        states.append(_queue(slurm).get(job.job_id))
        if states[-1] == "PENDING":  # requeued: SLURM delays a requeued job's start (BeginTime); start it now
            subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], env=_env(slurm),
                           capture_output=True, timeout=60)
        time.sleep(1)
    while not job.paths.result_pickle.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert job.paths.result_pickle.exists(), (sorted(set(map(str, states))), (run / "train.log").read_text())
    assert job.result() == 0
    log = (run / "train.log").read_text()
    assert log.count("$ ") == 2 and "fresh" in log and log.rstrip().endswith("resumed"), log
    print(f"scheduler: {SCHEDULER}")

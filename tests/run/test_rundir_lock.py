"""Issue 43.1: one run per run directory (and one ablation per output directory). A second starter gets
one line and exit code 2, whatever its flags, and the first run's files stay intact; a lock left by a
dead process is free (the kernel releases flock on death) and is said to be so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_gspo.run.rundir import LOCK_FILE, lock_dir, lock_state, move_contents_aside, plan_run_dir

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _holder(path: Path) -> subprocess.Popen:
    """A process that takes the lock of `path` and sleeps."""
    code = ("import sys, time; from moe_gspo.run.rundir import lock_dir; l = lock_dir(sys.argv[1], '--run-dir'); "
            "print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, env=ENV, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_lock_refused_naming_holder_and_free_after_kill(tmp_path):
    d = tmp_path / "run"
    proc = _holder(d)
    try:
        assert lock_state(d)[0] == "held"
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {proc.pid} on host"):
            lock_dir(d, "--run-dir", wait_s=0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    state, who = lock_state(d)
    assert state == "free" and f"pid {proc.pid}" in who
    with lock_dir(d, "--run-dir") as lock:  # a dead holder's lock is taken over
        assert json.loads((d / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock_state(d)[0] == "held"
    assert lock_state(d)[0] == "free"


@pytest.mark.parametrize("flags", [{}, {"resume": True}, {"overwrite": True}])
def test_plan_refuses_a_locked_run_dir_whatever_the_flags(tmp_path, flags):
    d = tmp_path / "run"
    (d / "checkpoints" / "step_000002").mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = _holder(d)
    try:
        with pytest.raises(ValueError, match="is in use by a running run"):
            plan_run_dir(d, resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))
    finally:
        proc.kill()
        proc.wait()
    # dead holder: the ordinary decision, and the refusal says the lock is free
    assert plan_run_dir(d, resume=True, overwrite=False).mode == "resume"
    with pytest.raises(ValueError, match=r"no longer running \(the lock it left is free\)"):
        plan_run_dir(d, resume=False, overwrite=False)


def test_overwrite_moves_the_run_aside_but_keeps_the_lock(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("x\n")
    with lock_dir(d, "--run-dir"):
        moved = move_contents_aside(d)
        assert moved == tmp_path / "run.prev1" and (moved / "metrics.jsonl").is_file()
        assert sorted(p.name for p in d.iterdir()) == [LOCK_FILE]
        assert lock_state(d)[0] == "held"


TRAIN = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "parallel.expert_parallel_size=1",
         "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
         "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false", "eval.every=0",
         "logging.trace_every=0", "logging.samples_every=0", "train.checkpoint_every=2"]


@pytest.mark.slow
def test_two_trains_on_one_run_dir(tmp_path):
    """The issue's reproduction: a second run started on the directory of a running one (plain, or with
    --overwrite) stops with one line and exit code 2; the first one's metrics are steps
    0..n-1 exactly once and nothing was moved aside."""
    run_dir = tmp_path / "dup"
    cmd = [sys.executable, "-m", "moe_gspo.train", *TRAIN, "train.steps=100000", "--run-dir", str(run_dir)]
    first = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while lock_state(run_dir) is None or lock_state(run_dir)[0] != "held":
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        seconds = [subprocess.Popen(cmd + extra, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for extra in ([], ["--overwrite"])]  # --resume: test_plan_refuses_a_locked_run_dir_whatever_the_flags
        for second in seconds:
            _, err = second.communicate(timeout=120)
            assert second.returncode == 2, err
            errors = [l for l in err.splitlines() if l.startswith("error:")]
            assert len(errors) == 1 and "in use by" in errors[0] and f"pid {first.pid}" in errors[0], err
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    steps = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps)))
    assert not (tmp_path / "dup.prev1").exists()


def test_second_ablation_on_one_out_dir_is_refused(tmp_path, capsys):
    from moe_gspo import ablate

    out = tmp_path / "abl"
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"base_config": str(ROOT / "configs/tiny_cpu.yaml"), "algos": ["gspo"],
                                "routing_replay": ["none"], "seeds": [0], "out_dir": str(out)}))
    proc = _holder(out)
    try:
        calls = []
        rc = ablate.main(["--config", str(spec)], arm_runner=lambda *a: calls.append(a) or 0)
    finally:
        proc.kill()
        proc.wait()
    assert rc == 2 and not calls
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out_dir") and "in use by another run" in err[0]


def test_a_full_disk_while_recording_the_holder_is_one_line_and_leaves_the_lock_free(tmp_path, monkeypatch):
    """The lock record goes into the locked file itself under `files.writing`: a full disk is a user error
    naming the file, and the descriptor (so the lock) is given back."""
    import errno

    from moe_gspo.run import rundir

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    d = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(rundir.os, "pwrite", full)
        with pytest.raises(ValueError, match=rf"^disk full while writing run-directory lock record '.*{LOCK_FILE}'"):
            lock_dir(d, "--run-dir", wait_s=0)
    assert lock_state(d)[0] != "held"
    lock_dir(d, "--run-dir", wait_s=0).release()  # free: the failed attempt kept nothing

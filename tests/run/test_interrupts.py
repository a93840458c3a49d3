"""Ctrl-C (SIGINT) and SIGTERM end train and ablate with one line saying how to resume, exit code
128 + N, and no traceback, also in the arm's train.log (issue 22, item 4). Real subprocesses, real
signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=2", "train.num_minibatches=2", "train.steps=500",
        "train.checkpoint_every=1", "logging.wandb_mode=disabled", "logging.progress=false", "logging.trace_every=0",
        "train.export_hf=false"]


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _interrupt_after_steps(p: subprocess.Popen, metrics: Path, sig: int, steps: int = 2) -> str:
    """Send `sig` to `p` once `metrics` holds `steps` rows; its output."""
    try:
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
                break
            time.sleep(0.2)
        assert p.poll() is None, p.communicate()[0][-3000:]
        p.send_signal(sig)
        return p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _interrupted_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("interrupted by")]


@pytest.mark.slow
@pytest.mark.parametrize("launcher,sig", [("launch", signal.SIGINT), ("python", signal.SIGTERM)])
def test_an_interrupted_training_run_says_how_to_resume(tmp_path, launcher, sig):
    run_dir = tmp_path / "run"
    entry = ([sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "1", "-m", "moe_gspo.train"]
             if launcher == "launch" else [sys.executable, "-m", "moe_gspo.train"])
    p = _start([*entry, *TINY, "--run-dir", str(run_dir)], ROOT)
    out = _interrupt_after_steps(p, run_dir / "metrics.jsonl", sig)
    assert p.returncode == 128 + sig, out[-3000:]
    lines = _interrupted_lines(out)
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith(f"interrupted by {signal.Signals(sig).name}; rerun the same command with --resume "
                               f"to continue from its newest checkpoint, {run_dir}/checkpoints/step_0000"), lines
    assert Path(lines[0].rsplit(", ", 1)[1]).is_dir(), lines  # the path it names exists
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "SignalException" not in out, out[-3000:]


@pytest.mark.slow
def test_ctrl_c_of_an_ablation_says_how_to_resume_and_leaves_a_clean_arm_log(tmp_path):
    """Was: a 20-line KeyboardInterrupt traceback, and torchrun's SignalException traceback at the end
    of the arm's train.log."""
    spec = tmp_path / "abl.yaml"
    overrides = ", ".join(f"{o.split('=', 1)[0]}: {o.split('=', 1)[1]}" for o in TINY[2:])
    spec.write_text(f"base_config: {TINY[1]}\nalgos: [gspo]\nrouting_replay: [none]\nseeds: [0]\nparallel_arms: 1\n"
                    f"overrides: {{{overrides}}}\nout_dir: {tmp_path / 'abl'}\n")
    p = _start([sys.executable, "-m", "moe_gspo.ablate", "--config", str(spec)], ROOT)
    arm = tmp_path / "abl" / "gspo-none-s0"
    out = _interrupt_after_steps(p, arm / "metrics.jsonl", signal.SIGINT)
    assert p.returncode == 130, out[-3000:]
    lines = _interrupted_lines(out)
    assert len(lines) == 1 and lines[0].startswith("interrupted by SIGINT; 0 of 1 runs finished (0 in this run, 0 "
                                                    "before it); interrupted: gspo-none-s0. Rerun "
                                                    f"`python -m moe_gspo.ablate --config {spec}` to continue"), out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    log = (arm / "train.log").read_text()
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    assert "interrupted by SIGTERM; rerun the same command with --resume" in log.splitlines()[-1], log[-2000:]

"""Issue 43.4: a task.reward function that hangs stops the run with one line naming the prompt
(`task.reward_timeout_s`), in the main thread (SIGALRM) and in any other thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from moe_gspo.config import TaskConfig
from moe_gspo.tasks import Prompt, make_task

ROOT = Path(__file__).resolve().parents[2]
P = Prompt(text="2+3=", answer="5", where="data.jsonl:7")
SLEEPY = """
import time
def slow(prompt, response, answer):
    try:
        time.sleep(30)
    except Exception:  # a function that swallows everything is still stopped
        pass
    return 1.0
def fast(prompt, response, answer):
    return 0.5
"""


def _task(tmp_path, name="slow", timeout_s=0.3):
    f = tmp_path / "sleepy.py"
    f.write_text(textwrap.dedent(SLEEPY))
    return make_task(TaskConfig(name="copy", reward=f"{f}:{name}", reward_timeout_s=timeout_s))


def test_a_hanging_reward_is_stopped_naming_the_prompt(tmp_path):
    task = _task(tmp_path)
    before, timer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"did not return within task.reward_timeout_s=0.3 s on the prompt data.jsonl:7"):
        task.reward("5", P)
    assert time.monotonic() - t0 < 5
    assert signal.getsignal(signal.SIGALRM) is before  # restored, and so is another timer (pytest-timeout's)
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (timer[0] > 0)
    assert _task(tmp_path, "fast").reward("5", P) == 0.5  # a quick one is unaffected


def test_the_timeout_works_outside_the_main_thread(tmp_path):
    task = _task(tmp_path)
    out = {}

    def run():
        try:
            task.reward("5", P)
        except ValueError as e:
            out["e"] = str(e)

    t = threading.Thread(target=run)
    t0 = time.monotonic()
    t.start()
    t.join(10)
    assert "data.jsonl:7" in out.get("e", "") and time.monotonic() - t0 < 5


def test_the_timeout_field_is_checked():
    from moe_gspo.config import Config
    from moe_gspo.config_checks import validate

    cfg = Config()
    cfg.task.reward_timeout_s = 0
    with pytest.raises(ValueError, match="task.reward_timeout_s=0 must be > 0"):
        validate(cfg)
    assert TaskConfig().reward_timeout_s == 60.0


@pytest.mark.slow
def test_a_training_run_with_a_hanging_reward_exits_2_with_one_line(tmp_path):
    f = tmp_path / "sleepy.py"
    f.write_text(textwrap.dedent(SLEEPY))
    cmd = [sys.executable, "-m", "moe_gspo.train", "--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"),
           "--run-dir", str(tmp_path / "run"), f"task.reward={f}:slow", "task.reward_timeout_s=0.5",
           "parallel.expert_parallel_size=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
           "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false", "eval.every=0",
           "train.steps=2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "task.reward_timeout_s=0.5" in errors[0] and "prompt" in errors[0]

"""Issue 49: a run stopped by SIGTERM, SIGINT or SIGKILL, then `--resume`d, numbers its steps as one
uninterrupted run does and writes the same rows (the fault trials that held; and the direct kill-resume
step-numbering test the mutation check asked for): checkpoints step_1 .. step_N (those after the stop written by
the resumed segment), metrics.jsonl steps 0 .. N-1 each once (the rows before the checkpoint untouched),
done.json at step N with 2 segments. A real subprocess and real signals (in-process resume)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import torch

from faults._tiny import ROOT, TINY, row_differences, rows, train

STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    assert train(run_dir, f"train.steps={STEPS}", "train.keep_checkpoints=10") == 0
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_stopped_run_resumes_with_every_step_once_and_the_same_rows(uninterrupted, tmp_path, capsys, sig):
    run_dir = tmp_path / "run"
    # The stopped segment runs in a subprocess, the reference and the resumed segment in this process: the same
    # thread count for both, and numbers compared to a tolerance (two processes; tests/conftest.py).
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(torch.get_num_threads()))
    p = subprocess.Popen([sys.executable, "-m", "moe_gspo.train", *TINY, "--run-dir", str(run_dir),
                          f"train.steps={STEPS}", "train.keep_checkpoints=10"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    latest = run_dir / "checkpoints" / "latest"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None:
            if latest.is_file() and latest.read_text().strip() >= "step_000002":
                break
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[0][-3000:]
        os.kill(p.pid, sig)
        out = p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), out[-3000:]
    assert not (run_dir / "done.json").exists()
    k = int(latest.read_text().strip().removeprefix("step_"))
    assert 2 <= k < STEPS, k
    before = (run_dir / "metrics.jsonl").read_text().splitlines()[:k]
    capsys.readouterr()
    assert train(run_dir, "--resume", f"train.steps={STEPS}", "train.keep_checkpoints=10") == 0
    assert f"resuming at step {k} from {run_dir}" in capsys.readouterr().out
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(STEPS))  # none repeated, none skipped
    assert (run_dir / "metrics.jsonl").read_text().splitlines()[:k] == before  # the rows before k untouched
    assert not row_differences(got, rows(uninterrupted))  # and the rest the same, to float tolerance
    ckpts = sorted(d.name for d in (run_dir / "checkpoints").iterdir() if d.is_dir())
    assert ckpts == [f"step_{s:06d}" for s in range(1, STEPS + 1)]  # no leftover .tmp either
    for s in range(1, STEPS + 1):
        meta = json.loads((run_dir / "checkpoints" / f"step_{s:06d}" / "meta.json").read_text())["train_state"]
        assert (meta["step"], meta["segments"]) == (s, 1 if s <= k else 2), (s, meta)
    done = json.loads((run_dir / "done.json").read_text())
    assert (done["step"], done["segments"]) == (STEPS, 2)

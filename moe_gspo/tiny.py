"""Tiny random-init Qwen3-MoE models that stand in for real checkpoints on CPU.

`tiny_qwen3_moe_config()` gives the geometry every CPU test and the default training config use:
3 decoder layers (layer 0 dense through `mlp_only_layers`, layers 1-2 MoE), 8 experts, top-2,
GQA (4 query / 2 KV heads of dim 32), untied embeddings, vocabulary from the shipped tokenizer.
`make_tiny_checkpoint()` writes a real Hugging Face checkpoint directory (safetensors + config +
tokenizer) so the checkpoint-loading code is exercised exactly as on a real model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from moe_gspo.tokenizer import SPECIAL_TOKENS, CHARS, load_tiny_tokenizer

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=len(SPECIAL_TOKENS) + len(CHARS),
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention supports head_dim 32, 64, 80, ... (not 16)
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def tiny_qwen3_moe_config(**overrides: Any):
    """A `Qwen3MoeConfig` for a tiny model; keyword overrides replace any default."""
    from transformers import Qwen3MoeConfig

    kw = dict(TINY_DEFAULTS)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def build_tiny_model(config=None, *, seed: int = 0, router_scale: float = 4.0, dtype=torch.float32):
    """A randomly initialised `Qwen3MoeForCausalLM`.

    `router_scale` multiplies the router (gate) weights so that routing is decisive but still
    sensitive to precision, which makes drift metrics non-zero on CPU (see shared/README.md).
    """
    from transformers import Qwen3MoeForCausalLM

    config = config if config is not None else tiny_qwen3_moe_config()
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                # transformers initialises the router to zeros; give it real random scores.
                p.normal_(0.0, config.initializer_range * router_scale)
    return model.to(dtype).eval()


def make_tiny_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0, config=None,
                         max_shard_size: str | None = None, **config_overrides: Any) -> Path:
    """Write a tiny random Qwen3-MoE checkpoint (HF layout, safetensors) with the shipped tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config if config is not None else tiny_qwen3_moe_config(**config_overrides)
    model = build_tiny_model(cfg, seed=seed)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kw)
    load_tiny_tokenizer().save_pretrained(str(out))
    return out

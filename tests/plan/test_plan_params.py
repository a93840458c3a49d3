"""Parameter counts from the HF config: hand counts for the real Qwen3-MoE geometries, and the real tiny
Megatron model's parameter count."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.plan.from_config import _hf_config_from_json, shipped_model_configs
from moe_gspo.plan.params import Geometry, kv_bytes_per_token, megatron_counts, rollout_params_per_rank
from moe_gspo.tiny import tiny_qwen3_moe_config


def geometry(name: str) -> Geometry:
    return Geometry.from_hf(_hf_config_from_json(shipped_model_configs()[name]))


def test_qwen3_30b_a3b_hand_count():
    c = megatron_counts(geometry("Qwen3-30B-A3B"), vocab_pad_multiple=128)  # 151936 = 1187 x 128: no padding
    # embedding and untied LM head: 151936 x 2048 each
    emb = 151936 * 2048
    # per layer: QKV (32 + 2*4) heads x 128 x 2048, o_proj 2048 x 4096, q/k norms 2 x 128, two RMSNorms
    # 2 x 2048, router 128 x 2048
    layer_dense = 40 * 128 * 2048 + 2048 * 4096 + 2 * 128 + 2 * 2048 + 128 * 2048
    assert c.dense == 2 * emb + 2048 + 48 * layer_dense == 1_541_093_376
    # experts: 48 layers x 128 experts x (gate + up + down) 3 x 768 x 2048
    assert c.expert == 48 * 128 * 3 * 768 * 2048 == 28_991_029_248
    assert c.total == 30_532_122_624                    # "30.5 B"
    assert c.per_rank(8) == 1_541_093_376 + 28_991_029_248 // 8 == 5_164_972_032
    assert c.active_per_token() == 1_541_093_376 + 48 * 8 * 3 * 768 * 2048 == 3_353_032_704  # "A3B"


def test_qwen3_235b_a22b_hand_count():
    c = megatron_counts(geometry("Qwen3-235B-A22B"))
    emb = 151936 * 4096
    layer_dense = (64 + 8) * 128 * 4096 + 4096 * 8192 + 2 * 128 + 2 * 4096 + 128 * 4096
    assert c.dense == 2 * emb + 4096 + 94 * layer_dense == 7_997_238_784
    assert c.expert == 94 * 128 * 3 * 1536 * 4096 == 227_096_395_776
    assert c.total == 235_093_634_560                   # "235 B"
    assert c.active_per_token() == 22_190_763_520       # "A22B"


def test_rollout_shard_hand_counts():
    g = geometry("Qwen3-30B-A3B")
    assert rollout_params_per_rank(g, 1) == megatron_counts(g).total
    # TP=8: vocab 151936/8 rows of embedding and LM head; 4 query heads and 1 (replicated) KV head;
    # o_proj 4 heads; replicated norms and router; experts' intermediate 768/8 = 96
    per_layer = (4 + 2) * 128 * 2048 + 4 * 128 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * 96 * 2048
    assert rollout_params_per_rank(g, 8) == 2 * 18992 * 2048 + 2048 + 48 * per_layer == 3_840_292_864
    assert kv_bytes_per_token(g, tp=8, dtype_bytes=2) == 2 * 48 * 1 * 128 * 2
    assert kv_bytes_per_token(g, tp=2, dtype_bytes=2) == 2 * 48 * 2 * 128 * 2


@pytest.fixture(scope="module")
def dist1():
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed

    yield init_distributed(ep_size=1, num_experts=8, seed=0)
    destroy_distributed()


@pytest.mark.parametrize("overrides,pad", [
    ({}, 1),
    ({}, 128),
    ({"tie_word_embeddings": True, "mlp_only_layers": []}, 1),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [], "num_hidden_layers": 4}, 16),
])
def test_counts_match_the_real_tiny_megatron_model(dist1, overrides, pad):
    from moe_gspo.mcore.model import build_gpt_model

    hf = tiny_qwen3_moe_config(**overrides)
    model = build_gpt_model(hf, vocab_pad_multiple=pad)
    params = dict(model.named_parameters())
    expert = sum(p.numel() for n, p in params.items() if ".experts." in n)
    dense = sum(p.numel() for n, p in params.items() if ".experts." not in n)
    c = megatron_counts(Geometry.from_hf(hf), vocab_pad_multiple=pad)
    assert (c.dense, c.expert) == (dense, expert)
    assert c.total == sum(p.numel() for p in params.values()) > 0
    assert c.expert // 2 + c.dense == c.per_rank(2)
    del model
    torch.manual_seed(0)

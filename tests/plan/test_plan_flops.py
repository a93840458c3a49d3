"""The FLOP count of the learner's passes (hand counts) and the MFU arithmetic."""

from __future__ import annotations

import pytest

from moe_gspo.plan.flops import active_matmul_params, forward_flops, mfu, train_flops
from tests.plan.test_plan_params import geometry


def test_active_params_hand_count_qwen3_30b_a3b():
    g = geometry("Qwen3-30B-A3B")
    per_layer = 40 * 128 * 2048 + 2048 * 4096 + 128 * 2048 + 8 * 3 * 768 * 2048  # QKV, o_proj, router, 8 experts
    assert active_matmul_params(g) == 48 * per_layer + 151936 * 2048  # + LM head; no input embedding
    # = 3.35 B active ("A3B") minus the input embedding and the norms
    assert active_matmul_params(g) == 3_353_032_704 - 151936 * 2048 - 48 * (2 * 2048 + 2 * 128) - 2048


def test_train_and_forward_flops_hand_count():
    g = geometry("Qwen3-30B-A3B")
    n = active_matmul_params(g)
    # two sequences of 100 and 300 tokens: 6 N T + 12 L a d T^2 each
    want = 6 * n * 400 + 12 * 48 * 32 * 128 * (100 ** 2 + 300 ** 2)
    assert train_flops(g, [100, 300]) == want
    assert forward_flops(g, [100, 300]) == pytest.approx(want / 3)


def test_dense_layers_count_their_mlp():
    from moe_gspo.plan.params import Geometry
    from moe_gspo.tiny import tiny_qwen3_moe_config

    g = Geometry.from_hf(tiny_qwen3_moe_config())  # layer 0 dense (mlp_only_layers), layers 1-2 MoE
    attn = (4 + 2 * 2) * 32 * 64 + 64 * 4 * 32
    assert active_matmul_params(g) == 3 * attn + 3 * 128 * 64 + 2 * (8 * 64 + 2 * 3 * 32 * 64) + g.vocab_size * 64


def test_mfu_arithmetic():
    assert mfu(989.4e12, 2.0, 989.4e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, 0.0, 1.0)

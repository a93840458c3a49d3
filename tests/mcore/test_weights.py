"""Pure HF <-> Megatron weight conversion (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.mcore.checkpoint import to_per_expert_layout
from moe_gspo.mcore.weights import hf_to_megatron, megatron_to_hf
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config


@pytest.fixture(scope="module")
def hf_pair():
    cfg = tiny_qwen3_moe_config()
    return cfg, dict(build_tiny_model(cfg, seed=11).state_dict())


def _assert_bit_exact(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("src_layout", ["fused", "per_expert"])
@pytest.mark.parametrize("dst_layout", ["fused", "per_expert"])
def test_round_trip_bit_exact(hf_pair, src_layout, dst_layout):
    cfg, fused = hf_pair
    per_expert = to_per_expert_layout(fused, cfg)
    src = fused if src_layout == "fused" else per_expert
    mc = hf_to_megatron(src, cfg, vocab_pad_multiple=16)
    back = megatron_to_hf(mc, cfg, layout=dst_layout)
    _assert_bit_exact(back, fused if dst_layout == "fused" else per_expert)


def test_ep2_split_then_merge(hf_pair):
    cfg, fused = hf_pair
    ranks = [hf_to_megatron(fused, cfg, ep_rank=r, ep_size=2) for r in range(2)]
    for r, sd in enumerate(ranks):
        local = sorted({k.split(".")[6] for k in sd if ".local_experts." in k})
        assert local == ["0", "1", "2", "3"]
        # local expert j of rank r is global expert r*4 + j
        w = sd["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
        assert torch.equal(w, fused["model.layers.1.mlp.experts.down_proj"][r * 4 + 2])
    _assert_bit_exact(megatron_to_hf(ranks, cfg), fused)
    with pytest.raises(ValueError, match="local_experts.4"):
        megatron_to_hf(ranks[0], cfg)  # one rank's dict alone lacks experts 4..7


def test_layout_of_each_megatron_tensor(hf_pair):
    cfg, fused = hf_pair
    mc = hf_to_megatron(fused, cfg, vocab_pad_multiple=16)
    H, I = 64, 32
    q = fused["model.layers.0.self_attn.q_proj.weight"]
    k = fused["model.layers.0.self_attn.k_proj.weight"]
    v = fused["model.layers.0.self_attn.v_proj.weight"]
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    # 4 query heads in 2 groups: rows = [q0, q1, k0, v0, q2, q3, k1, v1], head_dim rows each
    d = cfg.head_dim
    expected = torch.cat([q[0:2 * d], k[0:d], v[0:d], q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(qkv, expected)
    gu = fused["model.layers.1.mlp.experts.gate_up_proj"][5]
    fc1 = mc["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert fc1.shape == (2 * I, H) and torch.equal(fc1[:I], gu[:I]) and torch.equal(fc1[I:], gu[I:])
    dense_fc1 = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(dense_fc1[:128], fused["model.layers.0.mlp.gate_proj.weight"])
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape == (64, H)  # vocab 51 padded to a multiple of 16
    assert torch.equal(emb[:51], fused["model.embed_tokens.weight"]) and not emb[51:].any()
    assert mc["output_layer.weight"].shape == (64, H) and not mc["output_layer.weight"][51:].any()
    assert "decoder.layers.1.mlp.router.weight" in mc and "decoder.layers.0.mlp.router.weight" not in mc


def test_tied_embeddings_have_no_output_layer():
    cfg = tiny_qwen3_moe_config(tie_word_embeddings=True)
    sd = dict(build_tiny_model(cfg, seed=1).state_dict())
    mc = hf_to_megatron(sd, cfg)
    assert "output_layer.weight" not in mc
    back = megatron_to_hf(mc, cfg)
    assert "lm_head.weight" not in back
    _assert_bit_exact(back, {k: v for k, v in sd.items() if k != "lm_head.weight"})


def test_bf16_kept(hf_pair):
    cfg, fused = hf_pair
    bf = {k: v.to(torch.bfloat16) for k, v in fused.items()}
    back = megatron_to_hf(hf_to_megatron(bf, cfg), cfg)
    _assert_bit_exact(back, bf)


def test_missing_and_unknown_keys_are_named(hf_pair):
    cfg, fused = hf_pair
    partial = {k: v for k, v in fused.items() if k != "model.layers.2.self_attn.k_norm.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.k_norm\.weight"):
        hf_to_megatron(partial, cfg)
    with pytest.raises(ValueError, match="model.layers.0.mlp.shared_expert.weight"):
        hf_to_megatron({**fused, "model.layers.0.mlp.shared_expert.weight": torch.zeros(1)}, cfg)
    bad = dict(fused)
    bad["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        hf_to_megatron(bad, cfg)
    with pytest.raises(ValueError, match="layout="):
        megatron_to_hf(hf_to_megatron(fused, cfg), cfg, layout="grouped")
    with pytest.raises(ValueError, match="not divisible by expert_parallel_size=3"):
        hf_to_megatron(fused, cfg, ep_size=3)


def test_transformer_engine_fused_norm_names(hf_pair):
    """With the TE spec the layer norms live in the next linear; both spellings convert the same."""
    from moe_gspo.mcore.weights import _adapt_to_model_names

    cfg, fused = hf_pair
    mc = hf_to_megatron(fused, cfg)
    te_keys = {k.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
               for k in mc}
    # dense layer 0 folds pre_mlp_layernorm into linear_fc1; MoE layers keep a separate norm
    te_keys = {k.replace("layers.0.pre_mlp_layernorm.weight", "layers.0.mlp.linear_fc1.layer_norm_weight")
               for k in te_keys}
    te = _adapt_to_model_names(mc, te_keys)
    assert set(te) == te_keys
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in te
    assert torch.equal(te["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
                       fused["model.layers.0.post_attention_layernorm.weight"])
    _assert_bit_exact(megatron_to_hf({**te, "output_layer._extra_state": None}, cfg), fused)

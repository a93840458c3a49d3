"""Megatron GPTModel vs transformers Qwen3-MoE at EP=1, in process: logits, routed top-k sets, weights.

fp32 throughout; max |Δlogit| must stay <= 1e-4 and the chosen-expert SETS must agree on every token.
Megatron's router sees tokens sequence-first (index s*B + b), transformers' batch-first (b*S + s);
`_mcore_parity` maps both to [B, S, E] masks.
"""

from __future__ import annotations

import pytest
import torch

from ._mcore_parity import hf_forward, mcore_forward, topk_mismatches
from moe_gspo.mcore.model import build_gpt_model, moe_routers, transformer_config_from_hf
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.mcore.weights import (gather_hf_state_dict, gather_to_hf, load_hf_model_into_megatron,
                                    load_into_megatron)
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

VARIANTS = {
    "default": {},
    "tied": {"tie_word_embeddings": True},
    "no_norm_topk": {"norm_topk_prob": False},
    "sparse_step_2": {"decoder_sparse_step": 2, "mlp_only_layers": [], "num_hidden_layers": 4},
}


@pytest.fixture(scope="module", autouse=True)
def dist_ep1():
    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    yield info
    destroy_distributed()


def _ids(B=3, S=24, seed=0, vocab=51, low=0):
    return torch.randint(low, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_topk_match_transformers(variant):
    cfg = tiny_qwen3_moe_config(**VARIANTS[variant])
    hf = build_tiny_model(cfg, seed=5)
    model = build_gpt_model(cfg, vocab_pad_multiple=8).eval()
    load_hf_model_into_megatron(model, hf)
    num_moe = sum(1 for i in range(cfg.num_hidden_layers)
                  if i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0)
    assert len(moe_routers(model)) == num_moe
    ids = _ids()
    with torch.no_grad():
        ref, ref_masks = hf_forward(hf, ids)
        got, got_masks = mcore_forward(model, ids)
    assert got.shape == ref.shape == (3, 24, 51)
    assert (got - ref).abs().max().item() <= 1e-4
    assert len(got_masks) == len(ref_masks) > 0
    assert all(int(m.sum(-1).unique().item()) == cfg.num_experts_per_tok for m in got_masks)
    assert topk_mismatches(got_masks, ref_masks) == [0] * len(ref_masks)
    # routing is not degenerate: several experts are used in every MoE layer
    assert all(int(m.any(dim=(0, 1)).sum()) >= 4 for m in got_masks)


def test_gradients_match_transformers():
    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=2)
    model = build_gpt_model(cfg)
    load_hf_model_into_megatron(model, hf)
    # no pad token (id 0): transformers' embedding has padding_idx=0 and never gives that row a
    # gradient, Megatron's does (irrelevant in training: pad positions carry no loss)
    ids = _ids(B=2, S=16, seed=1, low=1)
    w = torch.randn(2, 16, 51, generator=torch.Generator().manual_seed(3))
    (hf(ids).logits * w).sum().backward()
    (mcore_forward(model, ids)[0] * w).sum().backward()
    grads = gather_to_hf({k: p.grad for k, p in model.named_parameters()}, cfg)
    for name, p in hf.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0, name
        assert (grads[name] - p.grad).abs().max().item() <= 1e-4 * max(scale, 1.0), name


def test_gather_round_trip_is_bit_exact_and_keeps_dtype():
    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=4)
    model = build_gpt_model(cfg, vocab_pad_multiple=16)
    load_hf_model_into_megatron(model, hf)
    sd = hf.state_dict()
    got = gather_hf_state_dict(model)
    assert set(got) == set(sd)
    assert all(torch.equal(got[k], sd[k]) and got[k].dtype == torch.float32 for k in sd)
    per_expert = gather_hf_state_dict(model, layout="per_expert")
    assert torch.equal(per_expert["model.layers.2.mlp.experts.3.up_proj.weight"],
                       sd["model.layers.2.mlp.experts.gate_up_proj"][3, 32:])


def test_load_into_megatron_reports_missing_and_mismatched():
    cfg = tiny_qwen3_moe_config()
    sd = dict(build_tiny_model(cfg, seed=0).state_dict())
    model = build_gpt_model(cfg)
    before = model.embedding.word_embeddings.weight.clone()
    other = tiny_qwen3_moe_config(intermediate_size=96)  # the dense layer 0 differs
    with pytest.raises(ValueError, match=r"shape mismatches.*layers\.0\.mlp\.linear_fc1\.weight: got \(192, 64\)"):
        load_into_megatron(model, dict(build_tiny_model(other, seed=0).state_dict()), ep_rank=0, ep_size=1)
    other = tiny_qwen3_moe_config(moe_intermediate_size=16)
    with pytest.raises(ValueError, match="gate_up_proj has shape"):
        load_into_megatron(model, dict(build_tiny_model(other, seed=0).state_dict()), ep_rank=0, ep_size=1)
    assert torch.equal(model.embedding.word_embeddings.weight, before)  # nothing written
    # as EP rank 1 of 2 the weights hold 4 experts while the model (EP=1) has 8
    with pytest.raises(ValueError, match=r"missing keys: \[.*local_experts\.4"):
        load_into_megatron(model, sd, ep_rank=1, ep_size=2)


def test_dense_and_unsupported_configs_are_rejected():
    from transformers import Qwen3Config

    with pytest.raises(ValueError, match="no MoE layer"):
        transformer_config_from_hf(tiny_qwen3_moe_config(mlp_only_layers=[0, 1, 2]))
    with pytest.raises(ValueError, match="model_type='qwen3'"):
        transformer_config_from_hf(Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=128, vocab_size=51))
    with pytest.raises(ValueError, match="attention_bias=True"):
        transformer_config_from_hf(tiny_qwen3_moe_config(attention_bias=True))


# --- issue 40: Megatron's MoE fusions with Transformer Engine ---

@pytest.mark.parametrize("version,cuda,replay,permute,router", [
    (None, True, False, False, False),            # no TE
    ("2.0.0", True, False, False, False),         # below 2.1: neither
    ("2.1.0", True, False, True, False),          # fused permutation from 2.1
    ("2.6.0+cu12", True, False, True, False),     # the router's fusion from 2.7
    ("2.7.0", True, False, True, True),
    ("2.10.0.dev0+abc", True, False, True, True),  # versions compare as numbers, not strings
    ("2.8.0", True, True, True, False),           # routing replay: the fused top-k would bypass it
    ("2.8.0", False, False, False, False),        # no CUDA
    ("garbage", True, False, False, False),
])
def test_te_fusion_flags(version, cuda, replay, permute, router):
    from moe_gspo.mcore.model import te_fusion_flags

    assert te_fusion_flags(version, cuda=cuda, routing_replay=replay) == \
        {"moe_permute_fusion": permute, "moe_router_fusion": router}


def test_transformer_config_takes_the_fusion_flags(monkeypatch):
    """`transformer_config_from_hf` asks the TE version; without TE here (CPU) both fusions stay off, and a
    faked TE version reaches the decision (CUDA faked off, so the config stays buildable on the CPU)."""
    import moe_gspo.mcore.model as mm
    from moe_gspo.tiny import tiny_qwen3_moe_config

    cfg = mm.transformer_config_from_hf(tiny_qwen3_moe_config())
    assert cfg.moe_permute_fusion is False and cfg.moe_router_fusion is False
    asked = []
    monkeypatch.setattr(mm, "te_version", lambda: "2.8.0")
    real = mm.te_fusion_flags
    monkeypatch.setattr(mm, "te_fusion_flags", lambda v, **kw: (asked.append((v, kw)), real(v, **kw))[1])
    cfg = mm.transformer_config_from_hf(tiny_qwen3_moe_config(), enable_routing_replay=True)
    assert asked == [("2.8.0", {"cuda": torch.cuda.is_available(), "routing_replay": True})]
    assert cfg.moe_router_fusion is False

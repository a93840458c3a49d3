"""Issue 61, item 3: gpu_check's MFU setting at Qwen3-30B-A3B's own layer shapes (`--mfu-geometry
qwen3-30b-a3b-reduced`), its model FLOPs by the plan's formula, checked against a hand count.

The geometry goes the way a device run sends it: `gpu_check.mfu_bench_args` -> `memory_bench`'s parser ->
`memory_bench.geometry_from_args` -> the Qwen3-MoE config -> `build_gpt_model` (on the `meta` device: the real
Megatron model, 4 layers of 128 experts, allocating nothing) -> `gpu_check_report.learner_mfu` (the MFU
check's FLOPs, `moe_gspo.plan.flops`). The matmul parameters a token passes through are counted on the built
model's parameters as well as by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig

import benchmarks.gpu_check as gc
from benchmarks import gpu_check_report as gcr
from benchmarks import memory_bench as mb
from moe_gspo.mcore.model import build_gpt_model
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.plan.flops import active_matmul_params
from moe_gspo.plan.params import Geometry

# by hand, per MoE layer of Qwen3-30B-A3B: fused QKV (32 + 2 x 4) x 128 x 2048, output projection 2048 x 32 x 128,
# router 128 x 2048, 8 active experts x 3 x 768 x 2048; and the LM head 151,936 x 2048
QKV, PROJ, ROUTER, EXPERTS = 10_485_760, 8_388_608, 262_144, 37_748_736
HEAD = 311_164_928
N_ACTIVE_4_LAYERS = 4 * (QKV + PROJ + ROUTER + EXPERTS) + HEAD  # 538,705,920


def reduced_qwen3_config(layers: int = 4) -> Qwen3MoeConfig:
    opts = gc.mfu_bench_args(**dict(gc.MFU_DEFAULTS, geometry="qwen3-30b-a3b-reduced", layers=layers))
    return Qwen3MoeConfig(**mb.geometry_from_args(mb.build_parser().parse_args(opts)))


def test_the_reduced_qwen3_geometry_reaches_the_bench_with_its_shapes():
    hf = reduced_qwen3_config(6)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
            hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == \
        (2048, 6, 128, 8, 768, 32, 4, 128, 151_936)
    assert hf.norm_topk_prob and not hf.tie_word_embeddings
    from moe_gspo.plan.from_config import _hf_config_from_json, shipped_model_configs

    real = Geometry.from_hf(_hf_config_from_json(shipped_model_configs()["Qwen3-30B-A3B"]))  # its config.json
    reduced = Geometry.from_hf(hf)
    assert reduced == Geometry(**{**vars(real), "num_layers": 6, "moe_layers": real.moe_layers[:6]})
    opts = gc.mfu_bench_args(**gc.MFU_DEFAULTS)
    assert opts[opts.index("--token-dispatcher") + 1] == "allgather"  # training's default dispatcher
    with pytest.raises(ValueError, match="--mfu-geometry"):
        gc.mfu_geometry("qwen3-235b")
    with pytest.raises(SystemExit):
        gc.main(["--out", "x", "--mfu-geometry", "default,nope"])


def test_reduced_qwen3_on_meta_flops_match_a_hand_count():
    hf = reduced_qwen3_config(4)
    init_distributed(ep_size=1, num_experts=hf.num_experts, seed=0)
    try:
        with torch.device("meta"):
            model = build_gpt_model(hf, params_dtype=torch.bfloat16, device="meta", expert_layout="grouped")
    finally:
        destroy_distributed()
    E, k = hf.num_experts, hf.num_experts_per_tok
    counted, names = 0, []
    for name, p in model.named_parameters():
        assert p.device.type == "meta", name
        if name.endswith("word_embeddings.weight") or "layernorm" in name:  # a lookup; norms
            continue
        names.append(name)
        counted += p.numel() * k // E if ".experts." in name else p.numel()
    assert any(".experts.weight1" in n for n in names) and any("router" in n for n in names)
    assert counted == N_ACTIVE_4_LAYERS == active_matmul_params(Geometry.from_hf(hf))
    # the MFU check's FLOPs of 32 sequences of 1024 tokens: 6 N + 12 L a d T per token (PaLM)
    T, seqs = 1024, 32
    by_hand = seqs * (6 * N_ACTIVE_4_LAYERS * T + 12 * 4 * 32 * 128 * T * T)
    bench = {"variant": "dist", "hf_config": hf.to_dict(), "token_dispatcher": "allgather",
             "batch": {"num_seqs": seqs, "seq_len": T, "micro_batch_size": 4, "recompute": False},
             "phases": {"update": {"seconds": [2.0, 1.0]}, "logprobs": {"seconds": [0.5]}}}
    got = gcr.learner_mfu(bench, 989.4)
    assert got["update"]["model_tflop"] == round(by_hand / 1e12, 3)
    assert got["logprobs"]["model_tflop"] == round(by_hand / 3 / 1e12, 3)
    assert got["update"]["mfu"] == round(by_hand / 1.0 / 989.4e12, 4)  # the fastest repeat
    assert "2048" in got["setting"] and "128 experts top-8" in got["setting"] and "allgather" in got["setting"]

"""RoPE as one autograd function (moe_gspo/mcore/fused_rope.py): bit-identical to Megatron's unfused RoPE."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from moe_gspo.mcore.fused_rope import rope_bshd
from moe_gspo.mcore.model import build_gpt_model
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.mcore.shims import have_transformer_engine
from moe_gspo.mcore.weights import load_hf_model_into_megatron
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

from ._mcore_parity import logits_and_grads


def _out_and_grad(fn, t, freqs, grad):
    t = t.clone().requires_grad_(True)
    out = fn(t, freqs)
    out.backward(grad)
    return out.detach(), t.grad


@pytest.mark.parametrize("rot_dim", [32, 16])  # all of the head dim, or part of it (the rest passes through)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradient_are_bit_identical_to_megatron(rot_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(27, 5, 4, 32, generator=gen).to(dtype)  # [s, b, heads, head_dim]
    freqs = torch.randn(27, 1, 1, rot_dim, generator=gen)
    grad = torch.randn(27, 5, 4, 32, generator=gen).to(dtype)
    ref_out, ref_grad = _out_and_grad(_apply_rotary_pos_emb_bshd, t, freqs, grad)
    out, g = _out_and_grad(rope_bshd, t, freqs, grad)
    assert torch.equal(out, ref_out) and torch.equal(g, ref_grad)
    assert not torch.equal(out, t)  # it rotated something
    # a non-contiguous view, as Megatron's query/key split of the fused qkv produces
    wide = torch.randn(27, 5, 4, 64, generator=gen).to(dtype)[..., :32]
    assert torch.equal(rope_bshd(wide, freqs), _apply_rotary_pos_emb_bshd(wide, freqs))


def test_new_frequencies_are_not_served_from_the_cache():
    t = torch.randn(7, 2, 2, 8)
    a, b = torch.randn(7, 1, 1, 8), torch.randn(7, 1, 1, 8)
    for freqs in (a, b, a):
        assert torch.equal(rope_bshd(t, freqs), _apply_rotary_pos_emb_bshd(t, freqs))
    a.mul_(2.0)  # changed in place: same object, new version
    assert torch.equal(rope_bshd(t, a), _apply_rotary_pos_emb_bshd(t, a))
    for value in (0.3, 0.7, 1.1):  # fresh tensors of one shape, each freed after use (the cache holds the last)
        assert torch.equal(rope_bshd(t, torch.full((7, 1, 1, 8), value)),
                           _apply_rotary_pos_emb_bshd(t, torch.full((7, 1, 1, 8), value)))


def test_model_with_fused_rope_matches_the_unfused_model_exactly():
    if have_transformer_engine():
        pytest.skip("with Transformer Engine the fused RoPE is TE's kernel")
    init_distributed(ep_size=1, num_experts=8, seed=0)
    try:
        cfg = tiny_qwen3_moe_config()
        hf = build_tiny_model(cfg, seed=0)
        unfused, fused = build_gpt_model(cfg, fused_rope=False), build_gpt_model(cfg)  # the default is fused
        assert not unfused.config.apply_rope_fusion and fused.config.apply_rope_fusion
        assert rope_utils.fused_apply_rotary_pos_emb is rope_bshd
        for m in (unfused, fused):
            load_hf_model_into_megatron(m, hf)
        ids = torch.randint(3, cfg.vocab_size, (5, 13), generator=torch.Generator().manual_seed(1))
        (l0, g0), (l1, g1) = logits_and_grads((unfused, fused), ids)
        assert torch.equal(l0, l1)
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    finally:
        destroy_distributed()

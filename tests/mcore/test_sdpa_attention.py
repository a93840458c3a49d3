"""SDPA core attention (moe_gspo/mcore/sdpa_attention.py): upstream's local attention, one fused call."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from moe_gspo.mcore.model import build_gpt_model, causal_mask
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.mcore.sdpa_attention import SDPADotProductAttention
from moe_gspo.mcore.weights import load_hf_model_into_megatron
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

from ._mcore_parity import logits_and_grads, max_abs_diff


@pytest.fixture(scope="module", autouse=True)
def dist_ep1():
    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    yield info
    destroy_distributed()


def _core(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


@pytest.mark.parametrize("tiny", [{}, {"num_key_value_heads": 4}])  # grouped-query (4 / 2 heads) and plain
def test_same_logits_and_gradients_as_upstream_attention(tiny):
    cfg = tiny_qwen3_moe_config(**tiny)
    hf = build_tiny_model(cfg, seed=0)
    upstream, fused = build_gpt_model(cfg, sdpa_attention=False), build_gpt_model(cfg)  # the default is SDPA
    assert {type(c) for c in _core(upstream)} == {DotProductAttention}
    assert {type(c) for c in _core(fused)} == {SDPADotProductAttention}
    assert upstream.state_dict().keys() == fused.state_dict().keys()  # no parameters of its own
    ids = torch.randint(3, cfg.vocab_size, (5, 13), generator=torch.Generator().manual_seed(1))
    for m in (upstream, fused):
        load_hf_model_into_megatron(m, hf)
    (l0, g0), (l1, g1) = logits_and_grads((upstream, fused), ids)
    assert (l0 - l1).abs().max() <= 1e-5
    assert max_abs_diff(g0, g1) <= 1e-5
    assert max(float(g.abs().max()) for n, g in g1.items() if "linear_qkv" in n) > 1e-4  # attention got gradient


def test_the_mask_is_applied_as_given_and_unsupported_cases_fall_back():
    cfg = tiny_qwen3_moe_config()
    core = _core(build_gpt_model(cfg))[0]
    gen = torch.Generator().manual_seed(3)
    sq, b, heads, groups, dim = 6, 2, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(sq, b, heads, dim, generator=gen)
    k, v = (torch.randn(sq, b, groups, dim, generator=gen) for _ in range(2))
    mask = causal_mask(sq, "cpu").clone()
    mask[..., 1] = True  # a non-causal pattern too: nobody attends to position 1 (row 1 still sees 0)
    got = core(q, k, v, mask)
    want = DotProductAttention.forward(core, q, k, v, mask)
    assert got.shape == want.shape == (sq, b, heads * dim)
    assert (got - want).abs().max() <= 1e-5
    assert not torch.allclose(got, core(q, k, v, causal_mask(sq, "cpu")), atol=1e-3)  # the mask mattered
    assert core._fused_ok(None, None, None)  # no mask on a causal layer: SDPA's is_causal
    assert not core._fused_ok(mask, torch.zeros(1), None)  # an attention bias: upstream's path (which refuses it)


def test_no_mask_is_plain_causal_bit_identical_to_the_explicit_mask():
    """Issue 31: the learner passes no mask where every layer takes it as causal (SDPA's `is_causal`, the flash
    kernel on CUDA); same bits as the explicit causal mask, forward and backward, on the whole model."""
    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=0)
    model = build_gpt_model(cfg)
    assert model.implicit_causal_mask and not build_gpt_model(cfg, sdpa_attention=False).implicit_causal_mask
    load_hf_model_into_megatron(model, hf)
    core = _core(model)[0]
    q = torch.randn(9, 2, cfg.num_attention_heads, cfg.head_dim, requires_grad=True)
    k, v = (torch.randn(9, 2, cfg.num_key_value_heads, cfg.head_dim, requires_grad=True) for _ in range(2))
    # bitwise: the property under test. Both calls take torch's CPU flash-attention kernel on the same shapes (the
    # causal flag and the explicit causal mask mask the same scores); checked on AMX, AVX-512 and AVX2-only CPUs
    outs = [core(q, k, v, m) for m in (None, causal_mask(9, "cpu"))]
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
    # upstream's path (what SDPA does not cover) gets the implied mask made explicit on the CPU
    core._fused_ok = lambda *args: False
    a, b = core(q, k, v, None), core(q, k, v, causal_mask(9, "cpu"))
    del core._fused_ok
    assert (a - b).abs().max() == 0 and (a - outs[1]).abs().max() <= 1e-5
    ids = torch.randint(3, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    model.implicit_causal_mask = False
    (l0, g0), = logits_and_grads((model,), ids)
    model.implicit_causal_mask = True
    model.zero_grad(set_to_none=True)
    (l1, g1), = logits_and_grads((model,), ids)
    assert torch.equal(l0, l1) and max_abs_diff(g0, g1) == 0

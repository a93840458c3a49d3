"""`model.batched_experts`: the MoE layers' local experts as two grouped (CPU) or padded batched matmuls
(`moe_gspo.mcore.batched_experts`), same parameters and maths as Megatron's SequentialMLP loop."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

import moe_gspo.mcore.batched_experts as be
from moe_gspo.mcore.batched_experts import BatchedSequentialMLP
from moe_gspo.mcore.model import build_gpt_model, moe_layer_ids
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.mcore.weights import load_hf_model_into_megatron
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

from ._mcore_parity import logits_and_grads, max_abs_diff


@pytest.fixture(scope="module", autouse=True)
def dist_ep1():
    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    yield info
    destroy_distributed()


@pytest.fixture(params=["grouped", "padded_bmm"])
def path(request, monkeypatch):
    """Each test runs on both paths: `torch._grouped_mm` (what the CPU takes) and the padded bmm fallback."""
    calls = []
    real = be._grouped_mm_ok

    def spy(x, ffn):
        ok = real(x, ffn) and request.param == "grouped"
        calls.append(ok)
        return ok

    monkeypatch.setattr(be, "_grouped_mm_ok", spy)
    yield request.param, calls


def _pair(**tiny):
    cfg = tiny_qwen3_moe_config(**tiny)
    hf = build_tiny_model(cfg, seed=0)
    plain, batched = build_gpt_model(cfg), build_gpt_model(cfg, batched_experts=True)
    for m in (plain, batched):
        load_hf_model_into_megatron(m, hf)
        m.train()
    return cfg, plain, batched


@pytest.mark.parametrize("tiny", [{}, {"norm_topk_prob": False}])
def test_same_parameters_logits_and_gradients(tiny, path):
    cfg, plain, batched = _pair(**tiny)
    kinds = [type(m) for m in batched.modules() if isinstance(m, SequentialMLP)]
    assert kinds == [BatchedSequentialMLP] * len(moe_layer_ids(cfg))
    assert not any(type(m) is BatchedSequentialMLP for m in plain.modules())
    assert plain.state_dict().keys() == batched.state_dict().keys()
    ids = torch.randint(3, cfg.vocab_size, (5, 13), generator=torch.Generator().manual_seed(1))
    (l0, g0), (l1, g1) = logits_and_grads((plain, batched), ids)
    assert (l0 - l1).abs().max() <= 1e-5
    assert max_abs_diff(g0, g1) <= 1e-5
    assert max(float(g.abs().max()) for n, g in g1.items() if "local_experts" in n) > 1e-4  # experts got gradient
    name, calls = path
    assert calls and all(calls) == (name == "grouped")  # the tiny model's widths take the grouped path on CPU


def _experts(cfg, batched):
    return next(m for m in batched.modules() if isinstance(m, BatchedSequentialMLP))


def test_experts_without_tokens_and_uneven_counts(path):
    cfg, plain, batched = _pair()
    experts = _experts(cfg, batched)
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=gen, requires_grad=True)
    probs = torch.rand(int(counts.sum()), generator=gen)
    got, _ = experts(x, counts, probs)
    want, _ = SequentialMLP.forward(experts, x, counts, probs)  # Megatron's loop on the same weights
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-6
    gx_got, = torch.autograd.grad(got.square().sum(), x)
    gx_want, = torch.autograd.grad(want.square().sum(), x)
    assert (gx_got - gx_want).abs().max() <= 1e-5
    # an expanded incoming gradient (d sum / d out = ones with zero strides): the weights' gradients too
    weights = [p for e in experts.local_experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
    g_got = torch.autograd.grad(experts(x, counts, probs)[0].sum(), weights)
    g_want = torch.autograd.grad(SequentialMLP.forward(experts, x, counts, probs)[0].sum(), weights)
    assert max(float((a - b).abs().max()) for a, b in zip(g_got, g_want)) <= 1e-5
    assert float(g_got[2].abs().max()) == 0.0  # expert 1 had no token: no gradient
    empty, _ = experts(x[:0], torch.zeros(8, dtype=torch.long), probs[:0])  # a rank with no tokens
    assert empty.shape == (0, cfg.hidden_size)


def test_widths_off_the_grouped_kernels_stride_rule_take_the_padded_path():
    """`_grouped_mm` needs 16-byte row strides: an expert width of 6 fp32 values (24 bytes) falls back."""
    cfg, plain, batched = _pair(moe_intermediate_size=6)
    experts = _experts(cfg, batched)
    x = torch.randn(9, cfg.hidden_size)
    assert be._grouped_mm_ok(x, cfg.hidden_size) and not be._grouped_mm_ok(x, 6)
    counts = torch.tensor([2, 0, 3, 1, 0, 1, 2, 0])
    probs = torch.rand(9)
    got, _ = experts(x, counts, probs)
    want, _ = SequentialMLP.forward(experts, x, counts, probs)
    assert (got - want).abs().max() <= 1e-6

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
    real = be.grouped_mm_supported

    def spy(x, ffn, **kw):
        ok = real(x, ffn, **kw) and request.param == "grouped"
        calls.append(ok)
        return ok

    monkeypatch.setattr(be, "grouped_mm_supported", spy)
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
    assert be.grouped_mm_supported(x, cfg.hidden_size) and not be.grouped_mm_supported(x, 6)
    counts = torch.tensor([2, 0, 3, 1, 0, 1, 2, 0])
    probs = torch.rand(9)
    got, _ = experts(x, counts, probs)
    want, _ = SequentialMLP.forward(experts, x, counts, probs)
    assert (got - want).abs().max() <= 1e-6


def test_expert_weights_are_viewed_without_a_copy_and_a_broken_layout_copies():
    """Issue 31: the stacked `[E, out, in]` weights are a view of one storage (no copy per forward); when
    someone moves a parameter the forward still computes the same, with a counted copy."""
    cfg, plain, batched = _pair()
    experts = _experts(cfg, batched)
    fc1 = [e.linear_fc1.weight for e in experts.local_experts]
    view = be.stacked_view(fc1)
    assert view is not None and view.data_ptr() == fc1[0].data_ptr() and view.shape == (8, *fc1[0].shape)
    assert all(p._base is None for p in fc1)  # plain parameters (Megatron's DDP asserts on views)
    assert torch.equal(view[5], fc1[5])
    ids = torch.randint(3, cfg.vocab_size, (4, 9), generator=torch.Generator().manual_seed(4))
    (_, g_view), = logits_and_grads((batched,), ids)
    assert experts.num_weight_copies == 0
    batched.zero_grad(set_to_none=True)
    with torch.no_grad():
        fc1[3].data = fc1[3].detach().clone()  # its own storage: the layout is broken
    assert be.stacked_view(fc1) is None
    (_, g_copy), = logits_and_grads((batched,), ids)
    assert experts.num_weight_copies > 0 and max_abs_diff(g_view, g_copy) == 0
    experts.stack_weights_()
    assert be.stacked_view(fc1) is not None
    assert be.stacked_view([fc1[0], fc1[1], fc1[3]]) is None  # not one constant step
    assert be.stacked_view([fc1[1], fc1[0]]) is None  # descending


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                    reason="needs CUDA with compute capability major 9 or 10 (torch._grouped_mm in bf16)")
def test_cuda_grouped_gemm_matches_the_loop_in_bf16_without_a_host_sync():
    cfg = tiny_qwen3_moe_config()
    model = build_gpt_model(cfg, batched_experts=True, params_dtype=torch.bfloat16, device="cuda")
    experts = _experts(cfg, model)
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])  # on the host, as Megatron's dispatchers give them
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    probs = torch.rand(int(counts.sum()), generator=gen).to("cuda", torch.bfloat16)
    assert be.grouped_mm_supported(x, cfg.moe_intermediate_size)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, _ = experts(x, counts, probs)
        got.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want, _ = SequentialMLP.forward(experts, x.detach().requires_grad_(), counts, probs)
    assert (got.float() - want.float()).abs().max() <= 2e-2
    assert experts.num_weight_copies == 0


# --- issue 40: the fast grouped GEMM only on capability majors 9 and 10; major 10 masks empty experts ---

class _FakeCudaActivations:
    """What `grouped_mm_supported` reads of the activations, on a CUDA device that need not exist."""

    def __init__(self, width: int, dtype=torch.bfloat16):
        self.shape, self.dtype, self.device = (4, width), dtype, torch.device("cuda", 0)

    def element_size(self):
        return torch.empty(0, dtype=self.dtype).element_size()

    def data_ptr(self):
        return 256


@pytest.mark.parametrize("major,grouped,masked", [(7, False, False), (8, False, False), (9, True, False),
                                                  (10, True, True), (11, False, False), (12, False, False)])
def test_grouped_path_only_on_capability_majors_9_and_10(monkeypatch, major, grouped, masked):
    asked = []
    monkeypatch.setattr(be, "_cuda_capability", lambda d: (asked.append(d), (major, 0))[1])
    assert be.grouped_mm_supported(_FakeCudaActivations(64), 128) is grouped
    assert not be.grouped_mm_supported(_FakeCudaActivations(64, torch.float32), 128)  # fp32 on CUDA: padded bmm
    assert not be.grouped_mm_supported(_FakeCudaActivations(60), 128)  # 120-byte rows: off the stride rule
    assert be.masks_empty_expert_grads(torch.device("cuda", 0)) is masked
    assert asked  # the capability was asked, of the CUDA device
    assert not be.masks_empty_expert_grads(torch.device("cpu"))
    assert be.grouped_mm_supported(torch.randn(4, 64), 128)  # the CPU kernel whatever the GPU


def test_mask_empty_expert_grads_zeroes_only_the_empty_experts():
    w = torch.randn(4, 3, 2, requires_grad=True)
    nonempty = torch.tensor([True, False, True, False])
    out = be.mask_empty_expert_grads(w, nonempty)
    assert torch.equal(out, w)
    incoming = torch.randn(4, 3, 2)
    incoming[1] = float("nan")  # garbage where the expert got no token (pytorch#172439)
    incoming[3] = 5.0
    (out * incoming).sum().backward()
    assert torch.equal(w.grad[[0, 2]], incoming[[0, 2]])
    assert (w.grad[[1, 3]] == 0).all()


def test_masked_grouped_path_on_cpu_equals_the_loop(monkeypatch):
    """The forward with the major-10 masking switched on (faked on the CPU): same output and gradients as
    Megatron's loop, zero gradients for the experts without tokens; offsets go through `to_device_pinned`."""
    monkeypatch.setattr(be, "masks_empty_expert_grads", lambda device, **kw: True)
    moved = []
    real_move = be.to_device_pinned
    monkeypatch.setattr(be, "to_device_pinned", lambda t, d: (moved.append(t.dtype), real_move(t, d))[1])
    cfg, plain, batched = _pair()
    experts = _experts(cfg, batched)
    gen = torch.Generator().manual_seed(6)
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=gen, requires_grad=True)
    probs = torch.rand(int(counts.sum()), generator=gen)
    weights = [p for e in experts.local_experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
    got, _ = experts(x, counts, probs)
    assert moved == [torch.int32, torch.bool]
    g_got = torch.autograd.grad(got.square().sum(), weights)
    want, _ = SequentialMLP.forward(experts, x, counts, probs)
    g_want = torch.autograd.grad(want.square().sum(), weights)
    assert (got - want).abs().max() <= 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(g_got, g_want)) <= 1e-5
    for e in (1, 4, 5):
        assert float(g_got[2 * e].abs().max()) == 0.0 and float(g_got[2 * e + 1].abs().max()) == 0.0


def test_to_device_pinned_on_the_cpu_is_a_plain_move():
    t = torch.tensor([1, 2, 3])
    assert torch.equal(be.to_device_pinned(t, torch.device("cpu")), t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path_selection_and_empty_experts_get_zero_gradient():
    """On the real GPU: majors 9 / 10 take `_grouped_mm` (10 with the masking), others the padded bmm; either
    way the output matches the loop, no host sync, and experts without tokens get exactly zero gradient."""
    cfg = tiny_qwen3_moe_config()
    model = build_gpt_model(cfg, batched_experts=True, params_dtype=torch.bfloat16, device="cuda")
    experts = _experts(cfg, model)
    major = torch.cuda.get_device_capability()[0]
    gen = torch.Generator().manual_seed(7)
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    probs = torch.rand(int(counts.sum()), generator=gen).to("cuda", torch.bfloat16)
    assert be.grouped_mm_supported(x, cfg.moe_intermediate_size) == (major in (9, 10))
    assert be.masks_empty_expert_grads(x.device) == (major == 10)
    weights = [p for e in experts.local_experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
    torch.cuda.synchronize()
    if major in (9, 10):
        torch.cuda.set_sync_debug_mode("error")
    try:
        got, _ = experts(x, counts, probs)
        grads = torch.autograd.grad(got.float().square().sum(), weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want, _ = SequentialMLP.forward(experts, x.detach(), counts, probs)
    assert (got.float() - want.float()).abs().max() <= 2e-2
    for e in (1, 4, 5):
        assert float(grads[2 * e].abs().max()) == 0.0 and float(grads[2 * e + 1].abs().max()) == 0.0
    assert max(float(g.abs().max()) for g in grads) > 0

"""The grouped experts' fused SwiGLU with routing probabilities (`moe_gspo.mcore.swiglu`, issue 48): Megatron's
`weighted_bias_swiglu_impl` maths saving only the fc1 output and the probabilities; used on CUDA, while the
CPU keeps today's unfused maths bit for bit."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import moe_gspo.mcore.batched_experts as be
import moe_gspo.mcore.grouped_experts as ge
import moe_gspo.mcore.swiglu as sw
from moe_gspo.mcore.batched_experts import mlp_activation
from moe_gspo.mcore.swiglu import SwiGLUWithProbs, swiglu_fusable, swiglu_probs_forward, swiglu_with_probs

# the activation's config as megatron's TransformerConfig gives it (moe_gspo.mcore.model.transformer_config_from_hf)
CFG = types.SimpleNamespace(gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=None,
                            glu_linear_offset=0.0)


def _inputs(T=37, Fw=24, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, 2 * Fw, generator=gen, dtype=torch.float64) * 2).to(dtype)
    probs = torch.rand(T, generator=gen, dtype=torch.float64).to(torch.float32 if dtype != torch.float64 else dtype)
    g = torch.randn(T, Fw, generator=gen, dtype=torch.float64).to(dtype)
    return h, probs, g


def _saved(fn, *args):
    """(output, [saved tensors' shapes], saved bytes) of `fn(*args)` under autograd (distinct storages once)."""
    saved, storages = [], {}

    def pack(t):
        saved.append(tuple(t.shape))
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved, sum(storages.values())


def _value_and_grads(fn, h, probs, g):
    h, probs = h.detach().requires_grad_(), probs.detach().requires_grad_()
    out = fn(h, probs)
    dh, dp = torch.autograd.grad(out, [h, probs], g)
    return out.detach(), dh, dp


def test_fused_maths_equals_the_unfused_in_fp64_and_to_bf16_rounding_in_bf16():
    """Value and both gradients (fc1 output, probabilities) against today's `mlp_activation` under autograd:
    fp64 to 1e-12 (the same function), bf16 to the dtype's rounding; the offset term too."""
    for offset in (0.0, 0.5):
        cfg = types.SimpleNamespace(**{**vars(CFG), "glu_linear_offset": offset})
        h, probs, g = _inputs()
        fused = _value_and_grads(lambda a, p: swiglu_with_probs(a, p, offset=offset), h, probs, g)
        unfused = _value_and_grads(lambda a, p: mlp_activation(cfg, a, p), h, probs, g)
        for a, b in zip(fused, unfused):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        hb, gb, pf = h.to(torch.bfloat16), g.to(torch.bfloat16), probs.float()  # Megatron's fp32 probabilities
        fused_b = _value_and_grads(lambda a, p: swiglu_with_probs(a, p, offset=offset), hb, pf, gb)
        unfused_b = _value_and_grads(lambda a, p: mlp_activation(cfg, a, p), hb, pf, gb)
        assert [t.dtype for t in fused_b] == [t.dtype for t in unfused_b] == [torch.bfloat16, torch.bfloat16,
                                                                            torch.float32]
        exact = _value_and_grads(lambda a, p: mlp_activation(cfg, a, p), hb.double(), pf.double(), gb.double())
        for a, b, x in zip(fused_b, unfused_b, exact):
            # the fused function rounds once (float32 inside), the unfused after every op: both within a few
            # bf16 steps of the fp64 truth, and of each other
            scale = float(x.abs().max())
            assert float((a.double() - x).abs().max()) <= 2 ** -7 * scale
            assert float((b.double() - x).abs().max()) <= 2 ** -6 * scale
            torch.testing.assert_close(a.double(), b.double(), rtol=2 ** -6, atol=2 ** -6 * scale)


def test_fused_saves_only_the_fc1_output_and_the_probabilities():
    """Megatron's fused function keeps `h` [T, 2F] and the probabilities; the unfused maths 3 more [T, F]
    tensors (SiLU output, offset `up`, GLU product): ~150 MB per MoE layer at 30B shapes (issue 48)."""
    T, Fw = 37, 24
    h, probs, _ = _inputs(T, Fw, dtype=torch.bfloat16)
    h.requires_grad_()
    probs.requires_grad_()
    _, fused_shapes, fused_bytes = _saved(lambda: swiglu_with_probs(h, probs))
    assert sorted(fused_shapes) == sorted([(T, 2 * Fw), (T,)])
    assert fused_bytes == T * 2 * Fw * 2 + T * 4
    _, unfused_shapes, unfused_bytes = _saved(lambda: mlp_activation(CFG, h, probs))
    assert unfused_shapes.count((T, Fw)) >= 3
    assert unfused_bytes - fused_bytes >= 3 * T * Fw * 2


def test_fusable_configs():
    assert swiglu_fusable(CFG)
    assert not swiglu_fusable(types.SimpleNamespace(**{**vars(CFG), "activation_func": F.gelu}))
    assert not swiglu_fusable(types.SimpleNamespace(**{**vars(CFG), "gated_linear_unit": False}))
    assert not swiglu_fusable(types.SimpleNamespace(**{**vars(CFG), "activation_func_clamp_value": 7.0}))


def test_a_failed_compile_warns_once_and_runs_the_same_maths_uncompiled(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.\nmore")

    monkeypatch.setattr(torch, "compile", no_compiler)
    compiled = sw._Compiled()
    h, probs, g = _inputs(dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="torch.compile of the experts' SwiGLU failed .*C compiler"):
        out = compiled("forward", h, probs, 0.0)
    assert torch.equal(out, swiglu_probs_forward(h, probs, 0.0))  # the same function, uncompiled
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        dh, dp = compiled("backward", g, h, probs, 0.0)
    assert compiled.error.startswith("RuntimeError: Failed to find C compiler") and "\n" not in compiled.error
    want = sw.swiglu_probs_backward(g, h, probs, 0.0)
    assert torch.equal(dh, want[0]) and torch.equal(dp, want[1])


def test_an_out_of_memory_is_not_taken_for_a_compile_failure(monkeypatch):
    def oom(fn, **kw):
        def run(*args):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return run

    monkeypatch.setattr(torch, "compile", oom)
    compiled = sw._Compiled()
    h, probs, _ = _inputs(dtype=torch.float32)
    with pytest.raises(torch.OutOfMemoryError):
        compiled("forward", h, probs, 0.0)
    assert compiled.error is None


def _tiny_grouped_experts(dtype=torch.bfloat16):
    from moe_gspo.mcore.grouped_experts import expert_modules
    from moe_gspo.mcore.model import build_gpt_model
    from moe_gspo.tiny import tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config()
    model = build_gpt_model(cfg, params_dtype=dtype, expert_layout="grouped")
    return cfg, expert_modules(model)[0]


def _experts_step(experts, cfg, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(int(counts.sum()), generator=gen).requires_grad_()
    out, _ = experts(x, counts, probs)
    grads = torch.autograd.grad(out.float().square().sum(), [x, probs, experts.weight1, experts.weight2])
    return x, probs, counts, out.detach(), grads


@pytest.fixture(scope="module")
def dist_ep1():
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed

    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    yield info
    destroy_distributed()


def test_cpu_grouped_experts_keep_todays_unfused_maths_bit_for_bit(dist_ep1, monkeypatch):
    """On the CPU the grouped layout's experts compute exactly today's composition (`gmm`, `mlp_activation`,
    `gmm`: the same kernels on the same operands, so bit for bit), in bf16; the fused function is not used."""
    calls = []
    monkeypatch.setattr(ge, "swiglu_with_probs", lambda *a, **k: calls.append(1))
    cfg, experts = _tiny_grouped_experts()
    x, probs, counts, out, grads = _experts_step(experts, cfg)
    assert not calls
    E, H = cfg.num_experts, cfg.hidden_size
    xr, pr = x.detach().requires_grad_(), probs.detach().requires_grad_()
    h = ge.gmm(xr, experts.weight1.view(E, H, -1), counts)
    want = ge.gmm(mlp_activation(experts.config, h, pr), experts.weight2.view(E, -1, H), counts)
    want_grads = torch.autograd.grad(want.float().square().sum(), [xr, pr, experts.weight1, experts.weight2])
    assert torch.equal(out, want.detach())
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_on_cuda_the_grouped_experts_take_the_fused_swiglu(dist_ep1, monkeypatch):
    """With the rows' device seen as CUDA sm90 (faked on the CPU: the fused maths run uncompiled there), the
    grouped experts save `h` and the probabilities only, and agree with today's unfused maths to bf16
    rounding (value and every gradient)."""
    cfg, experts = _tiny_grouped_experts()
    x, probs, counts, out_cpu, grads_cpu = _experts_step(experts, cfg)
    T, Fw = x.shape[0], cfg.moe_intermediate_size
    _, _, unfused_bytes = _saved(lambda: experts(x, counts, probs)[0])
    real = be.kernel_device
    monkeypatch.setattr(be, "kernel_device", lambda d: ("cuda", (9, 0)) if torch.device(d).type == "cpu" else real(d))
    x, probs, counts, out, grads = _experts_step(experts, cfg)
    scale = float(out_cpu.abs().max())
    torch.testing.assert_close(out.float(), out_cpu.float(), rtol=2 ** -6, atol=2 ** -6 * scale)
    for a, b in zip(grads, grads_cpu):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -5, atol=2 ** -5 * float(b.abs().max()))
    assert not torch.equal(out, out_cpu)  # another rounding: the fused function did run
    _, shapes, fused_bytes = _saved(lambda: experts(x, counts, probs)[0])
    assert shapes.count((T, Fw)) == 1  # fc2's input only
    assert unfused_bytes - fused_bytes == 3 * T * Fw * 2  # the SiLU output, the offset `up`, the GLU product


def test_after_a_compiled_call_succeeded_errors_are_not_taken_for_compile_failures(monkeypatch):
    """Once a function's compiled call ran, a later error (e.g. a sync under CUDA's sync debug mode, an illegal
    address) is raised, not hidden behind the uncompiled fallback."""
    state = {"fail": False}

    def compile_(fn, **kw):
        def run(*args):
            if state["fail"]:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", compile_)
    compiled = sw._Compiled()
    h, probs, _ = _inputs(dtype=torch.float32)
    assert torch.equal(compiled("forward", h, probs, 0.0), swiglu_probs_forward(h, probs, 0.0))
    state["fail"] = True
    with pytest.raises(RuntimeError, match="illegal memory access"):
        compiled("forward", h, probs, 0.0)
    assert compiled.error is None


def test_compile_status_in_words(monkeypatch):
    monkeypatch.setattr(sw, "COMPILED", sw._Compiled())
    assert sw.compile_status() == "not used"
    sw.COMPILED.ran.add("forward")
    assert sw.compile_status() == "compiled"
    sw.COMPILED.error = "RuntimeError: Failed to find C compiler"
    assert sw.compile_status() == "not compiled (RuntimeError: Failed to find C compiler)"

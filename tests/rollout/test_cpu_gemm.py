"""bf16 GEMMs as fp32 GEMMs of the bf16 values (moe_gspo/rollout/cpu_gemm.py): same rounding points as a
bf16 GEMM with fp32 accumulation, hence the same rollouts up to the order of fp32 additions."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.cpu_gemm import Fp32GemmForBf16, fp32_gemms_in, needs_fp32_gemm
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_gemms_inside_the_mode_are_fp32_gemms_of_the_bf16_values_rounded_once():
    x, w, w3 = _bf16(128, 64), _bf16(96, 64, seed=1), _bf16(4, 64, 32, seed=2)
    offs = torch.tensor([10, 10, 70, 128], dtype=torch.int32)  # an empty group too
    with Fp32GemmForBf16():
        lin, mm, gmm = F.linear(x, w), x @ w.T, torch._grouped_mm(x, w3, offs=offs)
        elementwise = x * 3  # not a GEMM: untouched, still bf16 arithmetic
    assert lin.dtype == mm.dtype == gmm.dtype == elementwise.dtype == torch.bfloat16
    assert torch.equal(lin, F.linear(x.float(), w.float()).bfloat16())
    assert torch.equal(mm, (x.float() @ w.float().T).bfloat16())
    assert torch.equal(gmm, torch._grouped_mm(x.float(), w3.float(), offs=offs).bfloat16())
    # ... and within one bf16 rounding of torch's own bf16 kernels (both accumulate in fp32)
    for ours, native in ((lin, F.linear(x, w)), (gmm, torch._grouped_mm(x, w3, offs=offs))):
        ulp = native.float().abs().clamp(min=1e-3) * 2.0 ** -7
        assert ((ours.float() - native.float()).abs() <= ulp).all()
    # fp32 inputs are left alone
    with Fp32GemmForBf16():
        assert F.linear(x.float(), w.float()).dtype == torch.float32


def test_applies_to_bf16_on_cpu_only():
    assert not needs_fp32_gemm("cpu", torch.float32)
    assert not needs_fp32_gemm("cuda", torch.bfloat16)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert needs_fp32_gemm("cpu", torch.bfloat16) == (not native)


def test_engine_rollouts_match_the_native_bf16_kernels():
    """Same seed, same weights: the same sampled tokens, and log-probs / routes equal but for rare
    one-ulp accumulation-order differences (as between any two bf16 GEMM kernels)."""
    model = build_tiny_model(seed=0)
    prompts = [[2, 5, 6, 7, 8, 9, 10, 11], [2, 9, 12, 13, 14, 15, 16, 17]]
    sampling = SamplingParams(n=8, max_new_tokens=10, seed=3)
    native = HFEngine(model, dtype="bfloat16", device="cpu", fp32_gemm=False).generate(prompts, sampling)
    ours = HFEngine(model, dtype="bfloat16", device="cpu", fp32_gemm=True).generate(prompts, sampling)
    assert all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(native, ours))
    dlogp = np.concatenate([np.abs(a.response_logprobs - b.response_logprobs) for a, b in zip(native, ours)])
    assert dlogp.max() < 1e-2 and np.mean(dlogp == 0) > 0.5
    same_routes = np.concatenate([(a.routes_TLK == b.routes_TLK).all(-1).ravel() for a, b in zip(native, ours)])
    assert same_routes.mean() > 0.98


def test_scoped_fp32_gemms_equal_the_mode_over_the_whole_model_and_restore_the_forwards():
    """`fp32_gemms_in` (the engine's: the mode only inside modules with their own parameters, nn.Linear
    directly) computes exactly what the mode over the whole forward computes: same logits bit for bit."""
    model = build_tiny_model(seed=0).to(torch.bfloat16)
    ids = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11], [2, 9, 12, 13, 14, 15, 16, 17]])
    with torch.inference_mode():
        with Fp32GemmForBf16():
            whole = model(input_ids=ids).logits
        x = _bf16(64, model.config.hidden_size, seed=1)
        with fp32_gemms_in(model):
            scoped = model(input_ids=ids).logits
            head = model.lm_head(x)
    assert torch.equal(whole, scoped)
    assert torch.equal(head, F.linear(x.float(), model.lm_head.weight.float()).bfloat16())
    assert not any("forward" in m.__dict__ for m in model.modules())

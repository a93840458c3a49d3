"""`model.expert_layout=grouped` (issue 40): the experts as one parameter per projection (megatron-core's legacy
`GroupedMLP`, `weight1` [H, E*2F] / `weight2` [E*F, H]) on `torch._grouped_mm`; the same function, weights and
gradients as the per-expert layout, HF names both ways, and no weight copy under the distributed optimizer."""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

import moe_gspo.mcore.batched_experts as be
import moe_gspo.mcore.grouped_experts as ge
from moe_gspo.mcore.checkpoint import load_megatron_from_hf_dir, save_hf_checkpoint, to_per_expert_layout
from moe_gspo.mcore.grouped_experts import (GroupedExperts, built_expert_layout, expert_modules, gmm,
                                            resolve_expert_layout, weight_copies)
from moe_gspo.mcore.model import build_gpt_model, forward_logits, moe_layer_ids
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.mcore.weight_stream import HFWeightStream
from moe_gspo.mcore.weights import _canonical_mcore, gather_hf_state_dict, load_hf_model_into_megatron, megatron_to_hf
from moe_gspo.tiny import build_tiny_model, make_tiny_checkpoint, tiny_qwen3_moe_config

from ._mcore_parity import logits_and_grads, max_abs_diff


@pytest.fixture(scope="module", autouse=True)
def dist_ep1():
    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    yield info
    destroy_distributed()


def _ids(B=5, S=13, vocab=51, seed=1):
    return torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _pair(**tiny):
    """(hf config, HF model, per-expert Megatron model, grouped Megatron model), the same HF weights, fp32."""
    cfg = tiny_qwen3_moe_config(**tiny)
    hf = build_tiny_model(cfg, seed=0)
    per, grouped = build_gpt_model(cfg), build_gpt_model(cfg, expert_layout="grouped")
    for m in (per, grouped):
        load_hf_model_into_megatron(m, hf)
    return cfg, hf, per, grouped


def test_builds_megatrons_grouped_mlp_with_one_parameter_per_projection():
    cfg, _, per, grouped = _pair()
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    experts = expert_modules(grouped)
    assert [type(m) for m in experts] == [GroupedExperts] * len(moe_layer_ids(cfg))
    assert all(isinstance(m, GroupedMLP) for m in experts) and grouped.config.moe_grouped_gemm
    assert [type(m) for m in expert_modules(per)] == [SequentialMLP] * len(moe_layer_ids(cfg))
    names = {n: tuple(p.shape) for n, p in grouped.named_parameters() if ".experts." in n}
    l = moe_layer_ids(cfg)[0]
    assert names[f"decoder.layers.{l}.mlp.experts.weight1"] == (H, E * 2 * F)
    assert names[f"decoder.layers.{l}.mlp.experts.weight2"] == (E * F, H)
    assert len(names) == 2 * len(moe_layer_ids(cfg))
    assert built_expert_layout(grouped) == "grouped" and built_expert_layout(per) == "per_expert"  # resume's fingerprint
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    assert gg.grouped_gemm_is_available() and gg.ops.gmm is gmm  # the shim (moe_gspo.mcore.shims)


def test_hf_to_grouped_to_hf_is_exact_in_both_hf_layouts():
    cfg, hf, _, grouped = _pair()
    ref = hf.state_dict()
    fused = gather_hf_state_dict(grouped, layout="fused")
    assert set(fused) == set(ref) and all(torch.equal(fused[k], ref[k]) for k in ref)
    per_expert = gather_hf_state_dict(grouped, layout="per_expert")
    want = to_per_expert_layout(ref, cfg)
    assert set(per_expert) == set(want) and all(torch.equal(per_expert[k], want[k]) for k in want)
    # expert 3 of layer 1 by hand: weight1's storage read [E, H, 2F], gate columns then up columns
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    w1 = grouped.decoder.layers[1].mlp.experts.weight1.detach().view(E, H, 2 * F)[3]
    assert torch.equal(w1[:, :F].t(), want["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(w1[:, F:].t(), want["model.layers.1.mlp.experts.3.up_proj.weight"])
    w2 = grouped.decoder.layers[1].mlp.experts.weight2.detach().view(E, F, H)[3]
    assert torch.equal(w2.t(), want["model.layers.1.mlp.experts.3.down_proj.weight"])
    # the Megatron state dict of one layout converts to the other's HF weights
    assert all(torch.equal(v, ref[k]) for k, v in megatron_to_hf(grouped.state_dict(), cfg).items())
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        _canonical_mcore(dict(grouped.named_parameters()))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_weight_stream_of_the_grouped_layout_equals_the_per_expert_models(layout):
    _, _, per, grouped = _pair()
    want = dict(HFWeightStream(per, layout=layout))
    got = [(n, t.clone()) for n, t in HFWeightStream(grouped, layout=layout)]
    assert [n for n, _ in got] == list(want) and all(torch.equal(t, want[n]) for n, t in got)


def test_checkpoint_round_trip(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ckpt", seed=7)
    model, cfg = load_megatron_from_hf_dir(path, expert_layout="grouped")
    assert isinstance(expert_modules(model)[0], GroupedExperts)
    out = save_hf_checkpoint(model, cfg, tmp_path / "saved", tokenizer_dir=path)
    again, _ = load_megatron_from_hf_dir(out)  # per-expert layout
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(forward_logits(again, ids), forward_logits(load_megatron_from_hf_dir(path)[0], ids))


@pytest.mark.parametrize("tiny", [{}, {"norm_topk_prob": False}])
def test_same_logits_and_gradients_as_the_per_expert_layout(tiny):
    cfg, _, per, grouped = _pair(**tiny)
    (l0, g0), (l1, g1) = logits_and_grads((per, grouped), _ids())
    assert (l0 - l1).abs().max() <= 1e-5
    g1 = _canonical_mcore(g1, ffn=cfg.moe_intermediate_size)  # weight{1,2} gradients as per-expert names
    assert g0.keys() == g1.keys()
    assert max_abs_diff(g0, g1) <= 1e-5
    assert max(float(g.abs().max()) for n, g in g1.items() if "local_experts" in n) > 1e-4


def test_experts_without_tokens_uneven_counts_and_no_token_at_all():
    cfg, _, per, grouped = _pair()
    seq = expert_modules(per)[0]
    experts = expert_modules(grouped)[0]
    gen = torch.Generator().manual_seed(2)
    for counts in ([3, 0, 5, 1, 0, 0, 7, 2], [0] * 8):
        counts = torch.tensor(counts)
        T = int(counts.sum())
        x = torch.randn(T, cfg.hidden_size, generator=gen)
        probs = torch.rand(T, generator=gen)
        outs = []
        for m in (seq, experts):
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            out, _ = m(xi, counts, probs)
            (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
            outs.append((out.detach(), xi.grad))
        assert outs[0][0].shape == outs[1][0].shape == (T, cfg.hidden_size)
        assert torch.allclose(outs[0][0], outs[1][0], rtol=0, atol=1e-5)
        assert torch.allclose(outs[0][1], outs[1][1], rtol=0, atol=1e-5)
        named = experts.named_parameters(prefix="decoder.layers.1.mlp.experts")
        grads = _canonical_mcore({n: p.grad for n, p in named}, ffn=cfg.moe_intermediate_size)
        assert len(grads) == 2 * cfg.num_experts  # every expert has a gradient, zero for the empty ones
        for e in torch.nonzero(counts == 0).flatten().tolist():
            assert not grads[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"].any()
        for e, fc in enumerate(seq.local_experts):
            g = grads[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            want = fc.linear_fc1.weight.grad
            assert (g - (want if want is not None else torch.zeros_like(g))).abs().max() <= 1e-5


# Two different kernels (`torch._grouped_mm` and a loop of per-expert `@`) are compared to a tolerance: on
# an AMX CPU they happened to agree bit for bit, on an AVX-512 or AVX2-only one they do not (issue 51).
# fp32: the order of fp32 additions (K = 16 terms of magnitude ~1); bf16: both round an fp32 accumulation to
# bf16, so they may differ by one bf16 step (2^-7 relative) where the fp32 sums straddle a rounding boundary.
GMM_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2.0 ** -7, atol=1e-3)}


def test_gmm_adapter_contract_in_fp32_and_bf16(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([2, 0, 3, 4])
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(9, 16, generator=gen).to(dtype)
        b = torch.randn(4, 16, 8, generator=gen).to(dtype)
        got = gmm(a, b, counts)
        assert got.dtype == dtype and got.shape == (9, 8)
        # the adapter adds no arithmetic: the same kernel on the same operands, bit for bit
        offs = torch.cumsum(counts, 0).to(torch.int32)
        assert torch.equal(got, torch._grouped_mm(a, b, offs=offs))
        # against the loop of per-expert GEMMs (another kernel) and an fp64 reference: to the dtype's tolerance
        want = torch.cat([x @ b[e] for e, x in enumerate(a.split(counts.tolist()))])
        exact = torch.cat([x.double() @ b[e].double() for e, x in enumerate(a.split(counts.tolist()))])
        torch.testing.assert_close(got, want, **GMM_TOLERANCE[dtype])
        torch.testing.assert_close(got.double(), exact, **GMM_TOLERANCE[dtype])
        transposed = gmm(a, b.transpose(1, 2).contiguous(), counts, trans_b=True)  # another memory layout
        torch.testing.assert_close(transposed, want, **GMM_TOLERANCE[dtype])
        # the tolerance is tight enough to catch a wrong expert's weights
        wrong = torch.cat([x @ b[(e + 1) % 4] for e, x in enumerate(a.split(counts.tolist()))])
        assert not torch.allclose(got.double(), wrong.double(), **GMM_TOLERANCE[dtype])
    # off the fast path (e.g. fp32 on CUDA): the loop over row blocks, the same numbers to fp32 rounding
    a, b = torch.randn(9, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    fast = gmm(a, b, counts)
    monkeypatch.setattr(be, "grouped_mm_supported", lambda x, n, **kw: False)
    torch.testing.assert_close(gmm(a, b, counts), fast, **GMM_TOLERANCE[torch.float32])


def test_empty_experts_gradients_are_masked_where_asked(monkeypatch):
    """Capability major 10 (pytorch#172439): the weight gradients of experts without tokens are zeroed by
    `mask_empty_expert_grads` (faked here on the CPU)."""
    calls = []
    real = be.mask_empty_expert_grads

    def spy(w, nonempty):
        calls.append(nonempty.tolist())
        return real(w, nonempty)

    monkeypatch.setattr(be, "masks_empty_expert_grads", lambda device, **kw: True)
    monkeypatch.setattr(ge, "mask_empty_expert_grads", spy)
    a = torch.randn(5, 16, requires_grad=True)
    b = torch.randn(3, 16, 8, requires_grad=True)
    gmm(a, b, torch.tensor([2, 0, 3])).sum().backward()
    assert calls == [[True, False, True]] and not b.grad[1].any() and b.grad[0].any()


def test_zero_weight_copies_under_the_distributed_optimizer():
    """Megatron's DDP with `use_distributed_optimizer=True` moves every parameter into its buffer (reverse
    order, fc1 and fc2 interleaved): the per-expert layout's grouped forward (`batched_experts`) then copies
    the expert weights every forward; the grouped layout views them in place."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=0)
    ids = _ids()
    copies = {}
    for name, kw in (("per_expert_batched", {"batched_experts": True}), ("grouped", {"expert_layout": "grouped"})):
        model = build_gpt_model(cfg, **kw)
        load_hf_model_into_megatron(model, hf)
        model.train()
        before = forward_logits(model, ids).detach()
        assert weight_copies(model) == 0  # as built: laid out for the grouped GEMM
        ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=False))
        experts = expert_modules(ddp)
        w = experts[0].weight1 if name == "grouped" else experts[0].local_experts[0].linear_fc1.weight
        assert w.data.untyped_storage().data_ptr() == ddp.buffers[0].param_data.untyped_storage().data_ptr()
        logits = forward_logits(ddp, ids)
        logits.sum().backward()
        assert torch.equal(logits.detach(), before)
        copies[name] = weight_copies(ddp)
    assert copies["grouped"] == 0
    assert copies["per_expert_batched"] == 2 * len(moe_layer_ids(cfg))  # fc1 and fc2 of every MoE layer


def test_resolve_expert_layout(monkeypatch):
    assert resolve_expert_layout("auto", device="cpu", params_dtype=torch.float32) == "per_expert"
    assert resolve_expert_layout("auto", device="cpu", params_dtype=torch.bfloat16) == "per_expert"
    assert resolve_expert_layout("grouped", device="cpu", params_dtype=torch.float32) == "grouped"
    for major, want in ((8, "per_expert"), (9, "grouped"), (10, "grouped"), (12, "per_expert")):
        monkeypatch.setattr(be, "_cuda_capability", lambda device, m=major: (m, 0))
        assert resolve_expert_layout("auto", device="cuda", params_dtype=torch.bfloat16) == want
        assert resolve_expert_layout("auto", device="cuda", params_dtype=torch.float32) == "per_expert"
    with pytest.raises(ValueError, match="model.expert_layout"):
        resolve_expert_layout("stacked", device="cpu", params_dtype=torch.float32)


@pytest.mark.parametrize("replay", ["none", "r3"])
def test_learner_step_equals_the_per_expert_layouts(dist_ep1, replay):
    """The learner (Megatron DDP, its optimizer, micro-batches; R3 replaying rollout routes where asked) on the
    grouped layout makes the per-expert layout's update: the same log-probs and, after one `train_step`, the
    same weights (fp32, CPU); no weight copy in either pass."""
    import numpy as np

    from moe_gspo.config import AlgoConfig, TrainConfig
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.learner.learner import Learner
    from moe_gspo.learner.old_pass import OldPolicyPass
    from moe_gspo.rollout.base import RolloutSample

    cfg = tiny_qwen3_moe_config()
    rng = np.random.default_rng(4)
    samples = []
    for i in range(6):
        P, R = int(rng.integers(2, 7)), int(rng.integers(1, 9))
        routes = np.stack([np.stack([rng.permutation(cfg.num_experts)[:cfg.num_experts_per_tok] for _ in range(2)])
                           for _ in range(P + R - 1)]).astype(np.uint8)
        samples.append(RolloutSample(prompt_index=i // 3, prompt_ids=rng.integers(3, 51, P),
                                     response_ids=rng.integers(3, 51, R),
                                     response_logprobs=rng.uniform(-3, -0.1, R).astype(np.float32),
                                     finish_reason="stop", routes_TLK=routes if replay == "r3" else None))
    batch = PackedBatch.from_samples(samples, np.linspace(-1, 1, 6).astype(np.float32), pad_id=0)
    hf = build_tiny_model(cfg, seed=0)
    results = []
    for kw in ({"batched_experts": True}, {"expert_layout": "grouped"}):
        model = build_gpt_model(cfg, enable_routing_replay=replay != "none", **kw)
        load_hf_model_into_megatron(model, hf)
        learner = Learner(model, cfg, parallel=dist_ep1, algo=AlgoConfig(name="grpo", routing_replay=replay),
                          train=TrainConfig(lr=1e-2, num_minibatches=2, micro_batch_size=2))
        old = learner.compute_logprobs(batch)
        learner.train_step(batch, OldPolicyPass(logp_BS=old.logp_BS))
        assert weight_copies(model) == 0
        results.append((old.logp_BS, gather_hf_state_dict(model, layout="per_expert")))
    (lp0, w0), (lp1, w1) = results
    assert (lp0 - lp1).abs().max() <= 1e-5
    # The layouts' fp32 gradients agree to rounding (relative ~4e-7; the per-expert layout's grouped GEMM and the
    # loop agree bit for bit), which Adam's first steps amplify on coordinates whose gradient is near its eps:
    # a wrong expert mapping would move most expert weights by ~lr (1e-2) apart, rounding moves a few by < 1e-3
    # (lr / 10; a fresh-clone CI run measured 2.35e-4 on one coordinate, above the 2e-4 this bound was before: the
    # summation order, and so which near-eps coordinates Adam amplifies, varies between runs). The mean and the
    # share of moved coordinates are what tell a wrong mapping from rounding: expert weights are 48% of the
    # coordinates, so a wrong mapping moves ~half of them by ~lr (mean ~5e-3). Measured on one thread (the summation
    # order differs from two): max 2.35e-4, mean 5.6e-7, 0.44% of coordinates moved by > 1e-5 (rounding in the
    # second Adam step on coordinates whose first gradient was small), 0.004% by > 1e-4; on two threads 1.2e-4,
    # 1.7e-7, 0.04%, 0.
    diff = torch.cat([(w0[k] - w1[k]).abs().flatten() for k in w0])
    assert float(diff.max()) <= 1e-3 and float(diff.mean()) <= 1e-5
    assert float((diff > 1e-4).float().mean()) <= 1e-3
    assert max(float((w0[k] - hf_w).abs().max()) for k, hf_w in to_per_expert_layout(hf.state_dict(), cfg).items()
               if ".experts." in k) > 1e-4  # the experts did move


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_layout_matches_the_per_expert_one_in_bf16_without_a_host_sync():
    """On a real GPU: `auto` picks the grouped layout on majors 9/10 only; there the grouped layout's experts
    match the per-expert loop on the same weights in bf16, with no host sync (counts on the host, as
    Megatron's dispatchers give them), and experts without tokens get exactly zero gradient (major 10: the
    mask)."""
    major = torch.cuda.get_device_capability()[0]
    assert (resolve_expert_layout("auto", device="cuda", params_dtype=torch.bfloat16) == "grouped") == \
        (major in (9, 10))
    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=0)
    per = build_gpt_model(cfg, params_dtype=torch.bfloat16, device="cuda")
    grouped = build_gpt_model(cfg, params_dtype=torch.bfloat16, device="cuda", expert_layout="grouped")
    for m in (per, grouped):
        load_hf_model_into_megatron(m, hf.to(torch.bfloat16))
    seq, experts = expert_modules(per)[0], expert_modules(grouped)[0]
    gen = torch.Generator().manual_seed(7)
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    probs = torch.rand(int(counts.sum()), generator=gen).to("cuda", torch.bfloat16)
    # warm-up outside the sync check: first launches, the fused SwiGLU's compilation (issue 48)
    torch.autograd.grad(experts(x, counts, probs)[0].float().square().sum(), [experts.weight1, experts.weight2])
    torch.cuda.synchronize()
    if major in (9, 10):
        torch.cuda.set_sync_debug_mode("error")
    try:
        got, _ = experts(x, counts, probs)
        w1_grad, w2_grad = torch.autograd.grad(got.float().square().sum(), [experts.weight1, experts.weight2])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want, _ = seq(x, counts, probs)
    assert (got.float() - want.float()).abs().max() <= 2e-2
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g1, g2 = w1_grad.view(E, H, 2 * F), w2_grad.view(E, F, H)
    for e in (1, 4, 5):
        assert float(g1[e].abs().max()) == 0.0 and float(g2[e].abs().max()) == 0.0
    assert float(g1.abs().max()) > 0 and experts.num_weight_copies == 0


# --- issue 48: torch >= 2.9, the offsets and the capability once per layer forward -------------------------

def test_the_grouped_path_refuses_torch_before_2_9_with_one_line(monkeypatch):
    """Before CUTLASS 4.0 (torch <= 2.8) `_grouped_mm`'s weight-gradient kernel could hang on experts without
    tokens (pytorch#152668): `grouped` is refused in one line, `auto` falls back to `per_expert`, and the
    per-expert layout's grouped GEMM and the adapter loop instead."""
    monkeypatch.setattr(be, "_cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(be, "_torch_version", lambda: "2.8.0+cu128")
    with pytest.raises(ValueError) as err:
        resolve_expert_layout("grouped", device="cuda", params_dtype=torch.bfloat16)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model.expert_layout=grouped: ") and "torch >= 2.9" in msg
    assert "2.8.0+cu128" in msg and "pytorch#152668" in msg and "per_expert" in msg
    assert resolve_expert_layout("auto", device="cuda", params_dtype=torch.bfloat16) == "per_expert"
    assert resolve_expert_layout("per_expert", device="cuda", params_dtype=torch.bfloat16) == "per_expert"
    x = torch.randn(9, 16)
    assert not be.grouped_mm_supported(x, 8)

    def no_kernel(*args, **kwargs):
        raise AssertionError("torch._grouped_mm called on torch 2.8")

    monkeypatch.setattr(torch, "_grouped_mm", no_kernel)
    b, counts = torch.randn(4, 16, 8), torch.tensor([2, 0, 3, 4])
    want = torch.cat([r @ b[e] for e, r in enumerate(x.split(counts.tolist()))])
    torch.testing.assert_close(gmm(x, b, counts), want, **GMM_TOLERANCE[torch.float32])
    for version in ("2.9.0", "2.10.1+cu130", "2.11.0a0+git1234", "3.0.0"):
        monkeypatch.setattr(be, "_torch_version", lambda v=version: v)
        assert resolve_expert_layout("auto", device="cuda", params_dtype=torch.bfloat16) == "grouped"
        assert be.grouped_mm_torch_problem() is None


def test_offsets_are_computed_once_per_layer_forward(monkeypatch):
    """Issue 48: one cumsum / int32 cast / device move of the offsets per MoE layer forward, shared by fc1 and
    fc2 (each `gmm` call made its own before)."""
    moved = []
    real_move = be.to_device_pinned
    monkeypatch.setattr(be, "to_device_pinned", lambda t, d: (moved.append(t.dtype), real_move(t, d))[1])
    cfg, _, _, grouped = _pair()
    experts = expert_modules(grouped)[0]
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, requires_grad=True)
    out, _ = experts(x, counts, torch.rand(int(counts.sum())))
    out.sum().backward()
    assert moved == [torch.int32]
    assert gmm(x.detach(), torch.randn(8, cfg.hidden_size, 4), counts).shape == (18, 4)  # a lone call: its own
    assert moved == [torch.int32, torch.int32]


def test_the_cuda_capability_is_read_once_per_device(monkeypatch):
    reads = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (reads.append(index), (9, 0))[1])
    be._capability_of.cache_clear()
    try:
        for _ in range(3):
            assert be._cuda_capability("cuda:0") == (9, 0) and be.kernel_device("cuda:0") == ("cuda", (9, 0))
        assert be._cuda_capability(torch.device("cuda", 1)) == (9, 0)
        assert reads == [0, 1]
    finally:
        be._capability_of.cache_clear()  # no faked capability left behind


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_swiglu_compiles_matches_todays_maths_and_saves_two_tensors():
    """Issue 48, on a GPU: the grouped experts' SwiGLU compiles (`torch.compile`, Triton), matches its uncompiled
    formulas and today's unfused maths to bf16 rounding on two row counts (value, fc1-output and probability
    gradients), and saves only the fc1 output and the probabilities."""
    import torch.nn.functional as F

    import moe_gspo.mcore.swiglu as sw
    from moe_gspo.mcore.batched_experts import mlp_activation

    cfg = types.SimpleNamespace(gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=None,
                                glu_linear_offset=0.0)
    gen = torch.Generator().manual_seed(11)
    for T in (96, 1000):
        h = (torch.randn(T, 512, generator=gen) * 2).to("cuda", torch.bfloat16)
        probs = torch.rand(T, generator=gen).cuda()
        g = torch.randn(T, 256, generator=gen).to("cuda", torch.bfloat16)
        results, saved = [], []
        for fn in (lambda a, p: sw.swiglu_with_probs(a, p, compiled=True),
                   lambda a, p: sw.swiglu_with_probs(a, p, compiled=False), lambda a, p: mlp_activation(cfg, a, p)):
            a, p = h.clone().requires_grad_(), probs.clone().requires_grad_()
            shapes = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (shapes.append(tuple(t.shape)), t)[1], lambda t: t):
                out = fn(a, p)
            results.append((out.detach(), *torch.autograd.grad(out, [a, p], g)))
            saved.append(shapes)
        assert sw.COMPILED.error is None, f"the fused SwiGLU did not compile here: {sw.COMPILED.error}"
        for got, eager, today in zip(*results):
            scale = float(today.float().abs().max())
            torch.testing.assert_close(got.float(), eager.float(), rtol=2 ** -7, atol=2 ** -7 * scale)
            torch.testing.assert_close(got.float(), today.float(), rtol=2 ** -6, atol=2 ** -6 * scale)
        assert sorted(saved[0]) == sorted([(T, 512), (T,)]) and saved[2].count((T, 256)) >= 3

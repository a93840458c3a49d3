"""The grouped experts' `torch._grouped_mm` calls at Qwen3-30B-A3B shapes, on the `meta` device (issue 48).

What a first GPU contact would otherwise discover, checked without a GPU: the grouped layout's experts
(`GroupedExperts`, built by Megatron at the real geometry: 128 experts, H 2048, F 768, top-8, bf16) run a
4096-token micro-batch's rows (32,768 at EP 1; one rank's 16 local experts at EP 8), skewed, with experts
that got no token, forward and backward, on tensors that allocate nothing. The rows' device is presented
as CUDA (`batched_experts.kernel_device`, capability 9.0 or 10.0), so the adapter takes its CUDA path, and
every `aten._grouped_mm` call, the backward's included, is checked against the CUDA kernel's contract as
torch 2.9-2.11's `GroupedBlas.cpp` states it (written out here, independently of the adapter): bf16
operands, int32 one-dimensional offsets on the operands' device, one per group, fewer than 1024 groups,
each operand's last two strides one unit and one a multiple of 16 bytes at least the extent it steps over,
16-byte aligned starts. torch's own meta kernel checks part of it too. A width the kernel refuses (F = 20:
40-byte rows), fp32 rows and 1024 groups fall back to the loop over experts, for both projections.

Named so that `pytest -q tests -k "grouped and meta"` selects this module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_gspo.mcore.batched_experts as be
import moe_gspo.mcore.grouped_experts as ge

E_TOTAL, H, F, TOP_K, TOKENS = 128, 2048, 768, 8, 4096  # Qwen3-30B-A3B's MoE layer, one micro-batch


def contract_problems(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[str]:
    """What the CUDA `_grouped_mm` (torch 2.9-2.11, bf16, no scales) would refuse in a call."""
    problems = []
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        problems.append(f"dtypes {a.dtype}, {b.dtype}: the CUDA kernel takes bf16 only")
    if (a.dim(), b.dim()) == (2, 3):
        if a.shape[1] != b.shape[1]:
            problems.append(f"contraction {a.shape[1]} vs {b.shape[1]}")
        groups = b.shape[0]
    elif (a.dim(), b.dim()) == (2, 2):  # the weight gradient: [K, T] x [T, N] -> [groups, K, N]
        if a.shape[1] != b.shape[0]:
            problems.append(f"contraction {a.shape[1]} vs {b.shape[0]}")
        groups = None
    else:
        return problems + [f"operand ranks {a.dim()}, {b.dim()}: the adapter uses 2Dx3D and 2Dx2D only"]
    if offs is None:
        return problems + ["no offsets"]
    if offs.dtype != torch.int32 or offs.dim() != 1:
        problems.append(f"offsets {offs.dtype} of rank {offs.dim()}: int32, one-dimensional")
    if offs.device != a.device:
        problems.append(f"offsets on {offs.device}, operands on {a.device}")
    if groups is not None and offs.numel() != groups:
        problems.append(f"{offs.numel()} offsets for {groups} groups")
    if offs.numel() >= 1024:
        problems.append(f"{offs.numel()} groups: the kernel takes fewer than 1024")
    for name, t in (("a", a), ("b", b)):
        (s0, s1), (n0, n1) = t.stride()[-2:], t.shape[-2:]
        if s1 == 1 and s0 >= max(1, n1):
            major = s0
        elif s0 == 1 and s1 >= max(1, n0):
            major = s1
        else:
            problems.append(f"{name}: strides {t.stride()} for sizes {tuple(t.shape)}: neither row- nor column-major")
            continue
        if major * t.element_size() % 16:
            problems.append(f"{name}: stride {major} x {t.element_size()} B is not a multiple of 16 bytes")
        if t.storage_offset() * t.element_size() % 16:  # allocations are aligned: the offset decides
            problems.append(f"{name}: starts {t.storage_offset() * t.element_size()} B into its storage, unaligned")
    return problems


class GroupedMMCalls(TorchDispatchMode):
    """Records every `aten._grouped_mm` call (shapes, offsets' identity, contract problems)."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            a, b = args[0], args[1]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            self.calls.append({"a": tuple(a.shape), "b": tuple(b.shape), "offs": offs,
                               "problems": contract_problems(a, b, offs)})
        return func(*args, **kwargs)


def _counts(num_local: int, first: int, *, ranks: int, seed: int = 0) -> torch.Tensor:
    """Rows per local expert `first .. first + num_local - 1` of one EP rank: `ranks` micro-batches of TOKENS
    tokens routed top-8 over 128 experts with a skewed load (Dirichlet 0.3), every 17th expert empty (their
    rows go to the busiest expert); on the host, as Megatron's dispatchers give them."""
    rng = np.random.default_rng(seed)
    counts = torch.from_numpy(rng.multinomial(ranks * TOKENS * TOP_K, rng.dirichlet(np.full(E_TOTAL, 0.3))))
    spilled = int(counts[::17].sum())
    counts[::17] = 0
    counts[int(counts.argmax())] += spilled
    return counts[first:first + num_local].clone()


@pytest.fixture(scope="module")
def megatron_30b():
    """(TransformerConfig of Qwen3-30B-A3B in bf16 with the grouped layout, its process groups)."""
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    from moe_gspo.mcore.model import transformer_config_from_hf
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.mcore.shims import install_grouped_gemm
    from moe_gspo.plan.from_config import _hf_config_from_json, shipped_model_configs

    hf = _hf_config_from_json(shipped_model_configs()["Qwen3-30B-A3B"])
    assert (hf.num_experts, hf.hidden_size, hf.moe_intermediate_size, hf.num_experts_per_tok) == (E_TOTAL, H, F, TOP_K)
    init_distributed(ep_size=1, num_experts=E_TOTAL, seed=0)
    install_grouped_gemm()
    yield hf, get_default_pg_collection()
    destroy_distributed()


def _meta_experts(megatron_30b, num_local: int, *, ffn: int = F, dtype=torch.bfloat16):
    """Megatron's build of the grouped layout's experts (`GroupedExperts`: weight1 [H, E*2F], weight2 [E*F, H])
    on the meta device."""
    from moe_gspo.mcore.model import transformer_config_from_hf

    hf, pg = megatron_30b
    config = transformer_config_from_hf(hf, params_dtype=dtype, moe_grouped_gemm=True, moe_ffn_hidden_size=ffn)
    with torch.device("meta"):
        return ge.GroupedExperts(num_local, config, pg_collection=pg)


@pytest.fixture
def meta_is_cuda(monkeypatch):
    """The meta device seen as a CUDA device of the capability asked (`kernel_device`); the capability reads
    are counted."""
    state = {"capability": (9, 0), "reads": 0}
    real = be.kernel_device

    def fake(device):
        if torch.device(device).type != "meta":
            return real(device)
        state["reads"] += 1
        return "cuda", state["capability"]

    monkeypatch.setattr(be, "kernel_device", fake)
    return state


def _run_layer(experts, counts, *, dtype=torch.bfloat16):
    """One forward and backward of `experts` on meta rows for `counts` (the backward's incoming gradient
    expanded, as a plain `.sum()` gives it); the `_grouped_mm` calls and shapes saved for backward."""
    T = int(counts.sum())
    x = torch.empty(T, H, device="meta", dtype=dtype, requires_grad=True)
    probs = torch.empty(T, device="meta", dtype=torch.float32, requires_grad=True)  # Megatron's fp32 router
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    spy = GroupedMMCalls()
    with spy, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, bias = experts(x, counts, probs)
        forward_calls = len(spy.calls)
        out.sum().backward()
    assert bias is None and out.shape == (T, H) and out.dtype == dtype and out.device.type == "meta"
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape
    assert experts.weight1.grad.shape == experts.weight1.shape and experts.weight2.grad.shape == experts.weight2.shape
    return spy.calls, forward_calls, saved, T


@pytest.mark.parametrize("ep,major", [(1, 9), (8, 9), (8, 10)], ids=["ep1-sm90", "ep8-sm90", "ep8-sm100"])
def test_grouped_meta_kernel_contract_at_qwen3_30b_shapes(megatron_30b, meta_is_cuda, ep, major):
    num_local = E_TOTAL // ep
    counts = _counts(num_local, first=num_local * (ep - 1), ranks=ep)  # the last EP rank's experts
    assert (counts == 0).any() and int(counts.max()) > 4 * int(counts.sum()) // num_local  # empty and hot experts
    meta_is_cuda["capability"] = (major, 0)
    experts = _meta_experts(megatron_30b, num_local)
    calls, forward_calls, saved, T = _run_layer(experts, counts)
    assert TOKENS * TOP_K // 2 <= T <= 3 * TOKENS * TOP_K  # ~ 4096 tokens x top-8 rows reach a rank
    # forward: fc1 [T, H] x [E, H, 2F], fc2 [T, F] x [E, F, H]; backward: each one's input and weight gradient
    assert forward_calls == 2 and len(calls) == 6
    assert calls[0]["a"] == (T, H) and calls[0]["b"] == (num_local, H, 2 * F)
    assert calls[1]["a"] == (T, F) and calls[1]["b"] == (num_local, F, H)
    assert sorted((c["a"], c["b"]) for c in calls[2:]) == sorted([
        ((T, H), (num_local, H, F)), ((F, T), (T, H)),               # fc2: input gradient, weight gradient
        ((T, 2 * F), (num_local, 2 * F, H)), ((H, T), (T, 2 * F))])  # fc1
    assert [p for c in calls for p in c["problems"]] == []
    # one offsets tensor for the whole layer (computed once per forward), and the capability read once
    assert len({id(c["offs"]) for c in calls[:2]}) == 1 and calls[0]["offs"].numel() == num_local
    assert meta_is_cuda["reads"] == 1
    # the fused SwiGLU: besides the GEMMs' operands only the fc1 output [T, 2F] and the probabilities
    rows = [s for s in saved if s[0][0] == T]
    assert sorted(rows, key=str) == sorted([((T, H), torch.bfloat16), ((T, 2 * F), torch.bfloat16),
                                            ((T,), torch.float32), ((T, F), torch.bfloat16)], key=str)
    # major 10 (pytorch#172439): the empty experts' weight gradients are masked, with a device mask
    masked = [s for s in saved if s[0] == (num_local,) and s[1] == torch.bool]
    assert len(masked) == (2 if major == 10 else 0)


def test_grouped_meta_unfused_swiglu_would_keep_150_mb_more_per_layer(megatron_30b, meta_is_cuda, monkeypatch):
    """Issue 48's estimate, counted: today's unfused activation at EP 1 keeps 3 more [T, F] bf16 tensors
    (~150 MB at 32,768 rows) than the fused one."""
    counts = _counts(E_TOTAL, first=0, ranks=1)
    experts = _meta_experts(megatron_30b, E_TOTAL)
    _, _, fused, T = _run_layer(experts, counts)
    monkeypatch.setattr(ge, "swiglu_fusable", lambda c: False)
    _, _, unfused, _ = _run_layer(experts, counts)
    extra = [s for s in unfused if s[0] == (T, F)]
    assert len(extra) - len([s for s in fused if s[0] == (T, F)]) >= 3
    assert 3 * T * F * 2 / 1e6 > 140


@pytest.mark.parametrize("case", ["ffn20", "fp32", "groups1024"])
def test_grouped_meta_shapes_the_kernel_rejects_fall_back_to_the_loop(megatron_30b, meta_is_cuda, case):
    """F = 20 (40-byte rows of the fc1 output's halves and the fc2 input), fp32 rows on CUDA and 1024 local
    experts are off the kernel's contract: both projections take the loop (no `_grouped_mm` call), with the
    same shapes and gradients as ever. torch's meta kernel itself refuses the F = 20 fc2 operand."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    num_local, ffn = {"ffn20": (16, 20), "fp32": (16, F), "groups1024": (1024, 16)}[case]
    experts = _meta_experts(megatron_30b, num_local, ffn=ffn, dtype=dtype)
    counts = torch.zeros(num_local, dtype=torch.long)
    counts[::3] = 7  # experts without tokens between them
    calls, _, _, _ = _run_layer(experts, counts, dtype=dtype)
    assert calls == []
    if case == "ffn20":
        h = torch.empty(int(counts.sum()), ffn, device="meta", dtype=torch.bfloat16)
        offs = torch.cumsum(counts, 0).to(torch.int32).to("meta")
        assert contract_problems(h, experts.weight2.view(num_local, ffn, H), offs)  # the test's contract
        with pytest.raises(RuntimeError, match="16 bytes"):
            torch._grouped_mm(h, experts.weight2.view(num_local, ffn, H), offs=offs)  # torch's meta kernel


def test_grouped_meta_contract_checker_flags_what_the_kernel_refuses():
    """The contract written out above catches each rule (a checker that cannot fail proves nothing)."""
    a = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
    b = torch.empty(4, 32, 16, device="meta", dtype=torch.bfloat16)
    offs = torch.empty(4, device="meta", dtype=torch.int32)
    assert contract_problems(a, b, offs) == []
    assert "bf16" in contract_problems(a.float(), b.float(), offs)[0]
    assert "int32" in contract_problems(a, b, offs.long())[0]
    assert "offsets on cpu" in contract_problems(a, b, torch.zeros(4, dtype=torch.int32))[0]
    assert "3 offsets for 4 groups" in contract_problems(a, b, offs[:3])[0]
    big = torch.empty(1024, 32, 16, device="meta", dtype=torch.bfloat16)
    assert any("fewer than 1024" in p for p in contract_problems(a, big, torch.empty(1024, device="meta",
                                                                                       dtype=torch.int32)))
    assert "multiple of 16 bytes" in contract_problems(torch.empty(64, 20, device="meta", dtype=torch.bfloat16),
                                                       torch.empty(4, 20, 16, device="meta", dtype=torch.bfloat16),
                                                       offs)[0]
    assert "unaligned" in contract_problems(torch.empty(65 * 32, device="meta", dtype=torch.bfloat16)[4:4 + 64 * 32]
                                            .view(64, 32), b, offs)[0]
    assert "neither" in contract_problems(a, b.expand(4, 32, 16).as_strided((4, 32, 16), (0, 0, 0)), offs)[0]

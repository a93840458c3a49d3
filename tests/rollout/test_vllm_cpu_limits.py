"""vLLM-CPU's kernel limits (head_dim, hidden and MoE widths) are refused at start-up with our one-line
error naming the field and the fix, before any model is built (issue 22, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_gspo import probe, train
from moe_gspo.rollout.vllm_cpu import check_cpu_kernels
from moe_gspo.rollout.vllm_support import installed_vllm, on_cpu
from moe_gspo.tiny import make_tiny_checkpoint, tiny_qwen3_moe_config

ROOT = Path(__file__).resolve().parents[2]
needs_vllm_cpu = pytest.mark.skipif(installed_vllm() is None or not on_cpu(), reason="needs vLLM on a CPU machine")


@pytest.mark.parametrize("geometry,tp,msg", [
    (dict(head_dim=16), 1, "has head_dim=16, which vllm-cpu 0.32.0's attention kernel cannot run"),
    (dict(head_dim=40), 1, "has head_dim=40"),
    (dict(hidden_size=48, moe_intermediate_size=24), 1, "has hidden_size=48, which vllm-cpu 0.32.0's fused-MoE"),
    (dict(moe_intermediate_size=24), 1, "has moe_intermediate_size=24: vllm-cpu 0.32.0's fused-MoE kernel pads it"),
    (dict(), 2, "moe_intermediate_size=32 / rollout.tensor_parallel_size=2"),
])
def test_geometries_the_cpu_kernels_cannot_run_are_named(geometry, tp, msg):
    with pytest.raises(ValueError, match=msg) as e:
        check_cpu_kernels(tiny_qwen3_moe_config(**geometry), tp, model="M")
    assert "rollout.engine=hf" in str(e.value)


@pytest.mark.parametrize("geometry", [dict(), dict(head_dim=48), dict(head_dim=128, hidden_size=256)])
def test_geometries_the_cpu_kernels_run_pass(geometry):
    check_cpu_kernels(tiny_qwen3_moe_config(**geometry), 1)


def _no_build(*a, **k):
    raise AssertionError("the model was built before the vLLM-CPU geometry check")


@needs_vllm_cpu
def test_train_refuses_before_building_anything(tmp_path, capsys, monkeypatch):
    """Was: vLLM's `NotImplementedError: No Unquantized MoE backend supports the deployment
    configuration` (a traceback) after the learner was built."""
    import moe_gspo.run.setup as setup

    monkeypatch.setattr(setup, "build_policy", _no_build)
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "rollout.engine=vllm",
                     "model.tiny={hidden_size: 48, moe_intermediate_size: 24}", "--run-dir", str(run_dir),
                     "logging.wandb_mode=disabled"])
    assert rc == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.tiny=" in errors[0] and "hidden_size=48" in errors[0]
    assert not run_dir.exists()


@needs_vllm_cpu
def test_probe_refuses_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import moe_gspo.mcore.checkpoint as mcore_ckpt

    monkeypatch.setattr(mcore_ckpt, "load_megatron_from_hf_dir", _no_build)
    model = make_tiny_checkpoint(tmp_path / "model", head_dim=16)
    (tmp_path / "p.txt").write_text("0123:\n")
    rc = probe.main(["--model", str(model), "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "d.json"),
                     "--engine", "vllm"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"--model {model} has head_dim=16" in err

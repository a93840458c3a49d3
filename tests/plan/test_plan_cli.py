"""`python -m moe_gspo.plan`: exit status, JSON keys, the table, errors; the train start-up check."""

from __future__ import annotations

import json

import pytest

from moe_gspo.config_load import load_config
from moe_gspo.plan.__main__ import main
from moe_gspo.plan.startup import startup_check

REQUIRED_KEYS = {"fits", "per_rank_gib", "learner_params_gib", "learner_grads_gib", "optimizer_gpu_gib",
                 "activations_gib", "rollout_weights_gib", "rollout_kv_gib", "weight_sync_transient_gib"}


def test_json_of_the_30b_config(capsys):
    assert main(["configs/qwen3_30b_a3b.yaml", "--json", "--attention", "unfused"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert REQUIRED_KEYS <= set(out) and out["fits"] is True and out["gpus"] == 8
    assert out["per_rank_gib"] == max(p["total"] for p in out["phases"].values()) < 80
    assert out["learner_params_gib"] == pytest.approx(9.62, abs=0.01)


def test_table_and_exit_status(capsys):
    assert main(["configs/tiny_cpu.yaml"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "204.80 K parameters" in out and "weight_sync" in out
    # the same 30B config on 40 GiB GPUs does not fit: status 1, with the knob to turn
    assert main(["configs/qwen3_30b_a3b.yaml", "--gpu-mem-gib", "40", "--attention", "flash"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "knob to turn:" in out
    assert main(["configs/qwen3_235b_a22b.yaml", "--json", "--attention", "flash"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"] == 64


@pytest.mark.parametrize("argv,msg", [
    (["configs/missing.yaml"], "does not exist"),
    (["configs/qwen3_30b_a3b.yaml", "train.optimizer_cpu_offload=true", "train.precision_aware_optimizer=false"],
     "train.optimizer_cpu_offload=true needs train.precision_aware_optimizer=true"),
    (["configs/qwen3_30b_a3b.yaml", "model.path=/nowhere/MyModel"], "--model-config"),
    (["configs/qwen3_30b_a3b.yaml", "--gpus", "0"], "--gpus"),
])
def test_bad_input_exits_2_with_one_message(capsys, argv, msg):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_startup_check_on_cpu_resolves_options_and_skips_the_plan():
    cfg = load_config("configs/tiny_cpu.yaml")
    assert startup_check(cfg, on_cuda=False, world_size=2) is None
    bad = load_config("configs/tiny_cpu.yaml", ["train.distributed_optimizer=true"])
    with pytest.raises(ValueError, match=r"train.distributed_optimizer=true needs CUDA"):
        startup_check(bad, on_cuda=False, world_size=2)


def test_startup_check_on_gpu_refuses_or_warns(capsys):
    cfg = load_config("configs/qwen3_30b_a3b.yaml")
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        startup_check(cfg, on_cuda=True, world_size=8, gpu_mem_gib=80.0, have_te=False)
    assert startup_check(cfg, on_cuda=True, world_size=8, gpu_mem_gib=80.0, have_te=True).fits
    assert "fits" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"does not fit: .*Knob to turn: .*train.memory_check=warn"):
        startup_check(cfg, on_cuda=True, world_size=8, gpu_mem_gib=32.0, have_te=True)
    warn = load_config("configs/qwen3_30b_a3b.yaml", ["train.memory_check=warn"])
    assert not startup_check(warn, on_cuda=True, world_size=8, gpu_mem_gib=32.0, have_te=True).fits
    assert "warning: memory plan" in capsys.readouterr().err
    off = load_config("configs/qwen3_30b_a3b.yaml", ["train.memory_check=skip"])
    assert startup_check(off, on_cuda=True, world_size=8, gpu_mem_gib=32.0, have_te=True) is None

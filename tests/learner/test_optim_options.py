"""The learner's Megatron memory options: config-time combinations and start-up resolution per device."""

from __future__ import annotations

import pytest

from moe_gspo.config_load import load_config
from moe_gspo.learner.optim import OptimizerOptions, resolve_optimizer_options


@pytest.mark.parametrize("overrides,msg", [
    (["train.optimizer_cpu_offload=true"], "train.optimizer_cpu_offload=true needs train.precision_aware_optimizer=true"),
    (["train.precision_aware_optimizer=true", "train.distributed_optimizer=false"],
     "train.precision_aware_optimizer=true needs Megatron's distributed optimizer"),
    (["train.optimizer_offload_fraction=1.5"], r"train.optimizer_offload_fraction=1.5 must be in \[0, 1\]"),
    (["train.optimizer_state_dtype=bfloat16"], "needs train.precision_aware_optimizer=true"),
    (["train.optimizer_state_dtype=bfloat16", "train.precision_aware_optimizer=true",
      "train.optimizer_cpu_offload=true"], "not supported with train.optimizer_cpu_offload=true"),
    (["train.offload_during_rollout=all", "train.distributed_optimizer=false"], "offload_during_rollout=grads"),
    (["train.memory_check=maybe"], "train.memory_check='maybe' is not one of"),
])
def test_invalid_combinations_are_rejected_at_config_time(overrides, msg):
    with pytest.raises(ValueError, match=msg):
        load_config(None, overrides)


def test_cpu_resolution():
    assert resolve_optimizer_options(load_config(None).train, on_cuda=False) == OptimizerOptions(
        distributed_optimizer=False)
    grads = load_config(None, ["train.grad_reduce_in_fp32=false", "train.offload_during_rollout=grads"]).train
    opts = resolve_optimizer_options(grads, on_cuda=False)
    assert not opts.grad_reduce_in_fp32 and opts.offload_during_rollout == "grads"
    for ovs in (["train.distributed_optimizer=true"],
                ["train.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true"],
                ["train.offload_during_rollout=all"]):
        with pytest.raises(ValueError, match=r"needs CUDA.*on CPU set train.distributed_optimizer=null"):
            resolve_optimizer_options(load_config(None, ovs).train, on_cuda=False)


def test_gpu_resolution():
    auto = resolve_optimizer_options(load_config(None).train, on_cuda=True, have_te=False)
    assert auto.distributed_optimizer and not auto.optimizer_cpu_offload  # null = on with CUDA
    off = resolve_optimizer_options(load_config(None, ["train.distributed_optimizer=false"]).train, on_cuda=True)
    assert not off.distributed_optimizer
    pa = load_config(None, ["train.precision_aware_optimizer=true"]).train
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        resolve_optimizer_options(pa, on_cuda=True, have_te=False)
    assert resolve_optimizer_options(pa, on_cuda=True, have_te=True).precision_aware_optimizer
    offload = load_config("configs/qwen3_30b_a3b.yaml").train
    with pytest.raises(ValueError, match="needs Transformer Engine"):  # megatron-core 0.16 reads TE's version
        resolve_optimizer_options(offload, on_cuda=True, have_te=False)
    o = resolve_optimizer_options(offload, on_cuda=True, have_te=True)
    assert o.optimizer_cpu_offload and o.precision_aware_optimizer and o.optimizer_offload_fraction == 1.0


def test_megatron_precision_aware_config_needs_transformer_engine():
    """Why the rule above: megatron-core 0.16's OptimizerConfig fails without TE (even with CPU offload)."""
    import warnings

    import torch
    from megatron.core.optimizer import OptimizerConfig

    from moe_gspo.mcore.shims import have_transformer_engine

    if have_transformer_engine():
        pytest.skip("Transformer Engine is installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError):
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                            use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                            optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)

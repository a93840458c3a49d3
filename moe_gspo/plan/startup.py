"""The start-up check of `moe_gspo.train`: before any weight is loaded.

1. The learner's optimizer memory options are resolved for this device
   (`moe_gspo.learner.optim.resolve_optimizer_options`): options the device cannot run (e.g. the
   distributed optimizer or CPU offload on a CPU) stop the run with one message naming the field.
2. On CUDA, the memory plan of this config (`python -m moe_gspo.plan`) for this world size and this GPU's
   memory: `train.memory_check=refuse` (default) stops a config that will not fit with the plan's verdict
   and the knob to turn; `warn` prints it (rank 0) and goes on; `skip` skips it. The plan is counted,
   not measured, so `warn` is the escape hatch when a run is known to fit.
On CPU the plan is skipped: it models GPU memory (bf16, vLLM, CUDA allowances), while CPU runs are tiny
and bounded by host memory.
"""

from __future__ import annotations

import os
import sys


def startup_check(cfg, *, on_cuda: bool, world_size: int, gpu_mem_gib: float | None = None,
                  gpus_per_node: int = 8, is_main: bool = True, have_te: bool | None = None):
    """Raises ValueError when the run must not start; returns the plan (None when skipped).
    `have_te`: whether Transformer Engine is importable (None = look)."""
    from moe_gspo.learner.optim import resolve_optimizer_options

    resolve_optimizer_options(cfg.train, on_cuda=on_cuda, have_te=have_te)
    if not on_cuda or cfg.train.memory_check == "skip":
        return None
    from moe_gspo.plan import make_plan
    from moe_gspo.plan.report import one_line

    result = make_plan(cfg, num_gpus=world_size, gpu_mem_gib=float(gpu_mem_gib), gpus_per_node=gpus_per_node)
    message = one_line(result)
    if not result.fits:
        if cfg.train.memory_check == "refuse":
            raise ValueError(message + " (counted, not measured: train.memory_check=warn starts anyway)")
        if is_main:
            print(f"warning: {message}", file=sys.stderr, flush=True)
    elif is_main:
        print(message, flush=True)
    return result


def check_before_loading(cfg, info):
    """`startup_check` for this process's device (`info`: `moe_gspo.mcore.parallel.ParallelInfo`)."""
    on_cuda = info.device.type == "cuda"
    gpu_mem_gib = None
    if on_cuda:
        import torch

        gpu_mem_gib = torch.cuda.get_device_properties(info.device).total_memory / float(1 << 30)
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(info.world_size, 8)))
    return startup_check(cfg, on_cuda=on_cuda, world_size=info.world_size, gpu_mem_gib=gpu_mem_gib,
                         gpus_per_node=gpus_per_node, is_main=info.is_main)

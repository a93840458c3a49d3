"""`torch.profiler` summary of one call (e.g. one `Learner.train_step`), written as a text table.

`profile_to_file(fn, path)` runs `fn` once under `torch.profiler.profile` (CPU activity, and CUDA when
CUDA is initialised in this process) and writes `key_averages().table(...)`: the `row_limit` ops with
the most CUDA time (`device_time_total`; `cuda_time_total` in older torch) on a GPU, the most self
CPU time (`self_cpu_time_total`) on CPU.
Used by `benchmarks.memory_bench --profile-train-step` (and so by `benchmarks.gpu_check`, which saves
`DIR/train_step_profile.txt` beside its report); works on CPU (tests/benchmarks/test_gpu_profile.py).
"""

from __future__ import annotations

import time
from pathlib import Path


def _cuda_active() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def profile_to_file(fn, path: str | Path, *, title: str = "", row_limit: int = 25, warmup: int = 0) -> dict:
    """Profile one call of `fn()` (after `warmup` unprofiled calls) and write the summary table to `path`.
    Returns what `benchmarks.gpu_check` records: the file, the sort key, whether CUDA was profiled, the wall
    seconds of the profiled call (profiler overhead included) and the top ops' names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = _cuda_active()
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    averages = prof.key_averages()
    sort_by = "self_cpu_time_total"
    if cuda:  # newer torch: device_time_total; older: cuda_time_total
        sort_by = "device_time_total" if averages and hasattr(averages[0], "device_time_total") else "cuda_time_total"
    table = averages.table(sort_by=sort_by, row_limit=row_limit)
    top = [e.key for e in sorted(averages, key=lambda e: getattr(e, sort_by), reverse=True)[:10]]
    header = [f"# {title}" if title else "# torch.profiler summary",
              f"# activities: {', '.join(a.name for a in activities)}; sorted by {sort_by}; top {row_limit} ops; "
              f"profiled call {wall:.3f} s (profiler overhead included); torch {torch.__version__}"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header) + "\n\n" + table + "\n")
    return {"file": str(path), "sort_by": sort_by, "cuda": cuda, "wall_s": round(wall, 4), "top_ops": top}

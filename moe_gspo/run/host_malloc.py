"""glibc malloc settings for a CPU learner: keep freed heap memory for the next step instead of handing it
back to the kernel and faulting it in again.

A CPU training step allocates and frees the same few-MB activation, gradient and KV-cache tensors over and
over. glibc's defaults serve them from mmap'd chunks or a heap that is trimmed whenever its free top exceeds
a threshold that follows the largest freed chunk; either way the pages go back to the kernel and every later
step faults them in again, zeroed: ~5,000 minor page faults per default step on the tiny model (one
process: 99,000-141,000 over 20 steps), with the kernel's fault handling and page zeroing in the CPU time.
`keep_freed_heap()` sets three `mallopt` parameters once per process:

- `M_MMAP_THRESHOLD` = 32 MiB (glibc's own upper bound for the dynamic threshold): smaller blocks come from
  the heap, larger ones (weights, checkpoint buffers) are still mapped and unmapped as before;
- `M_TRIM_THRESHOLD` = 256 MiB: the heap's free top is returned to the kernel only above this;
- `M_TOP_PAD` = 16 MiB: each heap extension asks for that much more, fewer `brk` calls.

With them the same 20 steps take ~16,000 faults and the loop's user + system CPU time fell from 7.09 to
6.51 s (-8%; means of four alternated pairs on a shared 2-core box, 1 thread; docs/results.md, "The step,
after"). Nothing computed changes: PyTorch aligns every CPU
allocation to 64 bytes itself, wherever the memory comes from (`benchmarks.metrics_match`: the metrics
are equal). The cost is memory held: at most the process's peak heap use plus 256 MiB of free heap top.
`moe_gspo.train` calls it when the learner's device is the CPU; on a GPU the host allocates little per step
and is left as it is. Not glibc (musl, macOS): nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter numbers (malloc.h)."""

SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 256 << 20), (M_TOP_PAD, 16 << 20))
"""(parameter, value) pairs `keep_freed_heap` sets, in this order (see the module docstring)."""


def keep_freed_heap() -> bool:
    """Set `SETTINGS` with glibc's `mallopt`; True when every one was accepted, False where the C library has
    no `mallopt` (not glibc) or refused one. Process-wide, idempotent."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)

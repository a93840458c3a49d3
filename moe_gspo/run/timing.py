"""Wall time per phase of one RL step, logged as `perf/<phase>_s` (see docs/metrics.md).

`benchmarks.step_profile` reads these columns to print where a step's time goes. On CUDA a phase
ends with `torch.cuda.synchronize()`, so that asynchronous kernels are charged to the phase that
launched them (a few synchronisations per step; no effect on CPU).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

PHASES = ("eval", "rollout", "score", "old_logp", "compare", "replayed_logp", "reference", "update", "drift", "guard",
          "sync", "metrics", "traces", "log", "checkpoint")
"""The phases `moe_gspo.train` times, in step order. `eval` (eval.every: the held-out evaluation at the
start of a step) is not part of perf/step_time_s. `log` (writing the metrics row: metrics.jsonl,
wandb) and `checkpoint` happen after a step's row is assembled, so each row carries those of the
PREVIOUS step."""


class PhaseTimer:
    """Accumulates seconds per phase: `with timer("update"): ...`; `take()` returns and clears them."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        assert phase in PHASES, phase
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.add(phase, time.perf_counter() - t0)

    def add(self, phase: str, seconds: float) -> None:
        self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """`{"perf/<phase>_s": seconds}` of the phases timed since the last call; clears them."""
        out = {f"perf/{k}_s": v for k, v in self._seconds.items()}
        self._seconds = {}
        return out

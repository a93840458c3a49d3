"""What each rank is doing, so that a collective that times out names the rank that did not arrive.

Every rank publishes a short label of its current work ("rollout, step 3") with the time it began, in
torch.distributed's store (under torchrun the agent's TCPStore, reachable even when a worker is stopped
or dead). `Activity.watch()` turns gloo's timeout / lost-connection errors into a `RankFailure` whose
message says which rank is behind and where:

    error: rank 0 waited 300 s (parallel.collective_timeout_s) in 'learner update, step 3'; rank 1 is
    still in 'rollout, step 3' (for 312 s): it is stopped, hung or much slower ...

The timeout itself is `parallel.collective_timeout_s`, given to `init_process_group` and to Megatron's
process groups by `moe_gspo.mcore.parallel.init_distributed`. On CUDA, NCCL's watchdog enforces it by
aborting the process instead (its own message; not reproducible on the CPU machines).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

from moe_gspo.run.errors import RankFailure, _default_store, comm_failure_kind

_KEY = "moe_gspo/activity/{}"


class Activity:
    """This rank's current activity, shared with the others (a no-op in a world of one)."""

    def __init__(self, *, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.store = _default_store() if world_size > 1 else None
        self.what, self.since = "start-up", time.time()

    def __call__(self, what: str) -> None:
        self.what, self.since = what, time.time()
        if self.store is not None:
            try:
                self.store.set(_KEY.format(self.rank), json.dumps([what, self.since]))
            except Exception:  # diagnostics only; never fail a run for them
                pass

    def peers(self) -> list[tuple[int, str, float]]:
        """(rank, activity, since) of every other rank that has published one."""
        if self.store is None:
            return []
        out = []
        try:
            self.store.set_timeout(timedelta(seconds=5))
        except Exception:
            pass
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                if self.store.check([_KEY.format(r)]):
                    what, since = json.loads(self.store.get(_KEY.format(r)))
                    out.append((r, what, since))
            except Exception:
                continue
        return out

    def describe(self, kind: str) -> str:
        now = time.time()
        peers = self.peers()
        behind = [p for p in peers if p[2] < self.since or p[1] != self.what] or peers
        seen = "; ".join(f"rank {r} is still in '{what}' (for {now - since:.0f} s)" for r, what, since in behind)
        seen = seen or "no other rank has reported its activity"
        if kind == "timeout":
            return (f"rank {self.rank} waited {self.timeout_s:g} s (parallel.collective_timeout_s) for the other "
                    f"ranks in '{self.what}'; {seen}: it is stopped, hung or much slower. Kill the run and "
                    f"--resume; raise parallel.collective_timeout_s if that rank is only slow")
        return (f"rank {self.rank} lost its connection to another rank in '{self.what}' (that process died or was "
                f"killed; its own error, if any, is printed above); {seen}")

    @contextmanager
    def watch(self) -> Iterator["Activity"]:
        """Re-raise a collective's timeout or lost connection as a `RankFailure` naming the ranks."""
        try:
            yield self
        except RuntimeError as e:
            kind = comm_failure_kind(e)
            if kind is None or isinstance(e, RankFailure):
                raise
            raise RankFailure(self.describe(kind)) from e


def exit_with_launcher() -> None:
    """Under torchrun: have the kernel kill this worker when the launcher dies (Linux PR_SET_PDEATHSIG).

    torchrun starts every worker in a session of its own, so `kill -9` of torchrun (or of its process
    group, as a job scheduler or a test does) leaves the workers running: they keep training and
    writing checkpoints and metrics into the run directory, racing a later `--resume`. A no-op
    outside torchrun (a plain `python -m moe_gspo.train` must survive its shell) and off Linux."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)

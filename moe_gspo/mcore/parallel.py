"""Distributed setup for the Megatron learner: world = EP x DP, TP = PP = 1.

Under torchrun the usual RANK/WORLD_SIZE/LOCAL_RANK variables are read; a plain single process
(`python -m ...`) gets a world of size 1 over a private file store, so the same code paths run.
gloo on CPU, NCCL on CUDA. Expert parallelism is carved out of data parallelism (Megatron's
expert-data-parallel layout): with world size W and EP size E, every rank holds num_experts/E experts
and a full copy of the dense weights, and each rank processes its own share of the batch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(kw_only=True, frozen=True)
class ParallelInfo:
    """Where this process sits in the learner's process grid."""

    rank: int
    world_size: int
    local_rank: int
    ep_size: int
    ep_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device
    backend: str
    timeout_s: float = 300.0
    """Collective timeout of every process group (see `default_timeout_s`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def validate_parallel_sizes(*, world_size: int, ep_size: int, num_experts: int) -> None:
    """Raise a ValueError naming the field when the process grid cannot hold the model."""
    if ep_size < 1:
        raise ValueError(f"parallel.expert_parallel_size must be >= 1, got {ep_size}")
    if world_size % ep_size != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.expert_parallel_size={ep_size}; "
            f"launch a multiple of {ep_size} processes (torchrun --nproc-per-node ...) or change it"
        )
    if num_experts % ep_size != 0:
        raise ValueError(
            f"model num_experts={num_experts} is not divisible by parallel.expert_parallel_size={ep_size}; "
            f"choose an EP size that divides the number of experts"
        )


def default_timeout_s(use_cuda: bool) -> float:
    """Collective timeout when none is configured: 5 minutes on CPU (gloo), 30 on CUDA (NCCL: first
    steps may include long compiles and checkpoint loads between collectives)."""
    return 1800.0 if use_cuda else 300.0


def init_distributed(*, ep_size: int, num_experts: int, seed: int = 0,
                     device: str | None = None, timeout_s: float | None = None) -> ParallelInfo:
    """Initialise torch.distributed and Megatron's parallel state (idempotent within a process).

    `timeout_s` bounds every collective (torch.distributed's default group and Megatron's groups):
    a rank that waits longer for another raises instead of hanging; None = `default_timeout_s`."""
    from moe_gspo.mcore.shims import apply_shims, import_megatron_core, seed_model_parallel_rng

    import_megatron_core()  # a run's first Megatron import: its torch.compile decorations deferred
    from megatron.core import parallel_state as ps

    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_parallel_sizes(world_size=world_size, ep_size=ep_size, num_experts=num_experts)
    apply_shims()
    backend = "nccl" if use_cuda else "gloo"
    timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s(use_cuda)
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        if "MASTER_ADDR" in os.environ:
            init_method = "env://"
        else:
            assert world_size == 1, "multi-process runs must be launched with torchrun"
            fd, path = tempfile.mkstemp(prefix="moe_gspo_pg_")
            os.close(fd)
            os.unlink(path)
            init_method = f"file://{path}"
            _FILE_STORES.append(path)  # removed by destroy_distributed (os._exit skips the store's own cleanup)
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, init_method=init_method,
                                world_size=world_size, rank=rank, timeout=timedelta(seconds=timeout_s))
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=ep_size,
            distributed_timeout_minutes=timeout_s / 60,  # Megatron builds timedelta(minutes=...): floats work
        )
    elif ps.get_expert_model_parallel_world_size() != ep_size:
        raise ValueError(
            f"Megatron parallel state is already initialised with EP="
            f"{ps.get_expert_model_parallel_world_size()}, asked for {ep_size}; call destroy_distributed() first"
        )
    seed_model_parallel_rng(seed)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        ep_size=ep_size,
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        device=torch.device(f"cuda:{local_rank}" if use_cuda else "cpu"),
        backend=backend,
        timeout_s=timeout_s,
    )


def _loaded(name: str):
    """The module `name` if an import of it has completed in this process, else None; imports nothing.

    An import that a signal (KeyboardInterrupt) broke off leaves its package half-built: the modules it
    was executing are dropped from `sys.modules`, the submodules that finished stay behind, and a
    second import of the same chain then fails (`module 'sympy' has no attribute 'printing'`). A module
    still executing (`__spec__._initializing`) counts as not loaded either."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


_FILE_STORES: list[str] = []
"""The temporary files of this process's single-process `file://` rendezvous: gloo's FileStore deletes its file only
in its destructor, which a run ending in `os._exit` (`moe_gspo.run.quick_exit`) or a signal never reaches."""


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the process group (tests, end of runs).

    Safe as the `finally:` of an entry point that a signal interrupted at any point: it uses only
    modules already imported (never imports torch.distributed or Megatron, which a broken-off import
    cannot be repeated for), does nothing when neither was initialised, and turns a failure of the
    teardown itself into a one-line warning instead of a traceback over the run's own exit."""
    try:
        ps = _loaded("megatron.core.parallel_state")
        is_init = getattr(ps, "model_parallel_is_initialized", None)
        if is_init is not None and is_init():
            ps.destroy_model_parallel()
        pg = _loaded("torch.distributed")
        if pg is not None and pg.is_available() and pg.is_initialized():
            pg.destroy_process_group()
    except Exception as e:  # cleanup: the run's own outcome (and exit code) matters more
        print(f"warning: tearing down torch.distributed failed ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)
    while _FILE_STORES:  # after the process group: the store's destructor skips a file that is gone
        try:
            os.unlink(_FILE_STORES.pop())
        except OSError:
            pass

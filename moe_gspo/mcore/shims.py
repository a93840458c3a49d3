"""Every patch moe-gspo makes for Megatron-core 0.16 (of Megatron itself, and of torch or Transformer Engine on
its behalf; docs/architecture.md, "Shims"): the compatibility shims it needs without CUDA or Transformer
Engine, the fill-ins of Transformer Engine's and grouped_gemm's empty slots, and the edits of its class-level
`RouterReplay` list.

Each compatibility shim is a small, documented monkey-patch of a *missing-hardware* gap, never a change of
Megatron's math. `apply_shims()` is idempotent and applies only what the current machine needs:

- `te_general_gemm` (wherever Transformer Engine is absent, CPU *and* GPU): `moe_utils` references the
  name `te_general_gemm` in its router GEMM even when the TE import failed, which raises `NameError`;
  defining it as `None` selects the plain torch path that already exists upstream.
- `cuda_current_device` (no CUDA): several Megatron modules call `torch.cuda.current_device()` to pick
  the device of new tensors; answering `"cpu"` makes them allocate on the CPU.
- `cpu_rng_tracker` (no CUDA): Megatron forks a named *CUDA* RNG state around weight init and dropout
  (`tensor_parallel.random.get_cuda_rng_tracker().fork()`); the replacement tracker forks the CPU
  generator the same way, so seeded init stays reproducible.
- `cuda_rng_state_io` (no CUDA): activation recomputation (`tensor_parallel.checkpoint`) saves and
  restores the CUDA generator state around the recomputed forward; without CUDA there is no such
  state, so reading it gives an empty tensor and restoring it does nothing (the CPU generator and
  the tracker's states are still saved and restored by Megatron itself).

On CUDA machines with Transformer Engine none of these are applied.

One opt-in fill-in for Transformer Engine's absence, installed by `build_gpt_model(fused_rope=True)`
rather than by `apply_shims()`:

- `install_torch_fused_rope()`: Megatron's `config.apply_rope_fusion` calls TE's
  `fused_apply_rotary_pos_emb`, which `rope_utils` sets to `None` when TE does not import; this puts
  `moe_gspo.mcore.fused_rope.rope_bshd` (one autograd function, bit-identical forward and gradients to
  Megatron's unfused RoPE) in that slot. With TE present, TE's own kernel stays.
- `install_grouped_gemm()` (installed by `build_gpt_model(expert_layout="grouped")`): megatron-core's legacy
  `GroupedMLP` refuses to build unless the `grouped_gemm` CUDA extension imports
  (`transformer/moe/grouped_gemm_util.py`: `grouped_gemm`, `ops.gmm`); this puts
  `moe_gspo.mcore.grouped_experts` (whose `ops.gmm` is that extension's contract on `torch._grouped_mm`)
  in that slot. An installed extension stays.

Megatron-core 0.16 keeps every `RouterReplay` of the process in one class-level list
(`RouterReplay.global_router_replay_instances`, `transformer/moe/router_replay.py`), which its module-level
`set_global_router_replay_action` / `set_replay_data` drive for every model at once. The two edits of that
list, through the list itself (no Megatron code changes):

- `clear_global_router_replay()` (by `build_gpt_model`, before building): a rebuilt model starts from an
  empty list (upstream's own `clear_global_router_replay_instances`), not after a dropped model's routers.
- `detach_from_global_router_replay(replays)` (by `moe_gspo.learner.replay.detach_from_global_replay`, for
  the frozen KL reference beside the policy): takes one model's instances out of the list, so that only a
  `RoutingReplayDriver` of that model makes it replay.

One guard runs before Megatron is imported at all (`moe_gspo.mcore`'s package import runs it):

- `hide_unimportable_transformer_engine()`: Megatron-core imports `transformer_engine` itself at module
  level in places (`tensor_parallel/random.py`, ...) and catches only `ModuleNotFoundError` there, so a TE
  that is installed but raises `ImportError` / `OSError` when imported (a wheel built for another torch or
  CUDA, a missing shared library) crashes the first Megatron import. The guard tries the import once; when
  it fails it marks `transformer_engine` as a missing module (`sys.modules[name] = None`, which makes every
  later `import transformer_engine...` raise `ModuleNotFoundError`), so Megatron and
  `have_transformer_engine()` see TE as absent. `transformer_engine_import_error()` gives the error for
  the one warning line the entry points print (rank 0).

One deferral by the first Megatron import of a training process (`parallel.init_distributed`) and one
shim of what it would otherwise pull in on the first forward:

- `import_megatron_core()`: Megatron-core's `jit.py` takes `jit_fuser = torch.compile` and decorates its
  fusions with it when they are imported; each decoration looks up the inductor backend, which imports
  `torch._inductor.compile_fx` and with it networkx and about 550 more modules (docs/results.md, "Start-up and
  step profiles"). During that import `torch.compile` is a `DeferredCompile`: a decorated function calls
  `torch.compile` with the same arguments on its first call, so what runs, and when it compiles, is unchanged.
- `skip_disabled_expert_bias` (applied by `apply_shims()` on every machine): the one fused function the CPU path calls on every
  router forward is `TopKRouter._apply_expert_bias`, whose body does nothing unless `enable_expert_bias`
  (aux-loss-free load balancing, off in moe-gspo); the shim returns before the compiled function when it is off,
  so it never compiles and the inductor import above never happens. With it on, the compiled function runs.

Besides those shims, two decisions are taken here the way Megatron-core 0.16.1 takes them:

- `have_transformer_engine()`: Transformer Engine counts as present only when it *imports*
  (`import transformer_engine.pytorch`), as Megatron's own modules decide (`try: import ...` in
  `models/gpt/gpt_layer_specs.py`, `optimizer/__init__.py`), not when it is merely installed: a TE
  wheel built for another torch is found by `importlib.util.find_spec` but fails to import, and
  choosing the TE layer spec for it crashes the run.
- `sync_hybrid_optimizer_after_load(dist_opt)`: a workaround for a Megatron-core 0.16.1 bug (not a
  missing-hardware gap). `DistributedOptimizer.load_parameter_state_from_dp_reshardable` writes the
  loaded fp32 master weights into the `HybridDeviceOptimizer`'s state dict only; the fp32 copies its
  sub-optimizers actually step (`param_to_fp32_param`) keep the values of the optimizer's build (or of
  its load-time dummy step). `load_parameter_state_from_fs_model_space` calls the HDO's own
  `_sync_hdo_state_to_sub_optimizers()` for this; the dp_reshardable path does not, so we do.
- `untie_adam_steps_after_load(dist_opt)`: another Megatron-core 0.16.1 bug. Without Apex or Transformer
  Engine, `DistributedOptimizer.load_state_dict` gives every parameter's torch-Adam state the *same* `step`
  tensor; torch's Adam increments each parameter's `step` in place, so after a resume the shared counter
  advances once per parameter per optimizer step and the bias corrections go wrong (a resumed run on a GPU
  without TE diverged from the uninterrupted one at its first update). Each state gets its own copy.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED: set[str] = set()
_TE_IMPORT_ERROR: list[str] = []  # the one import error of an installed, unimportable Transformer Engine


def hide_unimportable_transformer_engine() -> str | None:
    """Mark an installed Transformer Engine that fails to import as a missing module, before Megatron is
    imported (see the module docstring). Returns the import error ("ExcType: message"), or None when TE
    imports or is not installed. Idempotent; the import is tried once per process."""
    import importlib.util
    import sys

    if "te_import_checked" in _APPLIED:
        return transformer_engine_import_error()
    _APPLIED.add("te_import_checked")
    if "transformer_engine" in sys.modules:  # imported already (or already hidden)
        return None
    try:
        if importlib.util.find_spec("transformer_engine") is None:
            return None
    except (ImportError, ValueError):  # a broken package found on the path
        pass
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError) as e:
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]
        sys.modules["transformer_engine"] = None  # `import transformer_engine...` -> ModuleNotFoundError
        _TE_IMPORT_ERROR.append(f"{type(e).__name__}: {e}".splitlines()[0])
        _APPLIED.add("hide_transformer_engine")
        return transformer_engine_import_error()
    return None


def transformer_engine_import_error() -> str | None:
    """The import error of an installed Transformer Engine that `hide_unimportable_transformer_engine`
    hid, else None."""
    return _TE_IMPORT_ERROR[0] if _TE_IMPORT_ERROR else None


def transformer_engine_warning() -> str | None:
    """The one warning line for a hidden Transformer Engine (None when nothing was hidden)."""
    error = transformer_engine_import_error()
    if error is None:
        return None
    return (f"Transformer Engine is installed but does not import ({error}); running without it (Megatron's "
            "local layer spec and moe-gspo's torch fast paths). Uninstall it or install a build for this torch")


def have_transformer_engine() -> bool:
    """True when Transformer Engine's torch extension imports here (see the module docstring).

    A TE that is installed but fails to import (built for another torch, missing libraries) is
    "absent", exactly as Megatron-core treats it, so the local layer spec and torch's Adam are used."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):  # OSError: a shared library of TE that cannot be loaded
        return False
    return True


def sync_hybrid_optimizer_after_load(dist_opt) -> bool:
    """After `dist_opt.load_parameter_state_from_dp_reshardable(...)`, make a `HybridDeviceOptimizer`
    step from the loaded state: its fp32 parameter copies take the loaded master weights and the
    state moves to each sub-optimizer's device (Megatron-core 0.16.1's own
    `_sync_hdo_state_to_sub_optimizers`, which that load path forgets). Returns whether it applied."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    hdo = getattr(dist_opt, "optimizer", None)
    if not isinstance(hdo, HybridDeviceOptimizer):
        return False
    hdo._sync_hdo_state_to_sub_optimizers()
    return True


def untie_adam_steps_after_load(dist_opt) -> int:
    """After `dist_opt.load_state_dict(...)`, give every torch-optimizer state its own `step` tensor (see the
    module docstring); returns how many were untied."""
    state = getattr(getattr(dist_opt, "optimizer", None), "state", None)
    if not isinstance(state, dict):
        return 0
    seen, untied = set(), 0
    for entry in state.values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                entry["step"] = step.detach().clone()
                untied += 1
            seen.add(id(step))
    return untied


def _te_general_gemm_shim() -> bool:
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", False) or hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _cuda_current_device_shim() -> bool:
    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    return True


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """`CudaRNGStatesTracker` with the same contract, over the CPU generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _cpu_rng_tracker_shim() -> bool:
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as mrandom

    if type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ == "CpuRNGStatesTracker":
        return False
    mrandom._CUDA_RNG_STATE_TRACKER = _make_cpu_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return True


def _cuda_rng_state_io_shim() -> bool:
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    return True


def install_torch_fused_rope() -> bool:
    """Fill Megatron's `fused_apply_rotary_pos_emb` slot with `fused_rope.rope_bshd` where TE left it
    empty (see the module docstring); True when the slot holds a fused RoPE afterwards."""
    from megatron.core.models.common.embeddings import rope_utils

    from moe_gspo.mcore.fused_rope import rope_bshd

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rope_bshd
        _APPLIED.add("torch_fused_rope")
    return rope_utils.fused_apply_rotary_pos_emb is not None


def install_grouped_gemm() -> bool:
    """Fill megatron's `grouped_gemm_util` slot with `moe_gspo.mcore.grouped_experts` where the `grouped_gemm`
    extension is absent (see the module docstring); True when `GroupedMLP` can be built afterwards."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm is None:
        from moe_gspo.mcore import grouped_experts

        gg.grouped_gemm, gg.ops = grouped_experts, grouped_experts.ops
        _APPLIED.add("torch_grouped_gemm")
    return gg.grouped_gemm_is_available()


def clear_global_router_replay() -> None:
    """Empty Megatron's class-level `RouterReplay` list before a model is built (see the module docstring)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def detach_from_global_router_replay(replays) -> int:
    """Take the `RouterReplay` instances `replays` out of Megatron's class-level list (see the module
    docstring); returns how many were taken out."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    own = {id(r) for r in replays}
    before = len(RouterReplay.global_router_replay_instances)
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in own]
    return before - len(RouterReplay.global_router_replay_instances)


class DeferredCompile:
    """A stand-in for `torch.compile` while Megatron-core imports (`import_megatron_core`): `fn` decorated
    with it (`@jit_fuser` or `@jit_fuser(**options)`) calls `torch.compile(fn, **options)` on its first
    call and the compiled function from then on."""

    def __call__(self, model=None, **options):
        if model is None:
            return lambda fn: self(fn, **options)
        compiled = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            if not compiled:
                compiled.append(torch.compile(model, **options))
            return compiled[0](*args, **kwargs)

        first_call_compiles.deferred_compile = True
        return first_call_compiles


def import_megatron_core() -> None:
    """Import megatron.core with its import-time `torch.compile` decorations deferred to first use (module
    docstring); nothing when it is imported already. `torch.compile` itself is restored before returning."""
    import sys

    if "megatron.core" in sys.modules:
        return
    real = torch.compile
    torch.compile = DeferredCompile()
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real


def _skip_disabled_expert_bias_shim() -> bool:
    from megatron.core.transformer.moe.router import TopKRouter

    fused = TopKRouter._apply_expert_bias

    @functools.wraps(fused)
    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if not self.enable_expert_bias:  # the fused body updates nothing then (module docstring)
            return None
        return fused(self, routing_map, padding_mask)

    TopKRouter._apply_expert_bias = _apply_expert_bias
    return True


def apply_shims() -> list[str]:
    """Apply the shims this machine needs; returns the names of all shims in force."""
    for name, fn in (
        ("te_general_gemm", _te_general_gemm_shim),
        ("cuda_current_device", _cuda_current_device_shim),
        ("cpu_rng_tracker", _cpu_rng_tracker_shim),
        ("cuda_rng_state_io", _cuda_rng_state_io_shim),
        ("skip_disabled_expert_bias", _skip_disabled_expert_bias_shim),
    ):
        if name not in _APPLIED and fn():
            _APPLIED.add(name)
    return sorted(_APPLIED)


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's named RNG states (data/model/expert parallel) on CPU or CUDA."""
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return
    apply_shims()
    from megatron.core import parallel_state as ps

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    ep_rank = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + tp_rank)

"""Freeing the learner's GPU memory while the rollout engine runs (`train.offload_during_rollout`).

Megatron-core's own mechanisms, nothing reimplemented:
- gradient buffers: `_ParamAndGradBuffer.offload_to_cpu(move_params=False, move_grads=True)` resizes the
  buffer's storage to 0 (every `param.main_grad` / bucket view stays a valid object) and
  `reload_from_cpu(...)` reallocates and zeroes it. Nothing is copied: between updates the gradients are
  zero. This works on CPU as on GPU (a storage resize).
- parameter buffers (distributed optimizer only, where parameters are views of one contiguous buffer):
  the same calls with `move_params=True` copy the bf16 parameters to pinned host memory and free the GPU
  storage; reloading copies them back into the same storage.
- optimizer state on the GPU: `MegatronOptimizer.offload_to_cpu()` / `restore_from_cpu()` — not with the
  precision-aware optimizer, whose optimizer "parameters" are views of the parameter buffer (moving
  their `.data` would cut them off it); there the GPU state is what `optimizer_offload_fraction` leaves
  (none at 1.0) and stays.

Modes: `none`; `grads` (release the gradient buffers after every update, reallocate them before the
next one); `all` (also parameters and optimizer state for the duration of the rollout; CUDA only).
"""

from __future__ import annotations

import torch

MODES = ("none", "grads", "all")


class LearnerOffload:
    """Releases / restores a Megatron DDP model's buffers and its optimizer's GPU state."""

    def __init__(self, ddp_model, megatron_optimizer, *, mode: str = "none", move_optimizer: bool = True):
        if mode not in MODES:
            raise ValueError(f"train.offload_during_rollout={mode!r}: one of {MODES}")
        self.ddp, self.mode = ddp_model, mode
        self.opt = megatron_optimizer if move_optimizer else None
        self.grads_released = False
        self.params_offloaded = False
        if mode == "all":
            if not torch.cuda.is_available():
                raise ValueError("train.offload_during_rollout=all needs CUDA; use grads (or none) on CPU")
            if any(b.param_data is None for b in self._buffers()):
                raise ValueError("train.offload_during_rollout=all needs the distributed optimizer (contiguous "
                                 "parameter buffers); set train.distributed_optimizer=true or use grads")

    def _buffers(self) -> list:
        return list(self.ddp.buffers) + list(self.ddp.expert_parallel_buffers)

    def release_grads(self) -> None:
        """Free the gradient buffers (call when they hold zeros, i.e. after an update)."""
        if self.mode == "none" or self.grads_released:
            return
        for buf in self._buffers():
            buf.offload_to_cpu(move_params=False, move_grads=True)
        self.grads_released = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore_grads(self) -> None:
        """Reallocate the gradient buffers (zeroed) before a backward pass."""
        if not self.grads_released:
            return
        for buf in self._buffers():
            buf.reload_from_cpu(move_params=False, move_grads=True)
        self.grads_released = False

    def offload_for_rollout(self) -> None:
        """Mode `all`: parameters and optimizer GPU state to host memory (gradients are already free)."""
        self.release_grads()
        if self.mode != "all" or self.params_offloaded:
            return
        torch.cuda.synchronize()
        for buf in self._buffers():
            buf.offload_to_cpu(move_params=True, move_grads=False)
        if self.opt is not None:
            self.opt.offload_to_cpu()
        self.params_offloaded = True
        torch.cuda.empty_cache()

    def reload_after_rollout(self) -> None:
        """Inverse of `offload_for_rollout` (gradients stay free until the next update)."""
        if not self.params_offloaded:
            return
        for buf in self._buffers():
            buf.reload_from_cpu(move_params=True, move_grads=False)
        if self.opt is not None:
            self.opt.restore_from_cpu()
        torch.cuda.synchronize()
        self.params_offloaded = False

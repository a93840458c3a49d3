"""The learner's optimizer over a Megatron `DistributedDataParallel` model: Adam(W), global-norm
clipping, and a NaN/Inf guard that skips a step on every rank at once.

- On CUDA: Megatron's `get_megatron_optimizer` (mixed precision with fp32 main parameters for bf16
  models; separate dense / expert optimizers), with its own clipping turned off (`clip_grad=0`):
  clipping happens here, identically on CPU and GPU.
- On CPU (Megatron's optimizer allocates on "cuda"): `torch.optim.AdamW` over the model parameters,
  reading each parameter's DDP gradient buffer (`p.grad = p.main_grad` for the step only). Weight decay
  applies to matrices only (norm weights excluded), as Megatron's default parameter groups do.

Memory options (`OptimizerOptions`, resolved once from `TrainConfig` and the device by
`resolve_optimizer_options`), all Megatron-core's own, CUDA only:
- `distributed_optimizer`: Megatron's `DistributedOptimizer` (and `use_distributed_optimizer` in the
  DDP config): main params and Adam state sharded over the data-parallel group for dense parameters and
  over the expert-data-parallel group (world / EP) for experts;
- `precision_aware_optimizer`: `use_precision_aware_optimizer` (no fp32 main-param copy held by
  Megatron; Adam moments in `optimizer_state_dtype` with Transformer Engine's FusedAdam); megatron-core
  0.16 needs Transformer Engine for it, with or without CPU offload;
- `optimizer_cpu_offload` with `optimizer_offload_fraction` and `overlap_cpu_optimizer_d2h_h2d`:
  Megatron's `HybridDeviceOptimizer` (CPU AdamW over that fraction of the shard);
- `grad_reduce_in_fp32`: the DDP gradient buffers' dtype.

Gradient norm. CPU path: after DDP's gradient sync, dense gradients are identical on every rank
(all-reduced over data parallelism) while expert gradients are sharded over expert parallelism, so
`norm^2 = |dense|^2 + sum over the EP group of |local experts|^2`; every rank gets the same number.
Megatron marks expert-parallel parameters with `allreduce=False`; DDP keeps them in separate buffers.
Megatron path: Megatron's own `prepare_grads()` (DDP buffers -> main grads, sharded under the
distributed optimizer) and `get_grad_norm()`, then Megatron's `clip_grad_by_total_norm_fp32` on the
main grads and `step_with_ready_grads()` — `ChainedOptimizer.step()` split in two so that the NaN/Inf
guard agreed by all ranks sits between the norm and the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
    """The learner's optimizer memory options, resolved for a device (see the module docstring)."""

    distributed_optimizer: bool = False
    precision_aware_optimizer: bool = False
    optimizer_state_dtype: str = "float32"
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = True
    grad_reduce_in_fp32: bool = True
    offload_during_rollout: str = "none"


def resolve_optimizer_options(train, *, on_cuda: bool, have_te: bool | None = None) -> OptimizerOptions:
    """`OptimizerOptions` of a `TrainConfig` on this device; raises ValueError (naming the field and the
    fix) for options the device cannot run. Called at start-up, before any weight is loaded."""
    if not on_cuda:
        needs_cuda = [f"train.{name}=true" for name in ("distributed_optimizer", "precision_aware_optimizer",
                                                        "optimizer_cpu_offload") if getattr(train, name)]
        if train.offload_during_rollout == "all":
            needs_cuda.append("train.offload_during_rollout=all")
        if needs_cuda:
            raise ValueError(f"{', '.join(needs_cuda)} needs CUDA: Megatron's optimizer allocates on the GPU and the "
                             "CPU path uses a torch AdamW; on CPU set train.distributed_optimizer=null, "
                             "train.precision_aware_optimizer=false, train.optimizer_cpu_offload=false, "
                             "train.offload_during_rollout=none or grads")
        return OptimizerOptions(distributed_optimizer=False, grad_reduce_in_fp32=bool(train.grad_reduce_in_fp32),
                                offload_during_rollout=train.offload_during_rollout)
    distributed = True if train.distributed_optimizer is None else bool(train.distributed_optimizer)
    if train.precision_aware_optimizer:
        if have_te is None:
            from moe_gspo.mcore.shims import have_transformer_engine

            have_te = have_transformer_engine()
        if not have_te:
            # megatron-core 0.16's OptimizerConfig reads TE's version for the precision-aware optimizer
            # (a TypeError without TE), and without CPU offload it steps with TE's FusedAdam.
            raise ValueError("train.precision_aware_optimizer=true needs Transformer Engine (megatron-core 0.16 "
                             "requires it for the precision-aware optimizer, also with CPU offload), which is not "
                             "importable: install transformer-engine, or set train.precision_aware_optimizer=false "
                             "and train.optimizer_cpu_offload=false")
    return OptimizerOptions(
        distributed_optimizer=distributed, precision_aware_optimizer=bool(train.precision_aware_optimizer),
        optimizer_state_dtype=train.optimizer_state_dtype, optimizer_cpu_offload=bool(train.optimizer_cpu_offload),
        optimizer_offload_fraction=float(train.optimizer_offload_fraction),
        overlap_cpu_optimizer_d2h_h2d=bool(train.overlap_cpu_optimizer_d2h_h2d),
        grad_reduce_in_fp32=bool(train.grad_reduce_in_fp32), offload_during_rollout=train.offload_during_rollout)


def _grad_sq_sum(buffers) -> torch.Tensor:
    total = None
    for buf in buffers:
        s = buf.grad_data.float().pow(2).sum()
        total = s if total is None else total + s
    return total


def global_grad_norm(ddp_model) -> float:
    """L2 norm of the full model gradient (all ranks' shards), from DDP's gradient buffers."""
    from megatron.core import parallel_state as ps

    dense = _grad_sq_sum(ddp_model.buffers)
    expert = _grad_sq_sum(ddp_model.expert_parallel_buffers)
    device = next(iter(ddp_model.module.parameters())).device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    dense = zero if dense is None else dense
    expert = zero.clone() if expert is None else expert.clone()
    if ps.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=ps.get_expert_model_parallel_group())
    return float((dense + expert).sqrt())


def any_rank(flag: bool, device) -> bool:
    """True when `flag` is True on at least one rank of the world (a MAX all-reduce)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def params_finite(params, device) -> bool:
    """True when every element of every tensor in `params` is finite on every rank (collective).
    One fused max-abs reduction per tensor (NaN propagates through it), no full-size temporaries."""
    params = [p.detach() for p in params if p.numel()]
    bad = False
    if params:
        maxabs = torch.stack([n.float() for n in torch._foreach_norm(params, float("inf"))])
        bad = not bool(torch.isfinite(maxabs).all())
    return not any_rank(bad, device)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor that scales gradients of norm `norm` down to at most `max_norm` (1.0 when off or within)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


class LearnerOptimizer:
    """Adam(W) over a Megatron DDP model with global-norm clipping; see the module docstring."""

    def __init__(self, ddp_model, *, lr: float, weight_decay: float, betas: tuple[float, float],
                 grad_clip: float, eps: float = 1e-8, use_megatron: bool | None = None,
                 options: OptimizerOptions | None = None):
        self.ddp = ddp_model
        self.lr = float(lr)
        self.grad_clip = float(grad_clip)
        params = [p for p in ddp_model.module.parameters() if p.requires_grad]
        if use_megatron is None:
            use_megatron = params[0].is_cuda
        self.use_megatron = bool(use_megatron)
        self.options = options or OptimizerOptions(distributed_optimizer=False)
        if self.options.distributed_optimizer and not self.use_megatron:
            raise ValueError("train.distributed_optimizer=true needs CUDA (Megatron's optimizer); on CPU set it to null")
        ddp_distributed = bool(getattr(getattr(ddp_model, "ddp_config", None), "use_distributed_optimizer", False))
        if ddp_distributed != self.options.distributed_optimizer:
            raise ValueError(f"the DDP model was wrapped with use_distributed_optimizer={ddp_distributed} but "
                             f"train.distributed_optimizer resolves to {self.options.distributed_optimizer}; pass the "
                             "bare GPTModel to Learner (it wraps it), or make them agree")
        if self.use_megatron:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            dtype = params[0].dtype
            o = self.options
            state_dtype = getattr(torch, o.optimizer_state_dtype)
            cfg = OptimizerConfig(optimizer="adam", lr=self.lr, min_lr=self.lr, weight_decay=weight_decay,
                                  adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0,
                                  bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
                                  use_distributed_optimizer=o.distributed_optimizer,
                                  use_precision_aware_optimizer=o.precision_aware_optimizer,
                                  exp_avg_dtype=state_dtype, exp_avg_sq_dtype=state_dtype,
                                  optimizer_cpu_offload=o.optimizer_cpu_offload,
                                  optimizer_offload_fraction=o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0,
                                  overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_optimizer_d2h_h2d and o.optimizer_cpu_offload)
            self.opt = get_megatron_optimizer(cfg, [ddp_model])
        else:
            decay = [p for p in params if p.dim() >= 2]
            no_decay = [p for p in params if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
            # fused: one kernel per group instead of a Python loop over parameters (torch defaults to
            # foreach on CUDA only, to the loop on CPU); same maths. Tiny model, CPU: 0.43 ms per step
            # fused, 1.47 ms foreach, 2.08 ms the loop.
            self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=tuple(betas),
                                         eps=eps, fused=True)
        self._params = params

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (every parameter group; Megatron's optimizers read it from
        their torch param groups, as its OptimizerParamScheduler sets it)."""
        self.lr = float(lr)
        for group in self.opt.param_groups:
            group["lr"] = self.lr

    def grad_norm(self) -> float:
        """Global gradient norm after DDP's gradient sync (Megatron path: also prepares its main grads)."""
        if self.use_megatron:
            self.opt.prepare_grads()  # DDP buffers -> main grads (this rank's shard under the distributed optimizer)
            return float(self.opt.get_grad_norm())
        return global_grad_norm(self.ddp)

    def clip(self, norm: float) -> float:
        """Scale the gradients so that their global norm is at most `grad_clip`; returns the factor."""
        coef = clip_coefficient(norm, self.grad_clip)
        if coef < 1.0:
            if self.use_megatron:
                from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

                for opt in getattr(self.opt, "chained_optimizers", [self.opt]):
                    params = opt.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(
                            params, max_norm=self.grad_clip, total_norm=norm,
                            use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
            else:
                self.ddp.scale_gradients(coef)
        return coef

    def step(self) -> None:
        """One Adam(W) step from the (synced, clipped) gradients; call `grad_norm()` first."""
        if self.use_megatron:
            self.opt.step_with_ready_grads()
            return
        for p in self._params:
            p.grad = p.main_grad
        try:
            self.opt.step()
        finally:
            # The DDP hooks add `param.grad` into `main_grad`; leaving main_grad there would double it.
            for p in self._params:
                p.grad = None

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        if self.use_megatron:
            self.opt.zero_grad()

    def _chained(self) -> list:
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    @staticmethod
    def _has_stepped(o) -> bool:
        """Whether Megatron optimizer `o` holds optimizer state (it took a step, or loaded one)."""
        return not getattr(o, "is_stub_optimizer", False) and len(o.optimizer.state) > 0

    def state_dict(self) -> dict:
        """This rank's optimizer state.

        Under the distributed optimizer, one entry per Megatron optimizer (dense, experts): `None` when
        it has taken no step yet (a checkpoint before the first update, or after NaN-guarded steps
        only: Megatron-core 0.16.1's `DistributedOptimizer.state_dict()` asserts on such an optimizer
        without TE/Apex, as it finds no `step`), else Megatron's `state_dict()` plus this rank's
        shard of main params and Adam moments in Megatron's per-rank "dp_reshardable" form (no gather)."""
        if not (self.use_megatron and self.options.distributed_optimizer):
            return self.opt.state_dict()
        entries = []
        for o in self._chained():
            if not self._has_stepped(o):
                entries.append(None)
                continue
            state = o.get_parameter_state_dp_reshardable()
            for key, per_dtype in state.items():
                if isinstance(key, int):
                    for buckets in per_dtype.values():
                        for bucket in buckets:
                            for tensors in bucket:
                                tensors.setdefault("padding", False)
            entries.append({"common": o.state_dict(), "param_state": state})
        return {"megatron_distributed_optimizer": True, "optimizers": entries}

    def load_state_dict(self, state: dict, *, load_weights: Callable[[], None]) -> None:
        """Inverse of `state_dict`, together with the model weights: `load_weights()` loads them.

        The order is the point: the optimizer state first, the weights last, then the main params of
        optimizers without saved state follow the loaded weights. Loading the optimizer may write into
        the model: Megatron's `DistributedOptimizer.load_state_dict` runs `HybridDeviceOptimizer.dummy_step()`
        on a fresh CPU-offloaded optimizer, whose step hook copies its fp32 masters (cloned from the
        weights at build) back into the model; weights loaded before that would silently become the
        initial ones again (issue 20). The loaded masters then reach the HDO's fp32 copies through
        `moe_gspo.mcore.shims.sync_hybrid_optimizer_after_load` (a Megatron-core 0.16.1 gap)."""
        with torch.no_grad():  # Megatron copies into main params that may be views of the model's (fp32) weights
            self._load_state_dict(state, load_weights)

    def _load_state_dict(self, state: dict, load_weights: Callable[[], None]) -> None:
        distributed = isinstance(state, dict) and bool(state.get("megatron_distributed_optimizer", False))
        if distributed != bool(self.use_megatron and self.options.distributed_optimizer):
            raise ValueError("checkpoint optimizer state was saved with train.distributed_optimizer="
                             f"{str(distributed).lower()}; resume with the same setting")
        if not distributed:
            self.opt.load_state_dict(state)
            load_weights()
            return
        from moe_gspo.mcore.shims import sync_hybrid_optimizer_after_load, untie_adam_steps_after_load

        chained = self._chained()
        entries = state.get("optimizers")
        if not isinstance(entries, list) or len(entries) != len(chained):
            raise ValueError(f"checkpoint optimizer state holds {len(entries) if isinstance(entries, list) else 'no'} "
                             f"Megatron optimizer entries, this learner has {len(chained)}; it was written by another "
                             "code version or model setup")
        for o, entry in zip(chained, entries):
            if entry is None and self._has_stepped(o):
                raise ValueError("a checkpoint taken before the first optimizer step loads into a fresh learner "
                                 "only (this one has optimizer state already)")
            if entry is not None:
                o.load_state_dict(entry["common"])  # may overwrite the model's weights (HDO dummy step)
                untie_adam_steps_after_load(o)
                o.load_parameter_state_from_dp_reshardable(entry["param_state"])
                sync_hybrid_optimizer_after_load(o)
        load_weights()
        for o, entry in zip(chained, entries):
            if entry is None and not getattr(o, "is_stub_optimizer", False):
                o.reload_model_params()  # no saved state: main params follow the loaded weights

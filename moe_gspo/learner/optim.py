"""The learner's optimizer over a Megatron `DistributedDataParallel` model: Adam(W), global-norm
clipping, and a NaN/Inf guard that skips a step on every rank at once.

- On CUDA: Megatron's `get_megatron_optimizer` (mixed precision with fp32 main parameters for bf16
  models; separate dense / expert optimizers), with its own clipping turned off (`clip_grad=0`):
  clipping happens here, identically on CPU and GPU.
- On CPU (Megatron's optimizer allocates on "cuda"): `torch.optim.AdamW` over the model parameters,
  reading each parameter's DDP gradient buffer (`p.grad = p.main_grad` for the step only). Weight decay
  applies to matrices only (norm weights excluded), as Megatron's default parameter groups do.

Gradient norm: after DDP's gradient sync, dense gradients are identical on every rank (all-reduced
over data parallelism) while expert gradients are sharded over expert parallelism, so
`norm^2 = |dense|^2 + sum over the EP group of |local experts|^2`; every rank gets the same number.
Megatron marks expert-parallel parameters with `allreduce=False`; DDP keeps them in separate buffers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


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
                 grad_clip: float, eps: float = 1e-8, use_megatron: bool | None = None):
        self.ddp = ddp_model
        self.lr = float(lr)
        self.grad_clip = float(grad_clip)
        params = [p for p in ddp_model.module.parameters() if p.requires_grad]
        if use_megatron is None:
            use_megatron = params[0].is_cuda
        self.use_megatron = bool(use_megatron)
        if self.use_megatron:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            dtype = params[0].dtype
            cfg = OptimizerConfig(optimizer="adam", lr=self.lr, min_lr=self.lr, weight_decay=weight_decay,
                                  adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0,
                                  bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
                                  use_distributed_optimizer=False)
            self.opt = get_megatron_optimizer(cfg, [ddp_model])
        else:
            decay = [p for p in params if p.dim() >= 2]
            no_decay = [p for p in params if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
            self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=tuple(betas),
                                         eps=eps)
        self._params = params

    def grad_norm(self) -> float:
        return global_grad_norm(self.ddp)

    def clip(self, norm: float) -> float:
        """Scale the gradients so that their global norm is at most `grad_clip`; returns the factor."""
        coef = clip_coefficient(norm, self.grad_clip)
        if coef < 1.0:
            self.ddp.scale_gradients(coef)
        return coef

    def step(self) -> None:
        """One Adam(W) step from the (synced, clipped) DDP gradient buffers."""
        if self.use_megatron:
            self.opt.step()
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

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)

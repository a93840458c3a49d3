"""The memory plan: per-rank GPU memory of every phase of an RL step, counted from the run config.

`python -m moe_gspo.plan CONFIG [--gpus N] [--gpu-mem-gib G] [--json] [section.key=value ...]`.
Modules (pure arithmetic unless said): `params` (parameter counts from the HF config), `activations`
(the activation formula and its assumptions), `transients` (short-lived allocations: optimizer step,
weight sync, HF export, sample gather), `host_routes` (the step's routes in host memory, per rank),
`memory` (learner / reference / rollout / weight-sync memory per phase), `engine_memory` (each rollout
engine's own terms, named by its `moe_gspo.rollout.engine_spec.EngineSpec`), `from_config` (a run `Config` →
a plan), `knobs` (what to change when it does not fit), `report` (the table), `startup` (the check
`moe_gspo.train` runs on GPU before loading weights), `flops` (model FLOPs of the learner's passes and
MFU, for `benchmarks.gpu_check`).
Counted, not measured on a GPU: see README "Memory plan".
"""

from moe_gspo.plan.from_config import plan_for_config, resolve_hf_config
from moe_gspo.plan.memory import Allowances, PlanResult

__all__ = ["Allowances", "PlanResult", "plan_for_config", "resolve_hf_config", "make_plan"]


def make_plan(cfg, *, num_gpus: int, gpu_mem_gib: float, model_config: str | None = None,
              attention: str | None = None, gpus_per_node: int = 8, host_mem_gib: float | None = None,
              allowances: Allowances = Allowances(), with_knobs: bool = True) -> PlanResult:
    """The plan of `cfg`, with the knob to turn when it does not fit."""
    from moe_gspo.plan.from_config import default_attention
    from moe_gspo.plan.knobs import layout_fixes, suggest
    from moe_gspo.plan.params import Geometry

    hf_config, source = resolve_hf_config(cfg, model_config)
    attention = attention or default_attention()
    kw = dict(hf_config=hf_config, model_source=source, attention=attention, gpus_per_node=gpus_per_node,
              host_mem_gib=host_mem_gib, allowances=allowances)
    result = plan_for_config(cfg, num_gpus=num_gpus, gpu_mem_gib=gpu_mem_gib, **kw)
    if with_knobs and not result.fits:
        def plan_fn(c, n):
            return plan_for_config(c, num_gpus=n, gpu_mem_gib=gpu_mem_gib, **kw)

        # a layout that does not work on this GPU count: first the layouts that do (and fit)
        knobs, note = layout_fixes(cfg, result, plan_fn, Geometry.from_hf(hf_config), num_gpus=num_gpus,
                                   gpus_per_node=gpus_per_node)
        if note:
            result.notes.insert(0, note)
        knobs += [k for k in suggest(cfg, result, plan_fn, num_gpus=num_gpus, gpus_per_node=gpus_per_node)
                  if k not in knobs and not (knobs and k.startswith("no combination"))]
        result.knobs = knobs
    return result

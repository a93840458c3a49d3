"""The knob to turn when a plan does not fit: candidate config changes, each re-planned.

Candidates (only those that change something for this config), in order of preference — cheapest in
speed and closest to the experiment first: rollout sleep, the distributed optimizer, activation
recomputation, micro-batch 1, a larger rollout TP, a smaller KV budget / vLLM budget, optimizer CPU
offload (precision-aware, all of the shard), freeing gradients / offloading the learner during the
rollout, bf16 gradient reduction, a larger EP, more GPUs. Every
single change that makes the plan fit is listed (preference order); if none does alone, the changes are
combined greedily (each time the one that lowers the peak most) until the plan fits or nothing helps.

When the config's process layout does not work on the GPU count at all (`PlanResult.layout_problems`:
EP or rollout TP not dividing it, say), `layout_fixes` first tries every layout that does work there
(`valid_layouts`) and names those that fit, with their overrides; if none fits alone, the usual knobs
are tried on the valid layout with the lowest peak.
"""

from __future__ import annotations

import math
import warnings
from itertools import product
from typing import Callable

from moe_gspo.config import Config
from moe_gspo.plan.from_config import setups, with_overrides
from moe_gspo.plan.memory import PlanResult, layout_problems
from moe_gspo.plan.params import Geometry
from moe_gspo.rollout.engine_spec import engine_spec


def candidates(cfg: Config, *, num_gpus: int, gpus_per_node: int = 8) -> list[list[str]]:
    """Candidate override sets (dotted `section.key=value` lists) for `cfg`."""
    learner, _ = setups(cfg, num_gpus=num_gpus, attention="flash")
    r, tr = cfg.rollout, cfg.train
    spec = engine_spec(r.engine)
    out: list[list[str]] = []
    if spec.sleep_mode and r.sleep_level == 0:
        out.append(["rollout.sleep_level=1"])
    if not learner.distributed_optimizer:
        out.append(["train.distributed_optimizer=true"])
    if not cfg.model.recompute:
        out.append(["model.recompute=true"])
    if learner.train_mb.num_seqs > 1 or learner.infer_mb.num_seqs > 1:
        out.append(["train.micro_batch_size=1"])
    if spec.tensor_parallel:
        tp = r.tensor_parallel_size * 2
        while tp <= num_gpus and tp <= 2 * gpus_per_node:
            out.append([f"rollout.tensor_parallel_size={tp}"])
            tp *= 2
    if spec.kv_budget:
        if r.kv_cache_gib is not None and r.kv_cache_gib > 1:
            out.append([f"rollout.kv_cache_gib={r.kv_cache_gib / 2:g}"])
        if r.gpu_memory_utilization > 0.2:
            out.append([f"rollout.gpu_memory_utilization={max(0.1, round(r.gpu_memory_utilization - 0.2, 2)):g}"])
    if not learner.cpu_offload:
        out.append(["train.distributed_optimizer=true", "train.precision_aware_optimizer=true",
                    "train.optimizer_cpu_offload=true", "train.optimizer_offload_fraction=1.0"])
    elif learner.offload_fraction < 1:
        out.append(["train.optimizer_offload_fraction=1.0"])
    if tr.offload_during_rollout == "none":
        out.append(["train.offload_during_rollout=grads"])
    if tr.offload_during_rollout != "all":
        out.append(["train.distributed_optimizer=true", "train.offload_during_rollout=all"])
    if tr.grad_reduce_in_fp32 and learner.param_bytes == 2:
        out.append(["train.grad_reduce_in_fp32=false"])
    ep = cfg.parallel.expert_parallel_size * 2
    if num_gpus % ep == 0:
        out.append([f"parallel.expert_parallel_size={ep}"])
    out.append([f"--gpus {num_gpus * 2}"])
    return out


def _apply(cfg: Config, overrides: list[str], num_gpus: int) -> tuple[Config, int]:
    gpus = [o for o in overrides if o.startswith("--gpus ")]
    rest = [o for o in overrides if not o.startswith("--gpus ")]
    n = int(gpus[-1].split()[1]) if gpus else num_gpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return with_overrides(cfg, rest), n


def suggest(cfg: Config, result: PlanResult, plan_fn: Callable[[Config, int], PlanResult], *, num_gpus: int,
            gpus_per_node: int = 8, max_steps: int = 6) -> list[str]:
    """Human-readable suggestions (each: the overrides and the peak they give); empty when it fits.

    `plan_fn(cfg, num_gpus)` re-plans a modified config with everything else unchanged."""
    if result.fits:
        return []
    scored = []
    for ovs in candidates(cfg, num_gpus=num_gpus, gpus_per_node=gpus_per_node):
        try:
            c, n = _apply(cfg, ovs, num_gpus)
            res = plan_fn(c, n)
        except ValueError:
            continue
        scored.append((ovs, res))
    singles = [f"{' '.join(o)}  (peak {res.per_rank_gib:.1f} GiB)" for o, res in scored if res.fits]
    if singles:
        return singles
    # Greedy combination.
    chosen: list[str] = []
    current, cur_cfg, cur_n = result, cfg, num_gpus
    for _ in range(max_steps):
        best = None
        for ovs in candidates(cur_cfg, num_gpus=cur_n, gpus_per_node=gpus_per_node):
            try:
                c, n = _apply(cur_cfg, ovs, cur_n)
                res = plan_fn(c, n)
            except ValueError:
                continue
            key = (not res.fits, res.per_rank_gib, len(res.problems))
            if best is None or key < best[0]:
                best = (key, ovs, res, c, n)
        if best is None or (best[2].per_rank_gib >= current.per_rank_gib and not best[2].fits
                            and len(best[2].problems) >= len(current.problems)):
            break
        _, ovs, current, cur_cfg, cur_n = best
        chosen += ovs
        if current.fits:
            return [f"{' '.join(chosen)}  (together; peak {current.per_rank_gib:.1f} GiB)"]
    return [f"no combination of the usual knobs fits; closest: {' '.join(chosen) or '(none)'} "
            f"(peak {current.per_rank_gib:.1f} GiB): use more or larger GPUs, or shorter sequences "
            "(rollout.max_model_len)"]


def valid_layouts(cfg: Config, geom: Geometry, *, num_gpus: int, gpus_per_node: int = 8) -> list[list[str]]:
    """Override sets that give `cfg` a process layout working on `num_gpus` GPUs (`layout_problems`),
    closest to the config first; empty when the config's own layout works.

    The config's EP (rollout TP) is kept when it works; otherwise every value that does is tried: EP
    dividing the GPU count and the experts, vLLM TP dividing the GPU count and the heads (at most one
    node, `gpus_per_node`; 1 only with `rollout.record_routes`, which needs TP = 1)."""
    ep0, r = cfg.parallel.expert_parallel_size, cfg.rollout
    tp0 = r.tensor_parallel_size

    def ep_ok(e: int) -> bool:
        return not layout_problems(geom, num_gpus=num_gpus, ep=e, engine=r.engine, tp=1)

    def tp_ok(t: int) -> bool:
        return not layout_problems(geom, num_gpus=num_gpus, ep=1, engine=r.engine, tp=t)

    divisors = [d for d in range(1, num_gpus + 1) if num_gpus % d == 0]
    eps = [ep0] if ep_ok(ep0) else [e for e in divisors if ep_ok(e)]
    tps = [tp0] if tp_ok(tp0) else [t for t in divisors if tp_ok(t) and t <= max(gpus_per_node, 1)
                                    and (t == 1 or not r.record_routes)]
    if eps == [ep0] and tps == [tp0]:
        return []

    def distance(v: int, v0: int) -> float:
        return abs(math.log2(v / v0)) if v0 > 0 else float(v)

    combos = sorted(product(eps, tps), key=lambda et: (distance(et[0], ep0) + distance(et[1], tp0), -et[0], -et[1]))
    return [[f"parallel.expert_parallel_size={e}"] * (e != ep0) + [f"rollout.tensor_parallel_size={t}"] * (t != tp0)
            for e, t in combos]


def layout_fixes(cfg: Config, result: PlanResult, plan_fn: Callable[[Config, int], PlanResult], geom: Geometry, *,
                 num_gpus: int, gpus_per_node: int = 8) -> tuple[list[str], str | None]:
    """(suggestions like `suggest`'s, a note on what was tried) when the config's layout does not work on
    `num_gpus` GPUs: every valid layout that fits, else the usual knobs on the valid layout with the
    lowest peak; ([], None) when the layout works."""
    if not result.layout_problems:
        return [], None
    scored = []
    for ovs in valid_layouts(cfg, geom, num_gpus=num_gpus, gpus_per_node=gpus_per_node):
        try:
            c, n = _apply(cfg, ovs, num_gpus)
            res = plan_fn(c, n)
        except ValueError:
            continue
        scored.append((ovs, c, res))
    if not scored:
        return [], f"no process layout works on {num_gpus} GPUs (EP must divide the GPU count and the experts)"
    fitting = [f"{' '.join(o)}  (peak {res.per_rank_gib:.1f} GiB; a layout that works on {num_gpus} GPUs)"
               for o, _, res in scored if res.fits]
    tried = f"{len(scored)} layout{'s' if len(scored) != 1 else ''} that work{'s' if len(scored) == 1 else ''} on {num_gpus} GPUs"
    if fitting:
        return fitting, f"{tried} tried; {len(fitting)} fit{'s' if len(fitting) == 1 else ''} (knob to turn)"
    ovs, c, res = min(scored, key=lambda x: (len(x[2].layout_problems), len(x[2].problems), x[2].per_rank_gib))
    head = " ".join(ovs)
    note = (f"{tried} tried; none fits alone: the lowest peak is {head}'s {res.per_rank_gib:.1f} GiB (phase "
            f"'{res.peak_phase.name}'), so the knobs below combine it with the usual knobs")
    out = []
    for s in suggest(c, res, plan_fn, num_gpus=num_gpus, gpus_per_node=gpus_per_node):
        if s.startswith("--gpus"):
            continue  # more GPUs: the plain suggestion on the config's own layout says it
        out.append(f"{head} {s}" if not s.startswith("no combination") else
                   f"{head} (the layout for {num_gpus} GPUs with the lowest peak, {res.per_rank_gib:.1f} GiB) and "
                   f"then {s}")
    return out, note

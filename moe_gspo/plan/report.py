"""Human-readable rendering of a memory plan (a table of GiB per GPU, phases as columns)."""

from __future__ import annotations

from moe_gspo.plan.memory import PlanResult
from moe_gspo.rollout.engine_spec import engine_spec

ROW_ORDER = ("learner_params", "learner_grads", "optimizer_gpu", "reference", "activations", "step_transient",
             "rollout_weights", "rollout_kv", "rollout_runtime", "rollout_engine", "sample_gather", "rollout_resident",
             "sync_transient", "export_transient", "fragmentation", "cuda_runtime")


def _b(n: float) -> str:
    """A parameter count: 30.53 B, 204.80 K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _gib(v: float) -> str:
    return f"{v:.2f}" if v >= 0.01 or v == 0 else f"{v:.1e}"


def describe_setup(result: PlanResult, cfg) -> list[str]:
    """Two lines on what is planned: the learner's options and the rollout engine's."""
    from moe_gspo.learner.optim import resolve_optimizer_options

    p = result.params
    o = resolve_optimizer_options(cfg.train, on_cuda=True, have_te=True)
    ep = cfg.parallel.expert_parallel_size
    opt = ["distributed optimizer (shard " + _b(p["optimizer_shard"]) + ")" if o.distributed_optimizer
           else "no distributed optimizer"]
    if o.precision_aware_optimizer:
        opt.append("precision-aware" + (f", Adam moments {o.optimizer_state_dtype}"
                                        if o.optimizer_state_dtype != "float32" else ""))
    if o.optimizer_cpu_offload:
        opt.append(f"CPU offload {o.optimizer_offload_fraction:.0%}"
                   + (" (overlapped D2H/H2D)" if o.overlap_cpu_optimizer_d2h_h2d else ""))
    opt.append("grads fp32" if o.grad_reduce_in_fp32 else "grads in param dtype")
    opt.append("full recompute" if cfg.model.recompute else "no recompute")
    if o.offload_during_rollout != "none":
        opt.append(f"offload during rollout: {o.offload_during_rollout}")
    if cfg.algo.kl_coef > 0:
        opt.append("reference policy (algo.kl_coef > 0)")
    r = cfg.rollout
    n = result.num_gpus
    edp = (f"EDP={n // ep}" if ep >= 1 and n % ep == 0 else
           f"EDP=none (EDP = GPUs / EP, and EP={ep} does not divide the {n} GPUs)")
    learner = (f"learner: {'fp32' if cfg.model.params_dtype == 'float32' else 'bf16'}, EP={ep} DP={n} "
               f"{edp}, {_b(p['per_rank'])} params per rank; " + ", ".join(opt))
    rollout = engine_spec(r.engine).memory_terms().header(r, num_gpus=n, per_gpu_params=_b(p["rollout_per_gpu"]))
    return [learner, rollout]


def verdict(result: PlanResult) -> str:
    """What the plan concludes, saying what fails: the layout, the peak, or another limit (the problems)."""
    spare = result.gpu_mem_gib - result.per_rank_gib
    if result.fits:
        return f"FITS ({spare:.1f} GiB to spare)"
    if result.layout_problems:
        fields = ", ".join(p.split(" ", 1)[0] for p in result.layout_problems)
        return (f"CANNOT RUN on {result.num_gpus} GPUs: the process layout does not work there ({fields}; see problems), "
                f"whatever the memory; the figures above count that layout as configured")
    if spare < 0:
        return f"DOES NOT FIT ({-spare:.1f} GiB over)"
    n = len(result.problems)
    return (f"DOES NOT FIT: not the peak but {'another limit' if n == 1 else f'{n} other limits'} "
            f"(see problems)")


def host_routes_lines(result: PlanResult) -> list[str]:
    """The routes' share of the host memory (`moe_gspo.plan.host_routes`): per rank, per node, and its parts."""
    h = result.host_routes
    if not h or not h.get("per_rank_gib"):
        return []
    per = h["bytes_per_token"]
    return [f"  routes: {h['per_rank_gib']:.2f} GiB per rank x {h['ranks_per_node']} ranks = "
            f"{h['per_node_gib']:.0f} GiB per node, at the {h['peak_moment']} moment ({h['tokens_per_step']:,} tokens per step on every rank: "
            f"rollout routes {h['rollout_gib']:.2f} GiB, learner-recorded routes/probs/stats {h['learner_gib']:.2f}, "
            f"transient copies {h['transient_gib']:.2f})",
            f"  routes per token: rollout {per['rollout']} B, learner kept {per['learner_kept']} B, learner pass's "
            f"whole-batch arrays at its end {per['learner_gather']} B, metrics' copies {per['metrics']} B"]


def render(result: PlanResult, cfg, *, config_name: str) -> str:
    p = result.params
    lines = [f"Memory plan (counted, not measured on a GPU): {config_name} on {result.num_gpus} x "
             f"{result.gpu_mem_gib:g} GiB GPUs",
             f"model: {_b(p['total'])} parameters = {_b(p['dense'])} dense + {_b(p['expert'])} expert"]
    lines += describe_setup(result, cfg)
    rows = [k for k in ROW_ORDER if any(k in ph.parts_gib for ph in result.phases)]
    names = [ph.name for ph in result.phases]
    w0 = max(len(r) for r in rows + ["GiB per GPU"]) + 2
    widths = [max(len(n), 7) + 2 for n in names]
    lines.append("")
    lines.append("GiB per GPU".ljust(w0) + "".join(n.rjust(w) for n, w in zip(names, widths)))
    for row in rows:
        cells = [_gib(ph.parts_gib[row]) if row in ph.parts_gib else "-" for ph in result.phases]
        lines.append(row.ljust(w0) + "".join(c.rjust(w) for c, w in zip(cells, widths)))
    lines.append("total".ljust(w0) + "".join(f"{ph.total_gib:.2f}".rjust(w) for ph, w in zip(result.phases, widths)))
    peak = result.peak_phase
    lines.append("")
    lines.append(f"peak: {peak.name} {peak.total_gib:.1f} GiB of {result.gpu_mem_gib:g} GiB -> {verdict(result)}")
    lines.append(f"host memory per node (offloaded optimizer state, sleeping engines' weights, routes): "
                 f"{result.host_per_node_gib:.0f} GiB")
    lines += host_routes_lines(result)
    for title, items in (("problems", result.problems), ("knob to turn", result.knobs), ("notes", result.notes),
                         ("assumptions", result.assumptions)):
        if items:
            lines.append(f"{title}:")
            lines += [f"  - {x}" for x in items]
    return "\n".join(lines)


def one_line(result: PlanResult) -> str:
    """The plan's verdict in one line (the start-up check's message)."""
    peak = result.peak_phase
    head = (f"memory plan: peak {peak.total_gib:.1f} GiB per GPU in phase '{peak.name}' of "
            f"{result.gpu_mem_gib:g} GiB")
    if result.fits:
        return head + " - fits"
    what = (f"cannot run on {result.num_gpus} GPUs (process layout)" if result.layout_problems else "does not fit")
    msg = head + f" - {what}: " + "; ".join(result.problems)
    if result.knobs:
        msg += ". Knob to turn: " + result.knobs[0]
    return msg + ". Details: python -m moe_gspo.plan CONFIG --gpus N --gpu-mem-gib G"

"""Per-rank GPU memory of every phase of an RL step, from a run config: the memory plan.

Counted, not measured: every figure is derived from the model's config and the run config with the
formulas of `params.py` (parameters), `activations.py` (activations) and the byte counts below; the
allowances (`Allowances`) stand in for what cannot be counted (CUDA context, NCCL, allocator
fragmentation, vLLM's own working memory).

**Learner state on one rank** (TP = PP = 1, world = EP x DP, expert-data-parallel size EDP = world / EP;
`local` = dense + experts / EP parameters; under the distributed optimizer this rank's optimizer shard
is `dense / DP + (experts / EP) / EDP`):
- parameters: `local x 2` (bf16) or `x 4` (fp32);
- gradient buffers (Megatron DDP): `local x 4` with `train.grad_reduce_in_fp32`, else the param dtype;
- optimizer state on the GPU, Adam (Megatron-core 0.16):
  - no distributed optimizer: fp32 main params + two moments for every local parameter,
    `local x 12` (bf16 params; `x 8` in fp32, no main copy);
  - distributed optimizer: the same per element, on the shard only: `shard x 12`;
  - precision-aware (TE FusedAdam): `shard x (2 + 2 m)` with the main params kept as 16-bit remainders
    next to the bf16 params (TE >= 2.1) and `m` = 4 or 2 bytes per moment (`train.optimizer_state_dtype`);
  - precision-aware + CPU offload (HybridDeviceOptimizer), fraction `f` on the host: `shard x (1-f) x 12`
    on the GPU, `shard x f x 16` in pinned host memory (fp32 main param, two moments, a grad copy);
- optimizer-step transient: an fp32 copy of the gradients the optimizer reads when the gradient buffer is
  bf16 and the optimizer is not precision-aware (`x 4` of the local params, or of the shard), plus, with
  torch's foreach AdamW (no Transformer Engine / Apex: `LearnerSetup.fused_adam` false), its fp32
  `_foreach_sqrt` temporary (`x 4` of the same; `transients.foreach_adam_bytes`).
**Reference policy** (`algo.kl_coef > 0`): an inference-only copy of the parameters sharded like the
policy, `local x param bytes`, no gradients or optimizer state.
**Rollout**: the engine's own terms (`moe_gspo.plan.engine_memory`, named by its
`moe_gspo.rollout.engine_spec.EngineSpec.memory`): vLLM's TP-sharded weights, KV-cache budget, runtime
allowance and sleep; the transformers engine's full copy of the weights per rank and the KV of all of
the rank's sequences while it generates.
**Offload during the rollout** (`train.offload_during_rollout`): `grads` frees the gradient buffers
except around the update (rollout, log-prob and weight-sync phases have none); `all` also moves the
parameters and the optimizer's GPU state (not precision-aware) to pinned host memory for the rollout.
**Weight sync**: streamed one bucket at a time (a decoder layer with all its experts gathered over EP,
or the embedding / LM head); the transient (`transients.sync_transient_bytes`) is the largest bucket's
allocations (q/k/v copies, gathered experts, the sender's staging copy of its own experts) plus vLLM's
layer-wise reload copy of one module. A sleeping engine wakes its weights only: its KV cache stays
asleep until it generates (`moe_gspo.rollout.vllm_engine`). The first sync, right after the engine
started asleep, is the same phase.
**Sample gather**: the rollout phase also holds `all_gather_object`'s CUDA buffers of the step's
samples (`transients.sample_gather_bytes`).
**Host memory per node** (`host_per_node_gib`, checked against `host_mem_gib` when given): per rank the
optimizer state offloaded to the host, a level-1 sleeping engine's weights, the learner offloaded during the
rollout (`all`) and the step's routes at their peak (`moe_gspo.plan.host_routes`: every rank holds the
global batch's rollout routes and the learner's recorded routes), times the ranks of a node; summed as if
they coexisted.

**Phases** (each = learner state + reference + the phase's own memory + runtime + fragmentation):
`engine_startup` (vLLM: its weights, KV cache and profiling next to the learner's rollout-phase memory),
`rollout` (engine awake, samples gathered), `logprobs` (old-policy / reference no-grad passes),
`update` (forward + backward of a micro-batch), `optimizer_step`, `weight_sync` (also the first sync),
`hf_export` (`train.export_hf`: the streamed export at the end of the run, engine closed). The peak
is the largest phase; the plan fits when the process layout works on the GPU count (`layout_problems`),
the peak is at most the GPU memory and vLLM can start. With an invalid layout the figures are counted
as configured (e.g. num_experts / EP experts per rank) and only say what that layout would need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_gspo.plan.activations import activation_estimate, MicroBatch
from moe_gspo.plan.engine_memory import GIB
from moe_gspo.plan.host_routes import route_host_bytes
from moe_gspo.plan.params import Geometry, megatron_counts, rollout_params_per_rank
from moe_gspo.rollout.engine_spec import engine_spec
from moe_gspo.plan.transients import (export_transient_bytes, foreach_adam_bytes, sample_gather_bytes,
                                      sample_payload_bytes, sync_transient_bytes)

JSONL_PROMPT_TOKENS = 1024  # assumed prompt length when a JSONL task gives no rollout.max_model_len
SYNTHETIC_PROMPT_EXTRA = 3  # marker and special tokens around a synthetic task's symbols


@dataclass(frozen=True, kw_only=True)
class Allowances:
    """What the plan cannot count, as explicit allowances (GiB per rank unless said otherwise)."""

    cuda_runtime_gib: float = 2.0
    """CUDA context, cuBLAS/cuDNN workspaces and NCCL communicators of one process."""
    fragmentation: float = 0.05
    """PyTorch caching-allocator fragmentation, as a fraction of what a phase allocates."""
    vllm_runtime_gib: float = 3.0
    """An awake vLLM engine besides weights and KV: profile-run activations, sampler, CUDA graphs."""
    vllm_asleep_gib: float = 0.5
    """What a sleeping vLLM engine keeps on the GPU."""
    moe_imbalance: float = 1.5
    """The busiest EP rank receives this multiple of its balanced share of (token, expert) pairs."""


@dataclass(frozen=True, kw_only=True)
class LearnerSetup:
    """The resolved learner options the plan counts with (GPU target)."""

    num_gpus: int
    ep: int
    param_bytes: int
    grad_bytes: int
    distributed_optimizer: bool
    precision_aware: bool
    cpu_offload: bool
    offload_fraction: float
    state_bytes: int
    recompute: bool
    attention: str
    dispatcher: str
    train_mb: MicroBatch
    infer_mb: MicroBatch
    reference: bool
    vocab_pad_multiple: int
    offload_during_rollout: str = "none"
    fused_adam: bool = True
    """The GPU Adam is TE's / Apex's FusedAdam (else torch's foreach AdamW and its temporary)."""
    export_hf: bool = False
    """`train.export_hf`: the run ends with the streamed HF export (phase `hf_export`)."""
    drift_passes: int = 0
    """Learner passes of the routing-drift probe on a probe step (`logging.update_drift_every`; host routes)."""
    replay: str = "none"
    """`algo.routing_replay` (host routes: R2 keeps its recorded routes, R3 may copy the rollout routes)."""
    entropy_grad: bool = False
    """The loss has the entropy bonus (`algo.entropy_coef > 0`): its gradient adds a chunk to the loss head."""

    @property
    def dp(self) -> int:
        return self.num_gpus

    @property
    def edp(self) -> int:
        return self.num_gpus // self.ep


@dataclass(frozen=True, kw_only=True)
class RolloutSetup:
    engine: str
    tp: int
    sleep_level: int
    kv_cache_gib: float | None
    gpu_memory_utilization: float
    dtype_bytes: int
    max_model_len: int
    seqs_per_rank: int
    """Sequences one rank's share of a step holds (transformers engine: all at once)."""
    seqs_per_engine: int = 0
    """Sequences one engine samples in a step (every rank of a TP engine sends them in the gather)."""
    record_routes: bool = False
    record_probs: bool = False
    """Router probabilities are returned (transformers engine with `rollout.record_probs`)."""
    seqs_per_step: int = 0
    """Sequences of the step's global batch, which every rank holds after the gather (0 = seqs_per_rank x GPUs)."""
    gen_rounds: int = 1
    """Generation rounds whose samples a step may hold at once (`algo.dynamic_sampling`'s bound, else 1)."""


@dataclass(kw_only=True)
class Phase:
    name: str
    parts_gib: dict[str, float]

    @property
    def total_gib(self) -> float:
        return sum(self.parts_gib.values())


@dataclass(kw_only=True)
class PlanResult:
    """A counted memory plan; `to_json()` gives the CLI's JSON."""

    fits: bool
    gpu_mem_gib: float
    num_gpus: int
    phases: list[Phase]
    components_gib: dict[str, float]
    problems: list[str]
    notes: list[str]
    assumptions: list[str]
    params: dict[str, float]
    host_per_node_gib: float
    knobs: list[str] = field(default_factory=list)
    host_routes: dict = field(default_factory=dict)
    """The routes' host memory (`moe_gspo.plan.host_routes`): per rank and per node at the peak moment, its
    parts, every moment, bytes per token; included in `host_per_node_gib`."""
    layout_problems: list[str] = field(default_factory=list)
    """The subset of `problems` that is the process layout (EP, rollout TP) not working on `num_gpus` GPUs:
    then the run cannot start at all, whatever the memory (see `layout_problems`)."""

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.total_gib)

    @property
    def per_rank_gib(self) -> float:
        return self.peak_phase.total_gib

    def to_json(self) -> dict:
        c = self.components_gib
        return {
            "fits": self.fits, "per_rank_gib": round(self.per_rank_gib, 3), "peak_phase": self.peak_phase.name,
            "gpu_mem_gib": self.gpu_mem_gib, "gpus": self.num_gpus,
            **{k: round(v, 3) for k, v in c.items()},
            "host_per_node_gib": round(self.host_per_node_gib, 3),
            "host_routes_per_node_gib": round(self.host_routes.get("per_node_gib", 0.0), 3),
            "host_routes": self.host_routes,
            "phases": {p.name: {**{k: round(v, 3) for k, v in p.parts_gib.items()}, "total": round(p.total_gib, 3)}
                       for p in self.phases},
            "params": self.params, "problems": self.problems, "layout_problems": self.layout_problems,
            "knobs": self.knobs, "notes": self.notes,
            "assumptions": self.assumptions, "status": "counted, not measured",
        }


def layout_problems(geom: Geometry, *, num_gpus: int, ep: int, engine: str = "vllm", tp: int = 1) -> list[str]:
    """Why the process layout cannot run on `num_gpus` GPUs; empty when it can.

    The learner's EP must divide the GPU count (world = EP x EDP) and the number of experts; a vLLM
    engine's TP must divide the GPU count (engines of TP consecutive ranks) and the query heads, and
    divide or be a multiple of the KV heads (vLLM replicates KV heads when TP exceeds them)."""
    out = []
    ep_fails = [w for w, bad in ((f"the {num_gpus} GPUs", ep < 1 or num_gpus % ep),
                                 (f"the {geom.num_experts} experts", ep < 1 or geom.num_experts % ep)) if bad]
    if ep_fails:
        out.append(f"parallel.expert_parallel_size={ep} does not divide {' nor '.join(ep_fails)} "
                   f"(it must divide the GPU count and the number of experts)")
    if engine_spec(engine).tensor_parallel:
        tp_fails = [w for w, bad in ((f"the {num_gpus} GPUs", tp < 1 or num_gpus % tp),
                                     (f"the {geom.num_heads} query heads", tp > 1 and geom.num_heads % tp))
                    if bad]
        if tp > 1 and geom.num_kv_heads % tp and tp % geom.num_kv_heads:
            tp_fails.append(f"the {geom.num_kv_heads} KV heads (nor is it a multiple of them)")
        if tp_fails:
            out.append(f"rollout.tensor_parallel_size={tp} does not divide {' nor '.join(tp_fails)} (it must divide "
                       f"the GPU count and the query heads, and divide or be a multiple of the KV heads)")
    return out


def _optimizer_bytes(s: LearnerSetup, local: float, shard: float) -> tuple[float, float, float]:
    """(optimizer state on the GPU, optimizer state on the host, optimizer-step GPU transient) in bytes."""
    bf16 = s.param_bytes == 2
    main = 4 if bf16 else 0
    grad_copy = 4 if s.grad_bytes == 2 else 0
    foreach = lambda n: foreach_adam_bytes(optimizer_params=n, fused_adam=s.fused_adam,  # noqa: E731
                                           precision_aware=s.precision_aware)
    if not s.distributed_optimizer:
        return local * (main + 8), 0.0, local * grad_copy + foreach(local)
    if not s.precision_aware:
        return shard * (main + 8), 0.0, shard * grad_copy + foreach(shard)
    if not s.cpu_offload:
        return shard * ((2 if bf16 else 0) + 2 * s.state_bytes), 0.0, 0.0
    f = s.offload_fraction
    return shard * (1 - f) * 12, shard * f * 16, shard * (1 - f) * grad_copy


def count_plan(geom: Geometry, learner: LearnerSetup, rollout: RolloutSetup, *, gpu_mem_gib: float,
               gpus_per_node: int = 8, host_mem_gib: float | None = None,
               allowances: Allowances = Allowances()) -> PlanResult:
    """The plan for a resolved setup (pure arithmetic; see the module docstring)."""
    s, r, al = learner, rollout, allowances
    problems: list[str] = []
    notes: list[str] = []
    counts = megatron_counts(geom, vocab_pad_multiple=s.vocab_pad_multiple)
    layout = layout_problems(geom, num_gpus=s.num_gpus, ep=s.ep, engine=r.engine, tp=r.tp)
    problems += layout
    local = counts.dense + counts.expert / s.ep
    shard = counts.dense / s.dp + counts.expert / s.ep / max(s.edp, 1)
    opt_gpu, opt_host, step_transient = _optimizer_bytes(s, local, shard)
    v_pad = int(math.ceil(geom.vocab_size / s.vocab_pad_multiple) * s.vocab_pad_multiple)
    act = activation_estimate(geom, s.train_mb, act_bytes=s.param_bytes, attention=s.attention,
                              recompute=s.recompute, vocab_padded=v_pad, ep_size=s.ep,
                              imbalance=al.moe_imbalance, dispatcher=s.dispatcher, infer_mb=s.infer_mb,
                              entropy_grad=s.entropy_grad)
    params_b, grads_b = local * s.param_bytes, local * s.grad_bytes
    ref_b = local * s.param_bytes if s.reference else 0.0

    # Rollout: the engine's own terms (moe_gspo.plan.engine_memory).
    spec = engine_spec(r.engine)
    engine_mem = spec.memory_terms()
    terms = engine_mem.terms(geom, r, allowances=al, total_params=counts.total, gpu_mem_gib=gpu_mem_gib,
                             gpus_per_node=gpus_per_node)
    problems += terms.problems
    notes += terms.notes
    weights, kv, rt = terms.weights, terms.kv, terms.runtime
    asleep, host_rollout = terms.resident, terms.host
    sync_t = sync_transient_bytes(geom, ep=s.ep, tp=r.tp, param_bytes=s.param_bytes, rollout_bytes=r.dtype_bytes,
                                  engine=r.engine)
    export_t = export_transient_bytes(geom, ep=s.ep, param_bytes=s.param_bytes) if s.export_hf else 0.0
    payload = sample_payload_bytes(geom, num_seqs=r.seqs_per_engine or r.seqs_per_rank, seq_len=r.max_model_len,
                                   record_routes=r.record_routes, record_probs=r.record_probs)
    gather_t = sample_gather_bytes(payload, world=s.num_gpus)

    state = {"learner_params": params_b, "learner_grads": grads_b, "optimizer_gpu": opt_gpu}
    if ref_b:
        state["reference"] = ref_b
    runtime = al.cuda_runtime_gib * GIB
    # train.offload_during_rollout: gradient buffers exist only around the update; "all" also moves the
    # parameters and (not precision-aware) the optimizer's GPU state to the host during the rollout.
    no_grads = ("learner_grads",) if s.offload_during_rollout in ("grads", "all") else ()
    moved = ("learner_params",) + (() if s.precision_aware else ("optimizer_gpu",))
    rollout_absent = no_grads + (moved if s.offload_during_rollout == "all" else ())
    host_learner = sum(state[k] for k in moved) if s.offload_during_rollout == "all" else 0.0

    def phase(name: str, extra: dict[str, float], absent: tuple[str, ...] = ()) -> Phase:
        parts = {**{k: v for k, v in state.items() if k not in absent}, **{k: v for k, v in extra.items() if v}}
        parts["fragmentation"] = al.fragmentation * sum(parts.values())
        parts["cuda_runtime"] = runtime
        return Phase(name=name, parts_gib={k: v / GIB for k, v in parts.items()})

    engine_awake = terms.awake
    phases = [phase("engine_startup", engine_awake, rollout_absent)] if terms.startup else []
    phases += [
        phase("rollout", {**engine_awake, "sample_gather": gather_t}, rollout_absent),
        phase("logprobs", {"activations": act.inference_peak_bytes, "rollout_resident": asleep}, no_grads),
        phase("update", {"activations": act.peak_bytes, "rollout_resident": asleep}),
        phase("optimizer_step", {"step_transient": step_transient, "rollout_resident": asleep}),
        phase("weight_sync", {"rollout_resident": terms.sync_resident, "sync_transient": sync_t}, no_grads),
    ]
    if s.export_hf:  # after the last update (gradients released when offloading them); vLLM closed
        phases.append(phase("hf_export", {"rollout_resident": terms.export_resident,
                                          "export_transient": export_t}, no_grads))
    if terms.startup:  # the engine starts next to the learner's rollout-phase memory (run.setup.build_policy)
        resident = sum(v for k, v in state.items() if k not in rollout_absent) + runtime
        problems += engine_mem.startup_problems(r, resident=resident, gpu_mem_gib=gpu_mem_gib)

    ranks_per_node = min(gpus_per_node, s.num_gpus)
    routes = route_host_bytes(
        geom, num_seqs=r.seqs_per_step or r.seqs_per_rank * s.num_gpus, seq_len=r.max_model_len,
        record_routes=r.record_routes, record_probs=r.record_probs, gen_rounds=r.gen_rounds,
        drift_passes=s.drift_passes, replay=s.replay, replay_mb_seqs=s.infer_mb.num_seqs,
        gather_bytes=3 * payload, gather_copies=r.tp if spec.tensor_parallel else 1)
    host_per_rank = opt_host + host_rollout + host_learner + routes.peak
    host_node = host_per_rank * ranks_per_node / GIB
    host_routes = {
        "per_rank_gib": routes.peak / GIB, "per_node_gib": routes.peak * ranks_per_node / GIB,
        "ranks_per_node": ranks_per_node, "peak_moment": routes.peak_moment, "tokens_per_step": routes.tokens,
        **{f"{k}_gib": routes.part(k) / GIB for k in ("rollout", "learner", "transient")},
        "moments_gib": {m: {k: round(v / GIB, 3) for k, v in parts.items()} for m, parts in routes.moments.items()},
        "peak_not_freed_per_rank_gib": routes.peak_not_freed / GIB, "bytes_per_token": routes.per_token}
    if host_mem_gib is not None and host_node > host_mem_gib:
        problems.append(f"host memory per node: {host_node:.0f} GiB needed (offloaded optimizer state, sleeping "
                        f"engines' weights, offloaded learner, the step's routes "
                        f"{host_routes['per_node_gib']:.0f} GiB) > {host_mem_gib:g} GiB")
    result = PlanResult(
        fits=False, gpu_mem_gib=gpu_mem_gib, num_gpus=s.num_gpus, phases=phases, problems=problems, notes=notes,
        assumptions=[], host_per_node_gib=host_node, layout_problems=layout, host_routes=host_routes,
        components_gib={
            "learner_params_gib": params_b / GIB, "learner_grads_gib": grads_b / GIB,
            "optimizer_gpu_gib": opt_gpu / GIB, "optimizer_host_gib": opt_host / GIB,
            "optimizer_step_transient_gib": step_transient / GIB,
            "activations_gib": act.peak_bytes / GIB, "logprob_activations_gib": act.inference_peak_bytes / GIB,
            "reference_gib": ref_b / GIB, "rollout_weights_gib": weights / GIB, "rollout_kv_gib": kv / GIB,
            "rollout_runtime_gib": rt / GIB, "weight_sync_transient_gib": sync_t / GIB,
            "export_transient_gib": export_t / GIB, "sample_gather_gib": gather_t / GIB,
            "cuda_runtime_gib": runtime / GIB, "host_routes_gib": routes.peak / GIB},
        params={"total": counts.total, "dense": counts.dense, "expert": counts.expert,
                "per_rank": counts.per_rank(s.ep), "optimizer_shard": shard if s.distributed_optimizer else local,
                "rollout_per_gpu": rollout_params_per_rank(geom, r.tp) if spec.tensor_parallel else counts.total})
    over = result.per_rank_gib - gpu_mem_gib
    if over > 0:
        problems.append(f"phase '{result.peak_phase.name}' needs {result.per_rank_gib:.1f} GiB per GPU, "
                        f"{over:.1f} GiB more than the {gpu_mem_gib:g} GiB available")
    result.fits = not problems
    return result

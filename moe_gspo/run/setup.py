"""Building a run: distributed grid, policy (Megatron learner + rollout engine), tokenizer, task.

The rollout engine is data-parallel: every rank owns an engine (a vLLM engine may span
`rollout.tensor_parallel_size` consecutive ranks) that samples for its own share of the prompts; after
each update it receives the learner's weights as a stream, one layer at a time (experts all-gathered
over EP per layer, `Learner.hf_weight_stream`).
"""

from __future__ import annotations

import dataclasses

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from moe_gspo.config import Config
from moe_gspo.mcore.parallel import ParallelInfo, init_distributed


@dataclass(kw_only=True)
class Policy:
    hf_config: Any
    tokenizer: Any
    learner: Any
    engine: Any
    num_experts: int
    layer_ids: list[int]


def quiet_known_warnings() -> None:
    """Silence third-party warnings that say nothing actionable here (Apex/TE absent, Megatron
    deprecations of options we do not set)."""
    import warnings

    for pattern in (r".*Apex is not installed.*", r".*Transformer Engine and Apex are not installed.*",
                    r".*full scope is deprecated.*", r".*TorchFP8Tensor.*"):
        warnings.filterwarnings("ignore", message=pattern)
    # Megatron-core 0.16 calls collectives that torch 2.13 marks deprecated.
    warnings.filterwarnings("ignore", message=r"`torch.distributed.\w+` is deprecated", category=FutureWarning)


def quiet_progress_bars(cfg: Config) -> None:
    """With logging.progress=false, no progress bar of transformers (its "Loading weights" bar when a
    checkpoint is read with `from_pretrained`) or of the Hugging Face hub either."""
    if not cfg.logging.progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any parts (same on every machine and Python run)."""
    h = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def learner_dtype(cfg: Config) -> torch.dtype:
    if cfg.model.params_dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, cfg.model.params_dtype)


def _hf_config_and_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    from moe_gspo.tokenizer import load_tiny_tokenizer
    from moe_gspo.tiny import tiny_qwen3_moe_config

    if cfg.model.path is None:
        hf_config = tiny_qwen3_moe_config(**cfg.model.tiny)
        tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer) if cfg.model.tokenizer else load_tiny_tokenizer()
    else:
        from moe_gspo.mcore.checkpoint import load_hf_config

        hf_config = load_hf_config(cfg.model.path)
        tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    check_tokenizer_fits(tok, hf_config, tokenizer_dir=cfg.model.tokenizer or cfg.model.path or "the shipped tiny tokenizer",
                         model=cfg.model.path or f"the tiny model (model.tiny={cfg.model.tiny})")
    return hf_config, tok


def check_tokenizer_fits(tok, hf_config, *, tokenizer_dir: str, model: str) -> None:
    """A ValueError naming both when the tokenizer has ids the model's embedding cannot hold."""
    num_tokens = len(tok)
    if num_tokens > hf_config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_dir!r} has {num_tokens} tokens but model {model!r} has vocab_size="
            f"{hf_config.vocab_size}: its ids would index past the embedding. Use the model's own tokenizer "
            f"(model.tokenizer=null) or a model trained with this tokenizer")


def check_prompts_fit(cfg: Config, task, eval_prompts=()) -> None:
    """Start-up check, before anything is written: every prompt of `task` (and of the eval set) plus
    rollout.max_new_tokens fits the rollout engine's context (`moe_gspo.tasks.lengths`), encoded as the
    rollout encodes them (task.chat_template); prompts with text the tokenizer maps to its unknown token
    get one warning naming them (rank 0). Reads only config and tokenizer files."""
    import os

    from moe_gspo.run.errors import warn_once
    from moe_gspo.tasks.encoding import check_chat_template, empty_prompt_report, encode_prompts, unknown_token_report
    from moe_gspo.tasks.lengths import check_prompt_lengths

    hf_config, tok = _hf_config_and_tokenizer(cfg)
    t = cfg.task
    check_chat_template(tok, t.chat_template, tokenizer_name=repr(cfg.model.tokenizer or cfg.model.path or "shipped"))
    enc = dict(chat_template=t.chat_template, system_prompt=t.system_prompt)
    prompts = list(task.longest_prompts())
    check_prompt_lengths(prompts, tok, hf_config, cfg.rollout, **enc)
    if eval_prompts:
        room = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        check_prompt_lengths(eval_prompts, tok, hf_config, dataclasses.replace(cfg.rollout, max_new_tokens=room),
                             max_new_tokens_flag="eval.max_new_tokens" if cfg.eval.max_new_tokens else
                             "rollout.max_new_tokens", **enc)
    if cfg.task.name == "jsonl" or eval_prompts:  # synthetic prompts use the tokenizer's own symbols
        everything = prompts + list(eval_prompts)
        if (empty := empty_prompt_report(everything)) is not None:
            warn_once(empty, is_main=int(os.environ.get("RANK", "0")) == 0)
        report = unknown_token_report(tok, everything, encode_prompts(tok, [p.text for p in everything], **enc))
        if report:
            warn_once(report, is_main=int(os.environ.get("RANK", "0")) == 0)


def init_run(cfg: Config) -> ParallelInfo:
    from moe_gspo.rollout.engine_spec import engine_spec
    from moe_gspo.tiny import tiny_qwen3_moe_config

    if cfg.model.path is None:
        hf_config, model = tiny_qwen3_moe_config(**cfg.model.tiny), f"the tiny model (model.tiny={cfg.model.tiny})"
    else:
        from moe_gspo.mcore.checkpoint import load_hf_config

        hf_config = load_hf_config(cfg.model.path)  # config only; weights load later
        model = f"model.path={cfg.model.path}"
    engine_spec(cfg.rollout.engine).check_machine(cfg.rollout, hf_config, model=model)  # before any compute: this machine's vLLM, CPU limits
    quiet_progress_bars(cfg)
    num_experts = hf_config.num_experts
    info = init_distributed(ep_size=cfg.parallel.expert_parallel_size, num_experts=num_experts,
                            seed=cfg.train.seed, timeout_s=cfg.parallel.collective_timeout_s)
    groups = cfg.rollout.prompts_per_step
    if groups % info.dp_size:
        raise ValueError(
            f"rollout.prompts_per_step={groups} must be divisible by the data-parallel size {info.dp_size} "
            f"(world size {info.world_size}); each rank samples whole groups"
        )
    return info


def build_engine(cfg: Config, hf_model_or_dir, tokenizer, *, load_weights: bool = True):
    """The rollout engine of `cfg.rollout` on a checkpoint directory or an in-memory HF model, as its
    spec builds it (`moe_gspo.rollout.engine_spec.EngineSpec.build`; vLLM: a directory is loaded by
    vLLM itself unless `load_weights=False`, `moe_gspo.rollout.engine_factories`)."""
    from moe_gspo.rollout.engine_spec import engine_spec

    return engine_spec(cfg.rollout.engine).build(cfg, hf_model_or_dir, tokenizer, load_weights=load_weights)


def megatron_router_overrides(cfg: Config) -> dict:
    """`build_gpt_model` overrides of the router-policy fields (model.router_dtype, algo.router_aux_loss,
    algo.router_aux_loss_coef; `moe_gspo.mcore.model.router_policy_overrides`): empty for the defaults."""
    from moe_gspo.mcore.model import router_policy_overrides

    return router_policy_overrides(router_dtype=cfg.model.router_dtype, aux_loss=cfg.algo.router_aux_loss,
                                   aux_loss_coef=cfg.algo.router_aux_loss_coef)


def build_policy(cfg: Config, info: ParallelInfo) -> Policy:
    from moe_gspo.learner.learner import Learner
    from moe_gspo.mcore.model import build_gpt_model, moe_layer_ids

    hf_config, tok = _hf_config_and_tokenizer(cfg)
    model = build_gpt_model(
        hf_config, ep_size=info.ep_size, params_dtype=learner_dtype(cfg), enable_routing_replay=True,
        token_dispatcher=cfg.parallel.token_dispatcher, vocab_pad_multiple=cfg.model.vocab_pad_multiple,
        recompute=cfg.model.recompute, batched_experts=cfg.model.batched_experts, expert_layout=cfg.model.expert_layout,
        sdpa_attention=cfg.model.sdpa_attention, fused_rope=cfg.model.fused_rope, **megatron_router_overrides(cfg),
    )
    if cfg.model.path is None:
        from moe_gspo.mcore.weights import load_hf_model_into_megatron
        from moe_gspo.tiny import build_tiny_model

        hf_model = build_tiny_model(hf_config, seed=cfg.model.init_seed, router_scale=cfg.model.router_scale)
        load_hf_model_into_megatron(model, hf_model)
        engine_src = hf_model
    else:
        from moe_gspo.mcore.checkpoint import read_hf_weights
        from moe_gspo.mcore.weights import load_into_megatron

        sd = read_hf_weights(cfg.model.path, hf_config, ep_rank=info.ep_rank, ep_size=info.ep_size)
        load_into_megatron(model, sd, ep_rank=info.ep_rank, ep_size=info.ep_size)
        engine_src = cfg.model.path
    if cfg.model.freeze_router:  # before the learner wraps it in DDP and builds the optimizer
        from moe_gspo.mcore.model import freeze_routers

        freeze_routers(model)
    learner = Learner(model, hf_config, parallel=info, algo=cfg.algo, train=cfg.train,  # replay: algo.routing_replay
                      recompute=cfg.model.recompute)
    # vLLM starts next to the learner's rollout-phase memory (train.offload_during_rollout), and asleep
    # with rollout.sleep_level > 0 (see moe_gspo.plan, phase engine_startup)
    learner.offload_for_rollout()
    engine = build_engine(cfg, engine_src, tok, load_weights=False)  # moe_gspo.train syncs before step 0
    learner.reload_after_rollout()
    return Policy(hf_config=hf_config, tokenizer=tok, learner=learner, engine=engine,
                  num_experts=hf_config.num_experts, layer_ids=moe_layer_ids(hf_config))

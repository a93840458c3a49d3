"""Qwen3-MoE as a Megatron-core `GPTModel`: config mapping, layer spec, construction and forward.

Mapping from a transformers `Qwen3MoeConfig` (see shared/README.md for the geometry facts):
- attention: GQA (`num_query_groups = num_key_value_heads`), `kv_channels = head_dim`, per-head QK RMSNorm
  (`qk_layernorm`), RoPE with `rotary_base = rope_theta`, no biases;
- norms: RMSNorm with `layernorm_epsilon = rms_norm_eps`;
- MLPs: SwiGLU (`gated_linear_unit`, silu); dense layers use `intermediate_size`, experts
  `moe_intermediate_size`; a layer is MoE exactly when transformers makes it one
  (`layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0`), given to
  Megatron as the `moe_layer_freq` pattern;
- router: softmax score function, no load-balancing loss, no expert bias, fp32 router;
  `norm_topk_prob=True` → top-k over logits then softmax over the k chosen (Megatron's default,
  identical to softmax → top-k → renormalise); `norm_topk_prob=False` → `moe_router_pre_softmax`
  (softmax over all experts, then top-k, not renormalised);
- embeddings tied or untied as in the config; the vocabulary may be padded to a multiple
  (`vocab_pad_multiple`) and the logits are sliced back to the true vocabulary.

Local (Megatron-only) layer spec without Transformer Engine; TE spec when TE is importable.
TP = PP = 1; expert parallelism over the experts (see `moe_gspo.mcore.parallel`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F

UNSUPPORTED_NONDEFAULT = {
    # field: value that we support (anything else is rejected with a clear message)
    "attention_bias": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
}


def moe_layer_pattern(hf_config) -> list[int]:
    """1 for each decoder layer that is MoE in transformers' Qwen3-MoE, else 0."""
    mlp_only = set(hf_config.mlp_only_layers or [])
    step = hf_config.decoder_sparse_step
    return [
        int(i not in mlp_only and hf_config.num_experts > 0 and (i + 1) % step == 0)
        for i in range(hf_config.num_hidden_layers)
    ]


def rope_theta(hf_config) -> float:
    rp = getattr(hf_config, "rope_parameters", None) or {}
    if rp.get("rope_type", "default") not in ("default", None):
        raise ValueError(
            f"model.rope_parameters.rope_type={rp.get('rope_type')!r} is not supported by the Megatron "
            f"mapping (only 'default' RoPE); remove rope scaling from the checkpoint config"
        )
    theta = rp.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("model config has no rope_theta (rope_parameters.rope_theta); add it to config.json")
    return float(theta)


def check_supported(hf_config) -> None:
    """Raise one ValueError listing every config value the mapping does not support."""
    problems = []
    if getattr(hf_config, "model_type", None) != "qwen3_moe":
        problems.append(
            f"model_type={getattr(hf_config, 'model_type', None)!r} (expected 'qwen3_moe': moe-gspo trains "
            f"Qwen3-MoE checkpoints; a dense model has no routing to study)"
        )
    elif not getattr(hf_config, "num_experts", 0) or not any(moe_layer_pattern(hf_config)):
        problems.append("num_experts=0 or no MoE layer (mlp_only_layers covers every layer): a dense model")
    for key, ok in UNSUPPORTED_NONDEFAULT.items():
        val = getattr(hf_config, key, ok)
        if val != ok:
            problems.append(f"{key}={val!r} (supported: {ok!r})")
    if getattr(hf_config, "model_type", None) == "qwen3_moe" and not problems:
        rope_theta(hf_config)
        if hf_config.num_experts_per_tok > hf_config.num_experts:
            problems.append(
                f"num_experts_per_tok={hf_config.num_experts_per_tok} > num_experts={hf_config.num_experts}"
            )
    if problems:
        raise ValueError("unsupported model config: " + "; ".join(problems))


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    if multiple < 1:
        raise ValueError(f"model.vocab_pad_multiple must be >= 1, got {multiple}")
    return int(math.ceil(vocab_size / multiple) * multiple)


TE_PERMUTE_FUSION_MIN = (2, 1)
"""Transformer Engine version from which Megatron-core 0.16's fused token permutation exists
(`moe_permute_fusion`; `TransformerConfig.__post_init__` refuses it below: "Please install TE >= 2.1.0")."""
TE_ROUTER_FUSION_MIN = (2, 7)
"""Transformer Engine version from which Megatron-core 0.16 documents the fused top-k routing
(`moe_router_fusion`: "only supported in TransformerEngine 2.7.0 and above"; its kernels' own error
says 2.6.0, the documented bound is taken)."""


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    import re

    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


def te_version() -> str | None:
    """The importable Transformer Engine's version (`moe_gspo.mcore.shims.have_transformer_engine`), or None."""
    from moe_gspo.mcore.shims import have_transformer_engine

    if not have_transformer_engine():
        return None
    import transformer_engine

    version = getattr(transformer_engine, "__version__", None)
    if version is None:
        from importlib import metadata

        for dist in ("transformer-engine", "transformer_engine"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    return version


def te_fusion_flags(te_version_str: str | None, *, cuda: bool, routing_replay: bool) -> dict[str, bool]:
    """Megatron's MoE fusions this machine can take (issue 40): `moe_permute_fusion` with Transformer
    Engine >= 2.1 on CUDA; `moe_router_fusion` with TE >= 2.7 on CUDA and only without routing replay,
    because Megatron-core 0.16's fused top-k (`topk_routing_with_score_function(fused=True)`) returns
    before it consults the `RouterReplay` (R2/R3 would be ignored silently), and every training run's
    learner is built with replay enabled. Without TE (or CUDA) both stay off."""
    v = _version_tuple(te_version_str)
    if v is None or not cuda:
        return {"moe_permute_fusion": False, "moe_router_fusion": False}
    return {"moe_permute_fusion": v >= TE_PERMUTE_FUSION_MIN,
            "moe_router_fusion": v >= TE_ROUTER_FUSION_MIN and not routing_replay}


def transformer_config_from_hf(
    hf_config,
    *,
    ep_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    enable_routing_replay: bool = False,
    token_dispatcher: str = "allgather",
    recompute: bool = False,
    **overrides: Any,
):
    """Megatron `TransformerConfig` equivalent to a transformers `Qwen3MoeConfig`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(hf_config)
    if token_dispatcher not in ("allgather", "alltoall"):
        raise ValueError(
            f"parallel.token_dispatcher={token_dispatcher!r}: use 'allgather' (CPU and GPU) or 'alltoall' (GPU)"
        )
    if token_dispatcher == "alltoall" and not torch.cuda.is_available():
        raise ValueError("parallel.token_dispatcher='alltoall' needs CUDA; use 'allgather' on CPU")
    on_cuda = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_cuda,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep_size,
        num_moe_experts=hf_config.num_experts,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_token_dispatcher_type=token_dispatcher,
        moe_grouped_gemm=False,
        moe_enable_routing_replay=enable_routing_replay,
    )
    # with Transformer Engine on CUDA, Megatron's fused permutation (and router, without replay) kernels
    kw.update(te_fusion_flags(te_version(), cuda=on_cuda, routing_replay=enable_routing_replay))
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt_model(
    hf_config,
    *,
    ep_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    enable_routing_replay: bool = False,
    token_dispatcher: str = "allgather",
    vocab_pad_multiple: int = 1,
    recompute: bool = False,
    batched_experts: bool = False,
    expert_layout: str = "per_expert",
    sdpa_attention: bool = True,
    fused_rope: bool = True,
    device: torch.device | str | None = None,
    **config_overrides: Any,
):
    """Build the Megatron `GPTModel` for `hf_config` (random init; load weights with `moe_gspo.mcore.weights`).

    `batched_experts`: the MoE layers' local experts as `moe_gspo.mcore.batched_experts.BatchedSequentialMLP`
    (same parameters; local spec only). `expert_layout` (`model.expert_layout`): `per_expert` (Megatron's
    `SequentialMLP`, or `BatchedSequentialMLP` with `batched_experts`), `grouped` (one parameter per
    projection: `moe_gspo.mcore.grouped_experts.GroupedExperts`, Megatron's legacy `GroupedMLP`; with
    Transformer Engine its `TEGroupedMLP`; `batched_experts` is then ignored) or `auto`
    (`grouped_experts.resolve_expert_layout`). `sdpa_attention`: core attention as one fused
    `scaled_dot_product_attention` call (`moe_gspo.mcore.sdpa_attention`) where the spec has upstream's
    local `DotProductAttention` (no Transformer Engine); no parameters, same maths up to rounding.
    `fused_rope`: Megatron's `apply_rope_fusion` (TE's fused RoPE kernel, or without TE
    `moe_gspo.mcore.fused_rope`: one autograd function, bit-identical to the unfused RoPE). `model.expert_path`
    says how the experts run and why (`moe_gspo.mcore.grouped_experts.expert_path`).

    Requires `moe_gspo.mcore.parallel.init_distributed` to have run in this process. The model's
    `vocab_size` attribute is the padded size; `model.hf_vocab_size` the true one.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moe_gspo.mcore.shims import apply_shims, clear_global_router_replay, have_transformer_engine

    from moe_gspo.mcore.grouped_experts import expert_path

    apply_shims()
    use_te = have_transformer_engine()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    path = expert_path(expert_layout, device=device, params_dtype=params_dtype, batched_experts=batched_experts,
                       use_te=use_te, hidden=hf_config.hidden_size, ffn=hf_config.moe_intermediate_size,
                       num_local_experts=max(1, (getattr(hf_config, "num_experts", 0) or 0) // ep_size))
    grouped = path["layout"] == "grouped"
    # With TE, its grouped GEMM over the local experts (TEGroupedMLP; `weights` maps its names); without,
    # the local SequentialMLP (`batched_experts`: ours, one grouped GEMM per projection), or with the grouped
    # layout Megatron's legacy GroupedMLP on `torch._grouped_mm` (`moe_gspo.mcore.grouped_experts`).
    if grouped and not use_te:
        from moe_gspo.mcore.shims import install_grouped_gemm

        install_grouped_gemm()
        batched_experts = False
    config_overrides.setdefault("moe_grouped_gemm", use_te or grouped)
    if fused_rope and "apply_rope_fusion" not in config_overrides:
        from moe_gspo.mcore.shims import install_torch_fused_rope

        config_overrides["apply_rope_fusion"] = install_torch_fused_rope()
    config = transformer_config_from_hf(
        hf_config, ep_size=ep_size, params_dtype=params_dtype,
        enable_routing_replay=enable_routing_replay, token_dispatcher=token_dispatcher,
        recompute=recompute, **config_overrides,
    )
    with warnings.catch_warnings():  # the local spec's "legacy GroupedMLP will be deprecated": we replace it
        warnings.filterwarnings("ignore", message=".*legacy GroupedMLP.*")
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    if grouped and not use_te and config.num_moe_experts:
        from moe_gspo.mcore.grouped_experts import with_grouped_experts

        spec, found = with_grouped_experts(spec)
        assert found, "moe_grouped_gemm on the local spec builds no GroupedMLP"
    if batched_experts and config.num_moe_experts:
        from moe_gspo.mcore.batched_experts import with_batched_experts

        spec, found = with_batched_experts(spec)
        if not found:
            raise ValueError("model.batched_experts=true needs the local (SequentialMLP) expert spec; with "
                             "Transformer Engine importable the experts are TE's grouped GEMM already: set it false")
    # Every attention layer takes "no mask" as plain causal (TE's, or ours with SDPA): the learner then passes
    # no mask and attention may use a flash kernel (`forward_logits`); upstream's local attention builds its
    # default mask on "cuda", so it keeps the explicit one.
    implicit_causal_mask = use_te
    if sdpa_attention:
        from moe_gspo.mcore.sdpa_attention import with_sdpa_attention

        spec, found = with_sdpa_attention(spec)  # no-op with Transformer Engine's attention
        implicit_causal_mask = implicit_causal_mask or found == len(spec.layer_specs)
    # Upstream keeps RouterReplay instances in a class-level list; a rebuilt model must start empty.
    clear_global_router_replay()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, vocab_pad_multiple),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf_config),
    )
    model.hf_vocab_size = hf_config.vocab_size
    model.implicit_causal_mask = implicit_causal_mask
    model.hf_config = hf_config
    model.expert_path = path  # how the experts run, and why (`grouped_experts.expert_path`): one line per run
    model = model.to(device)
    if batched_experts:  # moving devices gave every parameter its own storage: lay the experts' out again
        from moe_gspo.mcore.batched_experts import stack_expert_weights_

        stack_expert_weights_(model)
    return model


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """Megatron's explicit attention mask: bool [1, 1, S, S], True = masked (future positions)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, input_ids_BS: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V_true] for right-padded (or unpadded) sequences starting at position 0.

    Right padding needs no attention mask beyond the causal one: real tokens never attend to the
    padding that follows them. A model built with `implicit_causal_mask` (its attention layers take no
    mask as plain causal: Transformer Engine's, or `moe_gspo.mcore.sdpa_attention` with `is_causal`, a
    flash kernel on CUDA) gets no mask; others get the explicit `causal_mask`.
    """
    B, S = input_ids_BS.shape
    position_ids = torch.arange(S, device=input_ids_BS.device).unsqueeze(0).expand(B, S)
    implicit = getattr(unwrap(model), "implicit_causal_mask", False)
    logits = model(input_ids=input_ids_BS, position_ids=position_ids,
                   attention_mask=None if implicit else causal_mask(S, input_ids_BS.device))
    true_vocab = getattr(model, "hf_vocab_size", logits.shape[-1])
    return logits[..., :true_vocab]


def unwrap(model):
    """The bare GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def moe_routers(model) -> list:
    """The TopKRouter modules of every MoE layer, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def router_policy_overrides(*, router_dtype: str | None = None, aux_loss: str = "none",
                            aux_loss_coef: float = 0.0) -> dict[str, Any]:
    """`TransformerConfig` overrides of the router-policy axes (`model.router_dtype`, `algo.router_aux_loss`,
    `algo.router_aux_loss_coef`; docs/algorithms.md "Router policy during RL"), for `build_gpt_model(**...)`:
    empty for the defaults, which keep the mapping's fp32 router without load-balancing loss."""
    if aux_loss not in ("none", "aux_loss", "seq_aux_loss"):
        raise ValueError(f"router aux loss {aux_loss!r}: use none, aux_loss or seq_aux_loss")
    if (aux_loss == "none") != (aux_loss_coef == 0):
        raise ValueError(f"router aux loss {aux_loss!r} with coefficient {aux_loss_coef}: a loss needs a "
                         "coefficient > 0, none needs 0")
    kw: dict[str, Any] = {}
    if router_dtype is not None:
        if router_dtype not in ("fp32", "fp64"):
            raise ValueError(f"router_dtype={router_dtype!r}: use fp32, fp64 or None")
        kw["moe_router_dtype"] = router_dtype
    if aux_loss != "none":
        kw.update(moe_router_load_balancing_type=aux_loss, moe_aux_loss_coeff=float(aux_loss_coef))
    return kw


def freeze_routers(model) -> int:
    """Set requires_grad=False on every MoE router's parameters (`model.freeze_router`), before the model is
    wrapped in DDP: Megatron's DDP and the optimizers take trainable parameters only, so the routers never
    change. Returns the number of parameters frozen."""
    frozen = 0
    for router in moe_routers(model):
        for p in router.parameters():
            p.requires_grad_(False)
            frozen += 1
    if not frozen:
        raise ValueError("freeze_routers: the model has no MoE router parameters")
    return frozen


def moe_layer_ids(hf_config) -> list[int]:
    """Model-layer indices (0-based) of the MoE layers."""
    return [i for i, is_moe in enumerate(moe_layer_pattern(hf_config)) if is_moe]


class TrainModeSwitch:
    """`module.train(mode)` of a module tree without the recursion: each module's `training` flag set from a
    list of the tree's modules made once. `nn.Module.train` walks `children()` and goes through
    `nn.Module.__setattr__` for every module (~2 ms for the tiny model's ~110 modules on a CPU), and the learner
    switches 2-4 times per RL step (the no-grad passes in eval mode, the update in train mode). The result is
    the same flags: `nn.Module.train` sets `training` on every module reachable through `children()`, which
    `modules()` lists. A tree where some class overrides `train` switches with `module.train(mode)` instead.
    The list is taken when built: build it after the model (its wrappers included) is complete."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.modules = list(module.modules())
        self.plain = all(type(m).train is torch.nn.Module.train for m in self.modules)

    def __call__(self, mode: bool = True) -> None:
        if not self.plain:
            self.module.train(mode)
            return
        for m in self.modules:
            m.__dict__["training"] = mode

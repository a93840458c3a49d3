"""Megatron-core learner backend for Qwen3-MoE (the model, its weights and its process grid).

Supported scope:
- parallelism: tensor parallel = pipeline parallel = 1; expert parallelism (EP) carved out of data
  parallelism, world size = EP x DP (`parallel.init_distributed`); every rank holds all dense weights
  and `num_experts / EP` experts (global expert id = ep_rank * E_local + local index);
- layer spec: Megatron's local spec on CPU (gloo, `moe_token_dispatcher_type="allgather"`, the shims
  of `shims.py`), the Transformer Engine spec when TE is importable (its fused norm weights,
  `linear_qkv.layer_norm_weight` / dense `linear_fc1.layer_norm_weight`, are handled by `weights`);
- experts: Megatron's `SequentialMLP` loop, or with `model.batched_experts` one grouped GEMM per projection
  over the local experts (`batched_experts`; `torch._grouped_mm` on the CPU and on sm90/sm100 GPUs in bf16), or
  with `model.expert_layout=grouped` one parameter per projection (`grouped_experts`: Megatron's legacy
  `GroupedMLP` on `torch._grouped_mm`, copy-free under the distributed optimizer), or with TE its
  `TEGroupedMLP` (`moe_grouped_gemm`); SwiGLU, no shared experts, no load-balancing loss;
- models: transformers `Qwen3MoeForCausalLM` configs (`model.check_supported` says why others fail),
  tied or untied embeddings, optional vocabulary padding.

Modules: `shims` (CPU / no-TE compatibility), `parallel` (process grid), `model` (config mapping,
`GPTModel` construction, forward), `weights` (HF <-> Megatron tensors, full gather for export),
`weight_stream` (the per-layer HF-named weight stream for the rollout engines' sync),
`checkpoint` (safetensors directories in and out). Nothing here is imported eagerly, so
`import moe_gspo.mcore` does not import Megatron; it only runs `shims.hide_unimportable_transformer_engine`
(which tries `import transformer_engine` when TE is installed).
"""

from moe_gspo.mcore.shims import hide_unimportable_transformer_engine as _hide_te

_hide_te()  # before any Megatron import: an installed TE that fails to import counts as absent (shims.py)

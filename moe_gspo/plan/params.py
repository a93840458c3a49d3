"""Parameter counts of a Qwen3-MoE model from its Hugging Face config, in the layouts that hold them.

Pure arithmetic over the config (no torch, no model built). Two layouts (the weight sync's buckets
are counted in `transients.py`):

- **Megatron learner** (`megatron_counts`): what `moe_gspo.mcore.model.build_gpt_model` builds, per
  tensor: embedding `V_pad x H` (vocabulary padded to `model.vocab_pad_multiple`), output layer
  `V_pad x H` unless embeddings are tied, final norm `H`; per decoder layer the two RMSNorms (`2H`),
  fused QKV `(a + 2g) d x H`, output projection `H x a d`, per-head QK norms `2d`; a dense layer's
  SwiGLU MLP `3 I_dense H`; a MoE layer's router `E x H` plus `E` experts of `3 I_moe H` each.
  "Dense" below means everything that is not an expert (routers included): it is replicated on every
  rank (TP = PP = 1) and all-reduced over data parallelism; experts are split over expert parallelism.
- **vLLM rollout at tensor parallelism `tp`** (`rollout_params_per_rank`): vLLM's Qwen3-MoE shards the
  vocabulary (embedding and LM head, padded to a multiple of 64), query heads, KV heads (replicated when
  `tp > g`: each rank then holds one KV head), the output projection, dense MLPs and every expert's
  intermediate dimension (or whole experts with expert parallelism: the same bytes) by `tp`; norms,
  QK norms and routers are replicated.

KV cache per token (`kv_bytes_per_token`): `2 (K and V) x layers x kv_heads_per_rank x d x bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """The shape facts of a Qwen3-MoE model that memory depends on."""

    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    """Dense-layer MLP width (`intermediate_size`)."""
    moe_intermediate: int
    num_experts: int
    top_k: int
    moe_layers: tuple[bool, ...]
    tie_embeddings: bool

    @classmethod
    def from_hf(cls, hf_config) -> "Geometry":
        """From a transformers `Qwen3MoeConfig` (or anything with the same attribute names)."""
        mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        layers = int(hf_config.num_hidden_layers)
        heads = int(hf_config.num_attention_heads)
        return cls(
            vocab_size=int(hf_config.vocab_size), hidden=int(hf_config.hidden_size), num_layers=layers,
            num_heads=heads, num_kv_heads=int(hf_config.num_key_value_heads),
            head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
            intermediate=int(hf_config.intermediate_size), moe_intermediate=int(hf_config.moe_intermediate_size),
            num_experts=num_experts, top_k=int(hf_config.num_experts_per_tok),
            moe_layers=tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(layers)),
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


@dataclass(frozen=True, kw_only=True)
class MegatronCounts:
    """Parameter counts of the Megatron learner model (whole model, all experts)."""

    embedding: int
    output_layer: int
    final_norm: int
    attention_per_layer: int
    """Fused QKV + output projection + QK norms + the layer's two RMSNorms."""
    dense_mlp_per_layer: int
    router_per_moe_layer: int
    one_expert: int
    geometry: Geometry

    @property
    def dense(self) -> int:
        """Everything but the experts (routers included)."""
        g = self.geometry
        num_dense_layers = g.num_layers - g.num_moe_layers
        return (self.embedding + self.output_layer + self.final_norm + g.num_layers * self.attention_per_layer
                + num_dense_layers * self.dense_mlp_per_layer + g.num_moe_layers * self.router_per_moe_layer)

    @property
    def expert(self) -> int:
        return self.geometry.num_moe_layers * self.geometry.num_experts * self.one_expert

    @property
    def total(self) -> int:
        return self.dense + self.expert

    def per_rank(self, ep_size: int) -> int:
        """Parameters one learner rank holds at expert parallelism `ep_size`."""
        return self.dense + self.expert // ep_size

    def active_per_token(self) -> int:
        g = self.geometry
        return self.dense + g.num_moe_layers * g.top_k * self.one_expert


def megatron_counts(geom: Geometry, *, vocab_pad_multiple: int = 1) -> MegatronCounts:
    g = geom
    v_pad = int(math.ceil(g.vocab_size / vocab_pad_multiple) * vocab_pad_multiple)
    attn = ((g.num_heads + 2 * g.num_kv_heads) * g.head_dim * g.hidden + g.hidden * g.num_heads * g.head_dim
            + 2 * g.head_dim + 2 * g.hidden)
    return MegatronCounts(
        embedding=v_pad * g.hidden, output_layer=0 if g.tie_embeddings else v_pad * g.hidden, final_norm=g.hidden,
        attention_per_layer=attn, dense_mlp_per_layer=3 * g.intermediate * g.hidden,
        router_per_moe_layer=g.num_experts * g.hidden, one_expert=3 * g.moe_intermediate * g.hidden, geometry=g)


def kv_heads_per_rank(geom: Geometry, tp: int) -> int:
    """KV heads one vLLM rank holds at tensor parallelism `tp` (replicated once `tp > g`)."""
    return max(1, geom.num_kv_heads // tp)


def rollout_params_per_rank(geom: Geometry, tp: int) -> int:
    """Parameters one GPU of a vLLM engine holds at tensor parallelism `tp` (see the module docstring)."""
    g = geom
    v_rank = math.ceil(math.ceil(g.vocab_size / 64) * 64 / tp)  # vLLM pads the vocabulary to a multiple of 64
    heads = max(1, g.num_heads // tp)
    kv = kv_heads_per_rank(g, tp)
    embed = v_rank * g.hidden * (1 if g.tie_embeddings else 2)
    per_layer = ((heads + 2 * kv) * g.head_dim * g.hidden + heads * g.head_dim * g.hidden
                 + 2 * g.head_dim + 2 * g.hidden)
    moe = g.num_experts * g.hidden + g.num_experts * 3 * math.ceil(g.moe_intermediate / tp) * g.hidden
    dense = 3 * math.ceil(g.intermediate / tp) * g.hidden
    return (embed + g.hidden + g.num_layers * per_layer + g.num_moe_layers * moe
            + (g.num_layers - g.num_moe_layers) * dense)


def kv_bytes_per_token(geom: Geometry, *, tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes per token on one vLLM rank (all layers)."""
    return 2 * geom.num_layers * kv_heads_per_rank(geom, tp) * geom.head_dim * dtype_bytes

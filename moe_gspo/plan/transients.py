"""Short-lived GPU allocations of an RL step that the memory plan adds to a phase (pure arithmetic).

Each function returns bytes on one rank; where they come from (read in the code that allocates them):

- **Optimizer step, torch's Adam** (`foreach_adam_bytes`): without Transformer Engine or Apex,
  Megatron-core 0.16 steps its main params with `torch.optim.AdamW`, whose default `foreach`
  implementation (on CUDA) allocates `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`: one fp32
  temporary the size of the optimizer's parameters (4 B per parameter of the shard, or of the local
  parameters without the distributed optimizer). TE's / Apex's FusedAdam (and the precision-aware
  optimizer, which needs TE) update in one kernel without it.
- **Weight sync** (`sync_transient_bytes`): the learner streams one bucket at a time
  (`moe_gspo.mcore.weight_stream.HFWeightStream`): a MoE layer allocates its q/k/v copies, the gathered
  experts of all ranks `E x 3 I H`, and, while gathering, its own experts' staging copy `E / EP x 3 I H`
  (no expert copy at all at EP=1, where the per-expert tensors are views). vLLM's layer-wise reload
  (`vllm/model_executor/model_loader/reload/layerwise.py`, 0.33) buffers the incoming tensors of a module
  until all have arrived, then materializes a fresh copy of that module's parameters at the engine's
  TP (`materialize_layer`), loads it and copies it into the old storage: the largest module is a MoE
  layer's experts `E x 3 ceil(I / TP) H`, or the (vocabulary-sharded) embedding / LM head. When the
  learner's and the engine's dtypes differ, the cast copies of a module's incoming tensors are what vLLM
  buffers (`x` the rollout dtype instead of views). The transformers engine copies in place: the
  stream's allocations only.
- **HF export** (`export_transient_bytes`): the same stream, copied tensor by tensor to host memory.
- **Sample gather** (`sample_gather_bytes`): after generating, every rank receives all ranks' samples
  with `torch.distributed.all_gather_object`, which under NCCL pickles each rank's list into a CUDA
  byte tensor padded to the largest, and gathers into `world x largest`: `(world + 1) x` one rank's
  payload. A sample pickles its token ids (int64), log-probs (fp32), routes (`L_moe x K` ids of 1 B,
  2 B past 256 experts) and, with the transformers engine, router probabilities (`L_moe x K` fp16);
  the plan takes every sequence at `rollout.max_model_len`.
"""

from __future__ import annotations

import math

from moe_gspo.plan.params import Geometry, megatron_counts
from moe_gspo.routing.trace import ids_dtype
from moe_gspo.rollout.engine_spec import engine_spec


def foreach_adam_bytes(*, optimizer_params: float, fused_adam: bool, precision_aware: bool) -> float:
    """The fp32 `_foreach_sqrt` temporary of torch's foreach AdamW over `optimizer_params` parameters."""
    return 0.0 if (fused_adam or precision_aware) else 4.0 * optimizer_params


def _qkv_params(geom: Geometry) -> int:
    return (geom.num_heads + 2 * geom.num_kv_heads) * geom.head_dim * geom.hidden


def _experts_params(geom: Geometry) -> int:
    return geom.num_experts * 3 * geom.moe_intermediate * geom.hidden


def stream_bucket_bytes(geom: Geometry, *, ep: int, param_bytes: int) -> tuple[float, float]:
    """(bytes the stream holds for the largest bucket once gathered, extra bytes while gathering)."""
    if not any(geom.moe_layers):
        return _qkv_params(geom) * param_bytes, 0.0
    if ep <= 1:
        return _qkv_params(geom) * param_bytes, 0.0
    full = _experts_params(geom) * param_bytes
    return _qkv_params(geom) * param_bytes + full, full / ep


def vllm_module_params(geom: Geometry, *, tp: int) -> int:
    """Parameters of the largest module vLLM's layer-wise reload materializes at tensor parallelism `tp`."""
    g = geom
    vocab = math.ceil(math.ceil(g.vocab_size / 64) * 64 / tp) * g.hidden
    heads, kv = max(1, g.num_heads // tp), max(1, g.num_kv_heads // tp)
    qkv = (heads + 2 * kv) * g.head_dim * g.hidden
    moe = g.num_experts * 3 * math.ceil(g.moe_intermediate / tp) * g.hidden if any(g.moe_layers) else 0
    dense = 3 * math.ceil(g.intermediate / tp) * g.hidden if not all(g.moe_layers) else 0
    return max(vocab, qkv, moe, dense)


def sync_transient_bytes(geom: Geometry, *, ep: int, tp: int, param_bytes: int, rollout_bytes: int,
                         engine: str) -> float:
    """Peak transient of one weight sync (see the module docstring)."""
    held, gathering = stream_bucket_bytes(geom, ep=ep, param_bytes=param_bytes)
    if not engine_spec(engine).reload_copies_module:
        return held + gathering
    module = vllm_module_params(geom, tp=tp) * rollout_bytes
    cast = _experts_params(geom) * rollout_bytes if param_bytes != rollout_bytes and any(geom.moe_layers) else 0.0
    embedding = megatron_counts(geom).embedding * rollout_bytes if param_bytes != rollout_bytes else 0.0
    return max(held + max(gathering, module + cast), module + embedding)


def export_transient_bytes(geom: Geometry, *, ep: int, param_bytes: int) -> float:
    """Peak transient of the streamed HF export (the stream's largest bucket; host copies aside)."""
    held, gathering = stream_bucket_bytes(geom, ep=ep, param_bytes=param_bytes)
    return held + gathering


def sample_payload_bytes(geom: Geometry, *, num_seqs: int, seq_len: int, record_routes: bool,
                         record_probs: bool) -> float:
    """Pickled bytes of `num_seqs` rollout samples of `seq_len` tokens (one rank's share)."""
    per_token = 8 + 4
    if record_routes:
        per_token += geom.num_moe_layers * geom.top_k * ids_dtype(geom.num_experts).itemsize
        if record_probs:
            per_token += geom.num_moe_layers * geom.top_k * 2
    return float(num_seqs * seq_len * per_token)


def sample_gather_bytes(payload_bytes: float, *, world: int) -> float:
    """GPU bytes of `all_gather_object` of a `payload_bytes` object per rank over `world` ranks (NCCL)."""
    return 0.0 if world <= 1 else (world + 1) * payload_bytes

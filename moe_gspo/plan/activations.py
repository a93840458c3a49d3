"""Activation memory of the Megatron learner for one micro-batch: the formula and its assumptions.

Notation: a micro-batch of `b` sequences of length `s`, `N = b s` tokens; hidden `h`; `a` query heads,
`g` KV heads, head dim `d`; `E` experts, top-`k`, expert width `I`, dense-MLP width `I_d`; padded
vocabulary `V`; `p` bytes per activation element (2 for bf16, 4 for fp32). The fp32 pieces (RMSNorm
`rstd`, router scores, the loss's fp32 logits) are written with their own byte counts.

**Saved for backward, per decoder layer** (counted tensor by tensor for Megatron-core 0.16's local
layer spec, and checked against the bytes autograd really saves on the tiny model in fp32 at EP=1,
`tests/plan/test_activations.py`; see `layer_saved_bytes`):

- attention block: `N [p (3h + (a+2g)d + g d + 6 a d) + 4 (1 + a + g)] + 16 s d` plus, for the unfused
  attention of the local spec, the softmax `b a s^2 (4 + p)` (fp32 softmax output and the bf16
  probabilities; `4` alone in fp32). The `3h` are the input RMSNorm's input and normalised output and
  the QKV projection's input; `(a+2g)d` the QKV output, `gd + 2ad` the QK-norm tensors, `4ad` the
  query / GQA-expanded key and value / context; `16 s d` the RoPE tables (Megatron's unfused RoPE keeps
  them per layer; the CPU default `moe_gspo.mcore.fused_rope` keeps one pair for the whole model, an
  over-count of `16 s d` per layer that the plan keeps).
  With Transformer Engine's fused attention (flash) the `s^2` term disappears and the kernel keeps
  `q, k, v, O` and a log-sum-exp: `N [p (3h + (a+2g)d + 2 g d + 4 a d) + 4 (1 + 2a + g)]` — estimated
  from the same inventory, not measured here (no GPU).
- MoE block: `N (3 h p + 4) + T [p (h + 6 I) + 4] + N (20 k + 5 E)`, where `T` is the number of
  (token, expert) pairs routed to this rank's experts: `N k` in expectation at any EP size; the busiest
  rank of an EP group gets more (`imbalance`, an allowance, `min(imbalance, EP)`; exact `1` at EP=1).
  `h + 6I` per pair: the permuted token, the fc1 output (`2I`), SiLU output, GLU product, the
  probability-scaled product and the fc2 input (`I` each). The grouped expert layout on CUDA fuses its
  SwiGLU (`moe_gspo.mcore.swiglu`, issue 48) and keeps `h + 3I` (the permuted token, the fc1 output, the
  fc2 input); the plan keeps counting `h + 6I` for every layout, an over-count of `3 I p` per pair there
  (counted at Qwen3-30B-A3B shapes on the meta device: tests/mcore/test_grouped_meta_contract.py).
- dense-MLP block (layers in `mlp_only_layers`): `N [p (3h + 5 I_d) + 4]`.

**Loss head**: the final norm and output layer keep `3 N h p`. The loss (`moe_gspo.learner.logprobs`)
in fp32 keeps the fp32 logits, `4 N V`, and the backward starts with an equal-sized gradient: peak
`8 N V`. With bf16 (any `p < 4`) logits its autograd function (`ChunkedTokenLogprobs`, issue 40) keeps
only the bf16 logits, `p N V`, besides the targets and log-sum-exps both paths keep (+ `4 N`
entropies), and recomputes the softmax one 128 MiB fp32 chunk at a time in the backward (a few
chunk-sized fp32 temporaries, `logprob_backward_chunks`: 4 chunks, 5 when the entropy bonus has a gradient
or the logits span several chunks) next to the bf16 gradient `p N V`: peak `2 p N V` + the chunks. Before issue 40 it kept an fp32 copy, `4 N V` (`8 N V` with entropies), and
peaked at `(4 + p) N V`.

**Peaks** (`ActivationEstimate.peak_bytes`):
- without recomputation: every layer's saved tensors plus the head's peak;
- with full recomputation (`model.recompute`: Megatron's `recompute_granularity=full`, one layer per
  checkpoint): each layer keeps only its input `N h p` (plus the RoPE table and mask), and the
  backward re-runs one layer at a time: `L N h p + max(head peak, largest layer + its backward
  transient)`, the transient being that layer's largest single intermediate (softmax scores, or the
  experts' fc1 output) — an allowance, not a measurement;
- no-grad passes (old-policy / reference log-probs): nothing is kept, so the peak is one layer's
  working set or the logits (`p N V` plus one 128 MiB fp32 chunk), plus the residual stream `2 N h p`.
The token dispatcher adds a transient inside each MoE layer: all-gather `N EP h p` (every rank's
tokens), all-to-all `N k h p` (the permuted copy).

Not modelled: CUDA caching-allocator fragmentation (the plan adds a fraction of the total instead),
sequence packing (the learner right-pads to the micro-batch's longest sequence, so the plan uses
`rollout.max_model_len`, the longest a sequence can be).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_gspo.plan.params import Geometry

LOGPROB_CHUNK_BYTES = 128 << 20  # moe_gspo.learner.logprobs processes fp32 logits in 128 MiB chunks
LOGPROB_BACKWARD_CHUNKS = 4  # fp32 chunk-sized temporaries of ChunkedTokenLogprobs' backward (x, p, grad, a product)
LOGPROB_BACKWARD_CHUNKS_MAX = 5  # ... with the entropy bonus' gradient, or past the first of several chunks


def logprob_backward_chunks(*, entropy_grad: bool, several_chunks: bool) -> int:
    """Chunk-sized fp32 temporaries alive at once in `ChunkedTokenLogprobs`' backward (counted on the CPU,
    tests/plan/test_plan_activations.py): a chunk's logits `x`, `p`, its gradient and one product, 4; 5 when
    the entropy bonus has a gradient (`algo.entropy_coef > 0`: `p (x - lse + H) g` holds two products) or
    when there are several chunks (the next chunk's `x` and `p` are allocated while the previous chunk's
    `p` and gradient are still bound)."""
    return LOGPROB_BACKWARD_CHUNKS_MAX if entropy_grad or several_chunks else LOGPROB_BACKWARD_CHUNKS


ATTENTIONS = ("unfused", "flash")
DISPATCHERS = ("allgather", "alltoall")


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    num_seqs: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.num_seqs * self.seq_len


def _pairs(geom: Geometry, mb: MicroBatch, ep_size: int, imbalance: float) -> float:
    factor = 1.0 if ep_size <= 1 else min(float(imbalance), float(ep_size))
    return mb.tokens * geom.top_k * factor


def attention_saved_bytes(geom: Geometry, mb: MicroBatch, *, act_bytes: int, attention: str) -> float:
    g, N, p = geom, mb.tokens, act_bytes
    a, kv, d, h = g.num_heads, g.num_kv_heads, g.head_dim, g.hidden
    if attention == "unfused":
        per_tok = p * (3 * h + (a + 2 * kv) * d + kv * d + 6 * a * d) + 4 * (1 + a + kv)
        softmax = mb.num_seqs * a * mb.seq_len ** 2 * (4 + (p if p < 4 else 0))
    elif attention == "flash":
        per_tok = p * (3 * h + (a + 2 * kv) * d + 2 * kv * d + 4 * a * d) + 4 * (1 + 2 * a + kv)
        softmax = 0
    else:
        raise ValueError(f"attention={attention!r}: one of {ATTENTIONS}")
    return N * per_tok + softmax + 16 * mb.seq_len * d


def mlp_saved_bytes(geom: Geometry, mb: MicroBatch, *, is_moe: bool, act_bytes: int, ep_size: int = 1,
                    imbalance: float = 1.0) -> float:
    g, N, p = geom, mb.tokens, act_bytes
    if not is_moe:
        return N * (p * (3 * g.hidden + 5 * g.intermediate) + 4)
    pairs = _pairs(g, mb, ep_size, imbalance)
    return (N * (3 * g.hidden * p + 4) + pairs * (p * (g.hidden + 6 * g.moe_intermediate) + 4)
            + N * (20 * g.top_k + 5 * g.num_experts))


def layer_saved_bytes(geom: Geometry, mb: MicroBatch, *, is_moe: bool, act_bytes: int, attention: str,
                      ep_size: int = 1, imbalance: float = 1.0) -> float:
    """Bytes one decoder layer saves for backward (see the module docstring)."""
    return (attention_saved_bytes(geom, mb, act_bytes=act_bytes, attention=attention)
            + mlp_saved_bytes(geom, mb, is_moe=is_moe, act_bytes=act_bytes, ep_size=ep_size, imbalance=imbalance))


def layer_transient_bytes(geom: Geometry, mb: MicroBatch, *, is_moe: bool, act_bytes: int, attention: str,
                          ep_size: int = 1, imbalance: float = 1.0, dispatcher: str = "allgather") -> float:
    """The largest single intermediate of a layer (its backward's gradient of it), plus the MoE
    dispatcher's gathered / permuted tokens."""
    g, N, p = geom, mb.tokens, act_bytes
    candidates = [N * p * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim, N * p * g.hidden]
    if attention == "unfused":
        candidates.append(mb.num_seqs * g.num_heads * mb.seq_len ** 2 * 4)
    if is_moe:
        candidates.append(_pairs(g, mb, ep_size, imbalance) * p * 2 * g.moe_intermediate)
    else:
        candidates.append(N * p * 2 * g.intermediate)
    dispatch = 0.0
    if is_moe and ep_size > 1:
        dispatch = N * ep_size * g.hidden * p if dispatcher == "allgather" else N * g.top_k * g.hidden * p
    return max(candidates) + dispatch


def head_saved_bytes(geom: Geometry, mb: MicroBatch, *, act_bytes: int, vocab_padded: int) -> float:
    """Final norm + output layer inputs + what the loss keeps: fp32 logits in fp32, else the logits in
    their own dtype (`moe_gspo.learner.logprobs.ChunkedTokenLogprobs`; + 4 bytes per token of entropies)."""
    N = mb.tokens
    if act_bytes >= 4:
        return N * (3 * geom.hidden * act_bytes + 4) + 4 * N * vocab_padded + 20 * N
    return N * (3 * geom.hidden * act_bytes + 4) + act_bytes * N * vocab_padded + 24 * N


def head_peak_bytes(geom: Geometry, mb: MicroBatch, *, act_bytes: int, vocab_padded: int,
                    entropy_grad: bool = False) -> float:
    """The head's peak in the training backward (`entropy_grad`: the entropy bonus has a gradient)."""
    N = mb.tokens
    if act_bytes >= 4:
        return N * (3 * geom.hidden * act_bytes + 4) + (4 + act_bytes) * N * vocab_padded + 20 * N
    several = N > max(1, LOGPROB_CHUNK_BYTES // 4 // vocab_padded)  # rows per chunk (moe_gspo.learner.logprobs)
    chunks = logprob_backward_chunks(entropy_grad=entropy_grad, several_chunks=several) \
        * min(LOGPROB_CHUNK_BYTES, 4 * N * vocab_padded)
    return N * (3 * geom.hidden * act_bytes + 4) + 2 * act_bytes * N * vocab_padded + chunks + 24 * N


@dataclass(frozen=True, kw_only=True)
class ActivationEstimate:
    stored_bytes: float
    """What the training forward keeps until the backward (all layers, or checkpoints, and the head)."""
    peak_bytes: float
    """Peak activation memory of a training micro-batch (forward + backward)."""
    inference_peak_bytes: float
    """Peak of a no-grad forward (log-prob passes) of the same micro-batch shape."""


def activation_estimate(geom: Geometry, train_mb: MicroBatch, *, act_bytes: int, attention: str, recompute: bool,
                        vocab_padded: int, ep_size: int = 1, imbalance: float = 1.0, dispatcher: str = "allgather",
                        infer_mb: MicroBatch | None = None, entropy_grad: bool = False) -> ActivationEstimate:
    """Training and no-grad activation memory of one micro-batch on one rank (`entropy_grad`: the loss has
    the entropy bonus, whose gradient adds a chunk to the loss head's backward)."""
    kw = dict(act_bytes=act_bytes, attention=attention, ep_size=ep_size, imbalance=imbalance)
    layers = [layer_saved_bytes(geom, train_mb, is_moe=m, **kw) for m in geom.moe_layers]
    transients = [layer_transient_bytes(geom, train_mb, is_moe=m, dispatcher=dispatcher, **kw) for m in geom.moe_layers]
    head_peak = head_peak_bytes(geom, train_mb, act_bytes=act_bytes, vocab_padded=vocab_padded,
                                entropy_grad=entropy_grad)
    ids = 8 * train_mb.tokens
    if recompute:
        ckpt = geom.num_layers * train_mb.tokens * geom.hidden * act_bytes + 4 * train_mb.seq_len * geom.head_dim \
            + train_mb.seq_len ** 2
        stored = ckpt + head_saved_bytes(geom, train_mb, act_bytes=act_bytes, vocab_padded=vocab_padded) + ids
        peak = ckpt + ids + max(head_peak, max(l + t for l, t in zip(layers, transients)))
    else:
        stored = sum(layers) + head_saved_bytes(geom, train_mb, act_bytes=act_bytes, vocab_padded=vocab_padded) + ids
        peak = sum(layers) + ids + max(head_peak, max(transients))
    imb = infer_mb or train_mb
    work = max(layer_saved_bytes(geom, imb, is_moe=m, **kw) + layer_transient_bytes(geom, imb, is_moe=m,
                                                                                     dispatcher=dispatcher, **kw)
               for m in geom.moe_layers)
    logits = act_bytes * imb.tokens * vocab_padded + min(LOGPROB_CHUNK_BYTES, 4 * imb.tokens * vocab_padded)
    inference = max(work, logits) + 2 * imb.tokens * geom.hidden * act_bytes
    return ActivationEstimate(stored_bytes=stored, peak_bytes=peak, inference_peak_bytes=inference)

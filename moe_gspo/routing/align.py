"""R3 plumbing: turn the rollout engine's per-sequence routes into Megatron router-replay tensors.

Rollout Routing Replay (R3, Ma et al. 2025, arXiv 2510.11370) makes the learner use the experts the
rollout engine chose. Megatron-core 0.16 implements the replay side in
`megatron/core/transformer/moe/router_replay.py`: one `RouterReplay` per MoE layer (in construction
order, i.e. model order on this pipeline stage); `RouterReplay.set_replay_data(list_of_L_tensors)`
hands layer l a ``[num_local_tokens, K]`` int64 top-k index tensor, and under
`REPLAY_FORWARD`/`REPLAY_BACKWARD` the router uses those indices and gathers their probabilities
from its own current scores (so the router still gets gradients).

Token order (checked in megatron-core 0.16.1): `MoELayer.forward` receives hidden states
``[S, B, H]``; `TopKRouter.gating` keeps that shape for the logits ``[S, B, E]``, and
`TopKRouter.routing` does ``seq_length, bsz = logits.shape[:2]; logits.view(-1, num_experts)``, so
router row ``r = s * B + b`` (sequence-major: all B sequences of position 0, then position 1, ...).
`topk_routing_with_score_function` then calls ``router_replay.get_replay_topk`` on those
``[S*B, E]`` scores, which does ``scores.gather(1, target_topk_idx)``: the replay tensor must be
int64 with exactly ``S*B`` rows in that order.

Scope:
- Each data-parallel rank passes only its own micro-batch's sequences; no cross-rank splitting is
  needed (nor provided).
- With sequence parallelism (TP > 1) the router sees only this TP rank's slice of S; because the
  ``"sb"`` layout is s-major, that slice is the contiguous row block
  ``[rank * S/TP * B, (rank + 1) * S/TP * B)`` of each layer tensor. Context parallelism (which
  reorders S into load-balanced chunks) is not handled.
- Positions without a route (the final token(s) the engine never ran through the model, and the
  right padding) get the filler set ``0, 1, ..., K-1``: a valid set of K distinct experts. Those
  positions produce no log-probability that the loss uses, and under causal attention they cannot
  affect earlier positions, so the filler only has to be legal, not meaningful. (With a capacity
  factor / token dropping the filler rows would compete for experts 0..K-1's capacity; the
  dropless default has no such effect.)
- Rows the engine gave are checked for shape, expert range and duplicate experts within a top-k (a
  ValueError names the sequence). Rows that are missing *inside* a sequence, or malformed, must be
  replaced before replay: R3 does so with the learner's natural routes (`moe_gspo.routing.replay_checks`).
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import torch


def filler_topk(top_k: int) -> torch.Tensor:
    """int64 [K]: the filler top-k set ``0 .. K-1`` used for positions without a route."""
    return torch.arange(int(top_k), dtype=torch.long)


def build_replay_topk(routes: Sequence[np.ndarray], seq_lens: Sequence[int], seq_len_padded: int, *,
                      num_experts: int, top_k: int, order: Literal["sb", "bs"] = "sb") -> torch.Tensor:
    """int64 ``[L, S*B, K]`` replay indices for a micro-batch of B right-padded sequences.

    Args:
        routes: B arrays ``[T_b, L, K]`` of expert ids; row t is the token at position t of sequence b
            (prompt and response packed from position 0, as the learner lays them out).
        seq_lens: B real (unpadded) sequence lengths; ``T_b <= seq_lens[b] <= seq_len_padded``.
        seq_len_padded: S, the padded length of the micro-batch.
        num_experts, top_k: the model's E and K (checked against the routes).
        order: ``"sb"`` (row ``s*B + b``, what Megatron's router uses) or ``"bs"`` (row ``b*S + s``).

    Returns a single contiguous tensor; ``list(out)`` (or ``out.unbind(0)``) is the per-layer list
    that `RouterReplay.set_replay_data` takes. Row (s, b) holds sequence b's route at position s when
    ``s < T_b`` and the filler ``0..K-1`` otherwise.
    """
    num_seqs = len(routes)
    if num_seqs == 0:
        raise ValueError("routes is empty: pass the routes of at least one sequence")
    if len(seq_lens) != num_seqs:
        raise ValueError(f"got {num_seqs} routes but {len(seq_lens)} seq_lens; pass one length per sequence")
    if order not in ("sb", "bs"):
        raise ValueError(f"order must be 'sb' (Megatron's s*B+b) or 'bs', got {order!r}")
    seq_len_padded, top_k, num_experts = int(seq_len_padded), int(top_k), int(num_experts)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    num_layers = None
    arrs = []
    for b, (r, n) in enumerate(zip(routes, seq_lens)):
        if r is None:
            raise ValueError(f"sequence {b} has no route (routes[{b}] is None); R3 needs routes for every "
                             f"sequence")
        r = r.detach().cpu().numpy() if isinstance(r, torch.Tensor) else np.asarray(r)
        if r.ndim != 3:
            raise ValueError(f"routes[{b}] must have shape [T, L, K], got {r.shape}")
        if num_layers is None:
            num_layers = r.shape[1]
        if r.shape[1] != num_layers:
            raise ValueError(f"routes[{b}] has L={r.shape[1]} MoE layers, routes[0] has L={num_layers}")
        if r.shape[2] != top_k:
            raise ValueError(f"routes[{b}] has K={r.shape[2]}, expected top_k={top_k}")
        if r.dtype.kind not in "iu":
            raise ValueError(f"routes[{b}] must hold integer expert ids, got dtype {r.dtype}")
        if r.size and (int(r.min()) < 0 or int(r.max()) >= num_experts):
            raise ValueError(f"routes[{b}] holds expert ids in [{int(r.min())}, {int(r.max())}], outside "
                             f"[0, num_experts={num_experts})")
        n = int(n)
        if not r.shape[0] <= n <= seq_len_padded:
            raise ValueError(f"sequence {b}: need route rows T={r.shape[0]} <= seq_len={n} <= "
                             f"seq_len_padded={seq_len_padded}")
        arrs.append(r)

    out_LSBK = filler_topk(top_k).expand(num_layers, seq_len_padded, num_seqs, top_k).clone()
    for b, r in enumerate(arrs):
        if r.shape[0]:
            out_LSBK[:, :r.shape[0], b, :] = torch.from_numpy(r.astype(np.int64)).permute(1, 0, 2)
    if top_k > 1:  # a top-k naming one expert twice would run it twice: never replay that
        srt = out_LSBK.sort(-1).values
        dup_LSB = (srt[..., 1:] == srt[..., :-1]).any(-1)
        if bool(dup_LSB.any()):
            layer, s, b = (int(i) for i in dup_LSB.nonzero()[0])
            raise ValueError(f"routes[{b}] row {s} names an expert twice in MoE layer {layer} "
                             f"({out_LSBK[layer, s, b].tolist()}); check the routes first "
                             "(moe_gspo.routing.replay_checks) and replace unusable rows")
    if order == "bs":
        out_LSBK = out_LSBK.permute(0, 2, 1, 3)
    return out_LSBK.reshape(num_layers, -1, top_k).contiguous()

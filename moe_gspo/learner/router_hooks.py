"""Record which experts every token used in the Megatron learner, via forward hooks on `TopKRouter`.

`MegatronRouterRecorder(model)` registers one `register_forward_hook` on the `TopKRouter` of every MoE
layer (Megatron is neither forked nor patched). `TopKRouter.forward(hidden [S, B, H])` returns
`(probs [N, E], routing_map [N, E] bool)` with `N = S * B` rows in Megatron's sequence-major order
(row `s * B + b`). The hook keeps, per layer and per model forward:
- `ids [N, K]`: the K experts of `routing_map`, ordered by the router's (renormalised) weight,
  descending; under routing replay these are the replayed experts;
- `probs [N, K]` (when `record_probs`): the softmax over *all* experts of the router's logits at those
  experts (pre-renormalisation), the quantity `moe_gspo.rollout.hf_router_hooks` records, so learner
  and rollout traces compare directly. The logits are recomputed from the hook's input with the
  router's own `gating` (one small [N, H] x [H, E] product, no gradient);
- `stats [N, 2]` (when `record_stats`): the router margin (k-th minus (k+1)-th logit) and the entropy of the
  softmax over all experts, from the same logits (`moe_gspo.routing.router_stats.token_router_stats`, as
  the rollout engine's recorder computes them).

While `enabled` is False no hook is registered at all (zero cost); setting it True registers them again.
Record only in passes without activation recomputation in the backward (e.g. the no-grad old-policy
pass): a recomputed forward would fire the hooks a second time.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_gspo.mcore.model import moe_routers
from moe_gspo.routing.router_stats import token_router_stats
from moe_gspo.routing.trace import ids_dtype


class MegatronRouterRecorder:
    """Forward hooks on every MoE router of a Megatron `GPTModel` that record per-token top-k routes."""

    def __init__(self, model, *, record_probs: bool = True, record_stats: bool = True, enabled: bool = True):
        self._routers = moe_routers(model)
        if not self._routers:
            raise ValueError(f"{type(model).__name__} has no Megatron TopKRouter; is it a MoE GPTModel?")
        self.top_k: int = int(self._routers[0].topk)
        self.num_experts: int = int(self._routers[0].config.num_moe_experts)
        self.record_probs = record_probs
        self.record_stats = record_stats
        self._handles: list = []
        self._ids: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._probs: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._stats: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self.enabled = enabled

    @property
    def num_moe_layers(self) -> int:
        return len(self._routers)

    @property
    def enabled(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if value and not self._handles:
            self._handles = [r.register_forward_hook(self._make_hook(pos)) for pos, r in enumerate(self._routers)]
        elif not value:
            self.remove()

    def remove(self) -> None:
        """Take every hook of this recorder off the model (records are kept until `clear()`)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        self.enabled = True
        return self

    def __exit__(self, *exc):
        self.remove()

    def _make_hook(self, pos: int):
        def hook(module, args, output) -> None:
            probs_NE, routing_map_NE = output
            with torch.no_grad():
                weights_NE = torch.where(routing_map_NE, probs_NE.detach().float(), -1.0)
                ids_NK = torch.topk(weights_NE, self.top_k, dim=-1).indices
                self._ids[pos].append(ids_NK)
                if self.record_probs or self.record_stats:
                    logits = module.gating(args[0].detach()).reshape(-1, self.num_experts)
                if self.record_probs:
                    full_NE = torch.softmax(logits, dim=-1, dtype=torch.float32)
                    self._probs[pos].append(full_NE.gather(-1, ids_NK))
                if self.record_stats:
                    self._stats[pos].append(token_router_stats(logits, self.top_k))

        return hook

    def num_calls(self) -> int:
        """Number of complete model forwards recorded (every layer fired) and not yet cleared."""
        return min(len(x) for x in self._ids)

    def clear(self) -> None:
        self._ids = [[] for _ in self._routers]
        self._probs = [[] for _ in self._routers]
        self._stats = [[] for _ in self._routers]

    def topk_ids(self, call: int = -1) -> list[torch.Tensor]:
        """Per layer, the `[N, K]` int64 ids of recorded forward `call` (router row order)."""
        self._check_call(call)
        return [ids[call] for ids in self._ids]

    def router_probs(self, call: int = -1) -> list[torch.Tensor]:
        """Per layer, the `[N, K]` float32 full-softmax probabilities of `topk_ids(call)`."""
        self._check_call(call)
        if not self.record_probs:
            raise ValueError("router_probs() needs a recorder built with record_probs=True")
        return [p[call] for p in self._probs]

    def _check_call(self, call: int) -> None:
        n = self.num_calls()
        if not -n <= call < n:
            raise ValueError(f"router recorder holds {n} complete forward(s); call={call} is out of range "
                             "(enable the recorder before the forward)")

    def to_sequences(self, seq_lens, batch_size: int, seq_len_padded: int, *, probs: bool = False,
                     stats: bool = False, call: int = -1) -> list[np.ndarray]:
        """Per-sequence arrays `[T_b, L, K]` (T_b = seq_lens[b]) of recorded forward `call`.

        Converts Megatron's row order `s * B + b` (B = `batch_size`, S = `seq_len_padded`). Ids come as
        `moe_gspo.routing.trace.ids_dtype` (uint8 up to 256 experts), probabilities (`probs=True`) as
        float32; `stats=True` gives the float32 `[T_b, L, 2]` router margin and entropy instead.
        """
        self._check_call(call)
        if probs and not self.record_probs:
            raise ValueError("to_sequences(probs=True) needs a recorder built with record_probs=True")
        if stats and not self.record_stats:
            raise ValueError("to_sequences(stats=True) needs a recorder built with record_stats=True")
        if probs and stats:
            raise ValueError("to_sequences: pass probs=True or stats=True, not both")
        per_layer = ([p[call] for p in self._probs] if probs else [x[call] for x in self._stats] if stats
                     else [i[call] for i in self._ids])
        B, S = int(batch_size), int(seq_len_padded)
        lens = [int(n) for n in seq_lens]
        if len(lens) != B:
            raise ValueError(f"to_sequences: {len(lens)} seq_lens for batch_size={B}")
        if per_layer[0].shape[0] != S * B:
            raise ValueError(f"to_sequences: the recorded forward has {per_layer[0].shape[0]} router rows, "
                             f"not seq_len_padded*batch_size = {S}*{B}")
        if any(not 0 <= n <= S for n in lens):
            raise ValueError(f"to_sequences: seq_lens must be in [0, {S}], got {lens}")
        stacked_SBLK = torch.stack([t.reshape(S, B, -1) for t in per_layer], dim=2).cpu()
        arr = stacked_SBLK.numpy().astype(np.float32 if probs or stats else ids_dtype(self.num_experts))
        return [np.ascontiguousarray(arr[:n, b]) for b, n in enumerate(lens)]

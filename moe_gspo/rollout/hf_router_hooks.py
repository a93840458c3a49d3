"""Record which experts every token used in a transformers Qwen3-MoE model, via forward hooks.

`HFRouterRecorder(model)` registers one `register_forward_hook` on the router (`mlp.gate`, a
`Qwen3MoeTopKRouter`) of every MoE layer; transformers itself is neither forked nor patched. In
transformers 5 the router returns `(router_logits [N, E], router_scores [N, K], router_indices [N, K])`
with `N = batch * seq` flattened tokens; the hook keeps the top-k ids and, when `record_probs`, the
router probabilities of those experts; when `record_stats`, two scalars per token and layer: the router
margin and entropy (`moe_gspo.routing.router_stats.token_router_stats`: the gap between the k-th and
(k+1)-th logit, the entropy of the softmax over all experts), computed from the layers' router logits of a
forward in one call when it is popped (the [N, E] logits are kept until then, not the scores).

Which probabilities: the softmax over *all* experts (computed in float32 from the router's logits,
exactly as the router computes it) at the chosen experts, i.e. the values *before* the
`norm_topk_prob` renormalisation. They carry more information than the renormalised weights (their
sum says how much mass the top-k captured) and the renormalised weights follow from them
(`p / p.sum(-1)`).

One model forward produces one record (`RouterCall`) with all MoE layers stacked: `topk_ids_NLK`
[N, L, K], `probs_NLK` [N, L, K] and `stats_NL2` [N, L, 2], L = number of MoE layers in model order (`layer_ids` gives their
decoder-layer indices). Records stay on the model's device until `pop()`.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from moe_gspo.routing.router_stats import token_router_stats

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class RouterCall:
    """The routing of one model forward: all MoE layers, all N flattened tokens."""

    topk_ids_NLK: torch.Tensor
    """int16 (int32 when num_experts > 32767) [N, L, K] top-k expert ids, in the router's order."""
    probs_NLK: torch.Tensor | None
    """float32 [N, L, K] full-softmax router probabilities of those experts (pre-renormalisation)."""
    stats_NL2: torch.Tensor | None = None
    """float32 [N, L, 2] router margin (logits, k-th minus (k+1)-th) and entropy (nats) per token, or None."""


def topk_from_router_logits(logits_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids and their full-softmax probabilities from router logits.

    Mirrors the Qwen3-MoE router: softmax in float32 over all experts, then `torch.topk` (so ties
    break as the router breaks them). Returns `(ids_NK int64, probs_NK float32)`; the probabilities
    are not renormalised over the k chosen experts.
    """
    if k < 1 or k > logits_NE.shape[-1]:
        raise ValueError(f"k={k} must be in [1, num_experts={logits_NE.shape[-1]}]")
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    probs_NK, ids_NK = torch.topk(probs_NE, k, dim=-1)
    return ids_NK, probs_NK


def _is_router(module: nn.Module) -> bool:
    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    except ImportError:  # pragma: no cover - only without the qwen3_moe module
        Qwen3MoeTopKRouter = ()
    if Qwen3MoeTopKRouter and isinstance(module, Qwen3MoeTopKRouter):
        return True
    return (isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int)
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """`(decoder_layer_index, router_module)` for every MoE layer of `model`, in layer order.

    Works on `Qwen3MoeForCausalLM`, `Qwen3MoeModel` or anything whose routers live under
    `...layers.{i}...` and look like `Qwen3MoeTopKRouter` (`top_k`, `num_experts`, `weight`).
    """
    found = []
    for name, module in model.named_modules():
        if not _is_router(module):
            continue
        match = _LAYER_RE.search(name + ".")
        if match is None:
            raise ValueError(f"router module {name!r} is not under a 'layers.<i>' module; "
                             "cannot tell its layer index")
        found.append((int(match.group(1)), module))
    found.sort(key=lambda item: item[0])
    return found


class HFRouterRecorder:
    """Forward hooks on every MoE router of a transformers model that record top-k routes.

    Use as a context manager or call `remove()`; after removal no hook of this recorder is left on
    the model. While `enabled` is False the hooks return at once and record nothing.
    """

    def __init__(self, model: nn.Module, *, record_probs: bool = True, record_stats: bool = True,
                 enabled: bool = True):
        routers = find_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE router (a module with top_k, "
                             "num_experts and weight under 'layers.<i>'); is this a Qwen3-MoE model?")
        self.layer_ids: list[int] = [layer for layer, _ in routers]
        """Decoder-layer index of each recorded MoE layer (the L axis of the records)."""
        self.top_k: int = routers[0][1].top_k
        self.num_experts: int = routers[0][1].num_experts
        if any(r.top_k != self.top_k or r.num_experts != self.num_experts for _, r in routers):
            raise ValueError("MoE layers with different top_k / num_experts are not supported")
        self.record_probs = record_probs
        self.record_stats = record_stats
        self.enabled = enabled
        self._id_dtype = torch.int16 if self.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self._ids: list[list[torch.Tensor]] = [[] for _ in routers]
        self._probs: list[list[torch.Tensor]] = [[] for _ in routers]
        self._stats: list[list[torch.Tensor]] = [[] for _ in routers]
        self._handles = [router.register_forward_hook(self._make_hook(pos))
                         for pos, (_, router) in enumerate(routers)]

    @property
    def num_moe_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def active(self) -> bool:
        """True until `remove()` is called."""
        return bool(self._handles)

    def _make_hook(self, pos: int):
        # The hook holds only a weak reference, so a recorder dropped without `remove()` is
        # collected and its `__del__` takes the hooks off the model.
        self_ref = weakref.ref(self)

        def hook(module: nn.Module, args, output) -> None:
            self = self_ref()
            if self is None or not self.enabled:
                return
            if isinstance(output, (tuple, list)) and len(output) == 3:
                logits_NE, _, ids_NK = output
            else:  # a router that returns only logits: select the top-k ourselves
                logits_NE = output
                ids_NK, _ = topk_from_router_logits(logits_NE, module.top_k)
            logits_NE = logits_NE.detach().reshape(-1, logits_NE.shape[-1])
            ids_NK = ids_NK.detach().reshape(-1, ids_NK.shape[-1])
            self._ids[pos].append(ids_NK.to(self._id_dtype))
            if self.record_probs:
                probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
                self._probs[pos].append(probs_NE.gather(-1, ids_NK.long()))
            if self.record_stats:  # the logits; `pop` makes the statistics of every layer in one call
                self._stats[pos].append(logits_NE)

        hook._moe_gspo_router_hook = True  # lets a deep copy of the model drop hooks it inherited
        return hook

    def num_pending(self) -> int:
        """Number of complete model forwards recorded and not yet popped."""
        return min(len(ids) for ids in self._ids)

    def clear(self) -> None:
        """Drop everything recorded so far."""
        for lst in (*self._ids, *self._probs, *self._stats):
            lst.clear()

    def pop(self) -> list[RouterCall]:
        """Return and forget the records, one `RouterCall` per model forward, oldest first."""
        counts = {len(ids) for ids in self._ids}
        if len(counts) != 1:
            self.clear()
            raise RuntimeError("router records are incomplete (a forward was interrupted or pop() was "
                               "called inside a forward); the records were dropped")
        calls = []
        for c in range(counts.pop()):
            ids_NLK = torch.stack([ids[c] for ids in self._ids], dim=1)
            probs_NLK = torch.stack([p[c] for p in self._probs], dim=1) if self.record_probs else None
            stats_NL2 = None
            if self.record_stats:
                logits_NLE = torch.stack([x[c] for x in self._stats], dim=1)
                stats_NL2 = token_router_stats(logits_NLE.reshape(-1, self.num_experts), self.top_k
                                               ).view(*logits_NLE.shape[:2], 2)
            calls.append(RouterCall(topk_ids_NLK=ids_NLK, probs_NLK=probs_NLK, stats_NL2=stats_NL2))
        self.clear()
        return calls

    def remove(self) -> None:
        """Remove every hook of this recorder from the model (idempotent) and drop the records."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def __enter__(self) -> "HFRouterRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __del__(self):  # best effort: never leave hooks behind on a model that outlives us
        try:
            self.remove()
        except Exception:
            pass

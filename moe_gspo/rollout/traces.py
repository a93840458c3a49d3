"""Rollout samples -> a `RoutingTrace` (`moe_gspo.routing.trace`): the routes the rollout engine recorded, in the
trace format. On the rollout side so that `routing/` (pure maths) names nothing of `rollout/` (issue 60)."""

from __future__ import annotations

from typing import Sequence

from moe_gspo.rollout.base import RolloutSample
from moe_gspo.routing.trace import RoutingTrace


def from_rollout_samples(samples: Sequence[RolloutSample], num_experts: int, layer_ids: Sequence[int],
                         meta: dict | None = None, *, top_k: int | None = None) -> RoutingTrace:
    """A trace of the routes recorded in rollout samples (all must carry `routes_TLK`).

    Router probabilities are stored when every sample has `router_probs_TLK`, and refused when only
    some have them; router margins (`router_margin_TL`) when every sample has them.
    """
    missing = [i for i, s in enumerate(samples) if s.routes_TLK is None]
    if missing:
        raise ValueError(f"samples {missing[:5]} have no routes_TLK; use an engine with "
                         f"records_routes=True (or drop those samples)")
    have_probs = [s.router_probs_TLK is not None for s in samples]
    if any(have_probs) and not all(have_probs):
        raise ValueError(f"only {sum(have_probs)} of {len(samples)} samples carry router_probs_TLK; "
                         f"record probabilities for all samples or for none")
    probs = [s.router_probs_TLK for s in samples] if samples and all(have_probs) else None
    margins = [s.router_margin_TL for s in samples]
    return RoutingTrace.from_samples(
        [s.routes_TLK for s in samples], [len(s.prompt_ids) for s in samples],
        [len(s.response_ids) for s in samples], num_experts, layer_ids, probs=probs, meta=meta,
        top_k=top_k, margins=margins if samples and all(m is not None for m in margins) else None)

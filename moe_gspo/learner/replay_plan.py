"""Routing Replay's decision, in one place: which routes each learner pass of an RL step replays.

A replay mode (`algo.routing_replay`: none / r2 / r3) is a `ReplayModeSpec`: for each learner pass
(`LearnerPass`) the source of the routes it replays (`RouteSource`). The training loop and the Learner
ask the spec and the step's `ReplayPlan` instead of comparing mode names:

| pass                                        | none    | r2 (GSPO §5.3)  | r3 (Ma et al. 2025) |
|---------------------------------------------|---------|-----------------|---------------------|
| `OLD`: old-policy pass (records routes)     | natural | natural         | natural             |
| `PI_OLD`: replayed old-policy pass (pi_old) | not run | not run         | rollout             |
| `UPDATE`: the update's forwards             | natural | old pass        | rollout             |
| `RECOMPUTE`: activation recompute           | natural | old pass        | rollout             |
| `REFERENCE`: the KL reference pass          | natural | old pass        | rollout             |

"old pass" = the routes the old-policy pass chose with natural routing (recorded by it); "rollout" = the
rollout engine's routes, checked row by row (`moe_gspo.routing.replay_checks`): missing or malformed rows
take the old pass's routes. Where `PI_OLD` is not run, pi_old of the loss is the old-policy pass's
log-probs. The reference pass replays what the update replays, so the KL compares weights under one
routing; recompute replays it too (`moe_gspo.learner.replay.ReplayHandle.backward`).

A `ReplayPlan` is built once per step by the learner (`Learner.plan_replay`, from its mode and the batch,
after the old-policy pass): it holds those routes, the one row-by-row check of the batch's rollout
routes (`route_reasons`, the `r3/*` metrics) and the rollout routes cut for comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Mapping

import numpy as np

from moe_gspo.routing.replay_checks import check_routes, merge_fallback_routes, needs_fallback, usable_prefix


class LearnerPass(Enum):
    """The learner passes of one RL step that may replay routes."""

    OLD = "old"
    """The old-policy pass: natural routing, records the routes (comparisons, R2's source, R3's fallback)."""
    PI_OLD = "pi_old"
    """A second old-policy pass that replays routes, whose log-probs are the loss's pi_old (R3)."""
    UPDATE = "update"
    """The forwards of the update (`Learner.train_step`)."""
    RECOMPUTE = "recompute"
    """The forwards that activation recompute (`model.recompute`) re-runs in the update's backward."""
    REFERENCE = "reference"
    """The frozen reference policy's pass of the KL penalty (`algo.kl_coef > 0`)."""


class RouteSource(Enum):
    """Where the routes a pass replays come from."""

    NONE = "none"
    """No replay: the pass routes naturally (for `PI_OLD`: the pass is not run)."""
    OLD_PASS = "old_pass"
    """The routes the old-policy pass chose with natural routing (R2)."""
    ROLLOUT = "rollout"
    """The rollout engine's routes, checked row by row; failed rows take the old pass's routes (R3)."""


def _sources(**by_pass: RouteSource) -> Mapping[LearnerPass, RouteSource]:
    return MappingProxyType({p: by_pass.get(p.value, RouteSource.NONE) for p in LearnerPass})


@dataclass(frozen=True, kw_only=True)
class ReplayModeSpec:
    """One routing replay mode (`algo.routing_replay`) and what it replays where."""

    name: str
    """The mode's name in the config (`algo.routing_replay`)."""
    doc: str
    """One line for docs and messages."""
    sources: Mapping[LearnerPass, RouteSource] = field(default_factory=_sources)
    """The source of the routes each pass replays (absent passes route naturally)."""

    def source(self, p: LearnerPass) -> RouteSource:
        return self.sources[p]

    @property
    def replays(self) -> bool:
        """Whether some pass replays: the model needs `build_gpt_model(..., enable_routing_replay=True)`."""
        return any(s is not RouteSource.NONE for s in self.sources.values())

    @property
    def replays_old_pass(self) -> bool:
        """Whether a pass replays the old-policy pass's routes (R2): every log-prob pass records them."""
        return RouteSource.OLD_PASS in self.sources.values()

    @property
    def replays_rollout(self) -> bool:
        """Whether the engine's routes are replayed (R3): they are checked (`r3/*`), the fallback is warned
        about and the replay contract is checked in the `PI_OLD` pass."""
        return RouteSource.ROLLOUT in self.sources.values()

    @property
    def fusable(self) -> bool:
        """Whether the old-policy pass (natural routing) can serve the update's first forward
        (`train.fuse_old_logp_pass`): the update replays nothing or the old pass's own routes."""
        return self.source(LearnerPass.UPDATE) in (RouteSource.NONE, RouteSource.OLD_PASS)

    def check_rollout(self, *, record_routes: bool) -> None:
        """Refuse a rollout that records no routes where this mode replays the engine's (config check)."""
        if self.replays_rollout and not record_routes:
            others = "/".join(m.name for m in REPLAY_MODES.values() if not m.replays_rollout and m.replays)
            raise ValueError(f"algo.routing_replay={self.name} replays the rollout engine's routes, but "
                             "rollout.record_routes=false; set rollout.record_routes=true or choose "
                             f"algo.routing_replay={others}/{NO_REPLAY}")

    def check_model(self, *, has_replay: bool) -> None:
        """Refuse a model whose routers cannot replay when this mode replays."""
        if self.replays and not has_replay:
            raise ValueError(f"routing replay {self.name} needs the model built with "
                             "build_gpt_model(..., enable_routing_replay=True)")


NO_REPLAY = "none"
"""The `algo.routing_replay` name of the mode that replays nothing (e.g. the KL reference learner, which
replays only the routes each call gives it)."""

_REPLAYED = dict(update=RouteSource.OLD_PASS, recompute=RouteSource.OLD_PASS, reference=RouteSource.OLD_PASS)
REPLAY_MODES: Mapping[str, ReplayModeSpec] = MappingProxyType({s.name: s for s in (
    ReplayModeSpec(name=NO_REPLAY, doc="no routing replay: every pass routes naturally"),
    ReplayModeSpec(name="r2", doc="R2 (GSPO §5.3): the update replays the old-policy pass's routes",
                   sources=_sources(**_REPLAYED)),
    ReplayModeSpec(name="r3", doc="R3 (Rollout Routing Replay): pi_old and the update replay the rollout "
                                  "engine's checked routes",
                   sources=_sources(**{k: RouteSource.ROLLOUT for k in (*_REPLAYED, "pi_old")})),
)})
"""Every routing replay mode by its `algo.routing_replay` name."""


def replay_spec(mode: str | ReplayModeSpec) -> ReplayModeSpec:
    """The `ReplayModeSpec` of `mode` (a name of `REPLAY_MODES`, i.e. a value of `algo.routing_replay`, or a spec)."""
    if isinstance(mode, ReplayModeSpec):
        return mode
    if mode not in REPLAY_MODES:
        raise ValueError(f"algo.routing_replay={mode!r} is not a routing replay mode; choose one of "
                         f"{', '.join(REPLAY_MODES)}")
    return REPLAY_MODES[mode]


@dataclass(frozen=True, kw_only=True)
class ReplayPlan:
    """Which routes each learner pass of one step replays, where they came from and what was checked
    (`Learner.plan_replay`; global batch, host arrays of B sequences [T_b, L, K])."""

    spec: ReplayModeSpec
    """The replay mode."""
    num_seqs: int
    """B, the batch's sequence count."""
    old_pass_routes: list[np.ndarray] | None = None
    """The old-policy pass's natural routes (`RouteSource.OLD_PASS`, R3's fallback rows); None when not given."""
    rollout_routes: list[np.ndarray] | None = None
    """Under a mode that replays them: the engine's routes after the row-by-row check, failed rows taking
    `old_pass_routes` (`moe_gspo.routing.replay_checks.merge_fallback_routes`); else None."""
    route_reasons: list[np.ndarray] | None = None
    """The row-by-row check of the batch's rollout routes (`check_routes`: B arrays [n_b] of reason codes,
    0 = usable), when the batch has routes or the mode replays them; else None."""
    route_metrics: dict[str, float] = field(default_factory=dict)
    """That check's `r3/*` metrics (fallback fractions and counts per reason)."""
    comparable_routes: list[np.ndarray] | None = None
    """The engine's routes cut at each sequence's first failed row (`usable_prefix`), for the
    rollout-vs-learner comparisons and traces; None when the batch has none."""

    def routes(self, p: LearnerPass) -> list[np.ndarray] | None:
        """The routes pass `p` replays (None = natural routing)."""
        source = self.spec.source(p)
        if source is RouteSource.NONE:
            return None
        if source is RouteSource.ROLLOUT:
            return self.rollout_routes
        if self.old_pass_routes is None:
            raise ValueError(f"routing replay {self.spec.name} replays the old-policy pass's routes: give "
                             "train_step an OldPolicyPass whose `natural` pass recorded them "
                             "(compute_logprobs(batch, record_routes=True)), or its `replay` plan")
        return self.old_pass_routes

    @property
    def metrics(self) -> dict[str, float]:
        """The `r3/*` metrics of the check under a mode that replays the engine's routes; else {}."""
        return dict(self.route_metrics) if self.spec.replays_rollout else {}

    @property
    def fallback_token_frac(self) -> float:
        """Share of the replayed token rows whose rollout route failed its check (NaN when unchecked)."""
        return float(self.route_metrics.get("r3/fallback_token_frac", float("nan")))


def build_replay_plan(spec: ReplayModeSpec, rollout_routes, seq_lens, *, old_pass_routes, num_layers: int,
                      top_k: int, num_experts: int, old_pass=None) -> ReplayPlan:
    """The `ReplayPlan` of a batch (`rollout_routes`: its `PackedBatch.rollout_routes`, `seq_lens` its B
    lengths) under `spec`. `old_pass_routes`: the old-policy pass's natural routes, or None; `old_pass()`
    (optional) returns them when R3's fallback needs them and they were not given."""
    lens = [int(n) for n in np.asarray(seq_lens).reshape(-1)]
    B = len(lens)
    if old_pass_routes is not None and len(old_pass_routes) != B:
        raise ValueError(f"routing replay {spec.name}: the old-policy pass has {len(old_pass_routes)} sequences' "
                         f"routes for B={B}; it was run on another batch")
    if spec.replays_rollout and rollout_routes is None and old_pass_routes is None:
        raise ValueError(f"routing replay {spec.name} needs the rollout engine's routes (batch.rollout_routes is "
                         "None): record them (rollout.record_routes=true)")
    reasons, metrics, comparable, replayed = None, {}, None, None
    if rollout_routes is not None or spec.replays_rollout:
        dims = dict(num_layers=num_layers, top_k=top_k, num_experts=num_experts)
        reasons, metrics = check_routes(rollout_routes, lens, **dims)
        comparable = usable_prefix(rollout_routes, reasons, **dims)
        if spec.replays_rollout:
            if old_pass_routes is None and old_pass is not None and needs_fallback(reasons):
                old_pass_routes = old_pass()
            replayed = merge_fallback_routes(rollout_routes, reasons, old_pass_routes, num_experts=num_experts)
    return ReplayPlan(spec=spec, num_seqs=B, old_pass_routes=None if old_pass_routes is None else list(old_pass_routes),
                      rollout_routes=replayed, route_reasons=reasons, route_metrics=metrics,
                      comparable_routes=comparable)

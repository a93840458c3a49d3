"""The learner passes of one RL step around the update: the old-policy pass and what it hands to the
update (`old_policy_pass` → `moe_gspo.learner.old_pass.OldPolicyPass`, given to `Learner.train_step`),
rollout corrections, the frozen reference policy of the KL penalty, and the old->new routing-drift probes.

Used by `moe_gspo.train` (one call each per step); every function is collective over the learner's
ranks where it runs a learner pass (all ranks call it with the same global batch).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from moe_gspo.algos.collapse import mean_token_entropy
from moe_gspo.algos.rollout_correction import rollout_correction
from moe_gspo.config import AlgoConfig, Config
from moe_gspo.learner.batch import PackedBatch
from moe_gspo.learner.lr_schedule import lr_at
from moe_gspo.learner.old_pass import OldPolicyPass
from moe_gspo.learner.replay_plan import NO_REPLAY, LearnerPass, ReplayPlan, RouteSource, replay_spec
from moe_gspo.routing.drift_metrics import policy_update_drift, replayed_mismatch, rollout_vs_learner
from moe_gspo.routing.router_diag import step_router_diagnostics
from moe_gspo.routing.rows import response_rows, response_spans
from moe_gspo.run.timing import PhaseTimer

UPDATE_PREFIX = "update/"
"""Old->new learner routing after the FIRST optimizer step of an RL step (the GSPO paper's figure)."""
UPDATE_ALL_PREFIX = "update_all_minibatches/"
"""Old->new learner routing after ALL `train.num_minibatches` optimizer steps of an RL step."""


def step_correction(algo: AlgoConfig, batch: PackedBatch, old_logp_BS: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
    """Rollout corrections of `algo` for the whole batch: (is_weights_BS or None, rs_keep_BS or None,
    `rollout_corr/*` metrics); nothing when both are off. `old_logp_BS` must be the log-probs the
    loss uses as pi_old (under R3, the pass that replays the rollout routes)."""
    if algo.rollout_is == "none" and algo.rollout_rs == "none":
        return None, None, {}
    (weights, keep), m = rollout_correction(
        old_logp_BS.detach().cpu(), batch.rollout_logp_BS.cpu(), batch.response_mask_BS.cpu(),
        rollout_is=algo.rollout_is, rollout_is_threshold=algo.rollout_is_threshold, rollout_rs=algo.rollout_rs,
        rollout_rs_threshold=algo.rollout_rs_threshold, rollout_rs_threshold_lower=algo.rollout_rs_threshold_lower)
    return weights, keep, {k: float(v) for k, v in m.items()}


class ReferencePolicy:
    """A frozen copy of the initial policy for the k3 KL penalty (`algo.kl_coef > 0`).

    An inference-only `Learner(train=None)` over a second Megatron model built on the same ranks with
    the same expert-parallel sharding as the policy; its weights are copied from the policy's model
    when built (call it before any update and before loading a resume checkpoint, i.e. right after
    `build_policy`), so it is the initial policy also on resume. Memory: one more copy of the
    parameters in the learner's params dtype (bf16 on CUDA, fp32 on CPU), sharded like the policy
    (each rank holds the dense weights and its 1/EP of the experts), with no gradient buffers and no
    optimizer state; activations of one no-grad forward per micro-batch.

    Routing of the reference pass: the step's `ReplayPlan` says (`LearnerPass.REFERENCE`): the routing the
    update replays, so that the KL compares weights under the same expert choice (and is exactly 0 before
    the first update): natural routing without replay, the old-policy pass's routes under R2, the rollout
    engine's checked routes under R3. Upstream
    `RouterReplay` instances live in a class-level list that `set_global_router_replay_action` /
    `set_replay_data` drive; the reference model's instances are taken out of that list
    (`moe_gspo.learner.replay.detach_from_global_replay`), so only this object's own per-instance driver (`RoutingReplayDriver`) can make it replay.
    """

    def __init__(self, cfg: Config, info, policy_learner):
        from moe_gspo.learner.learner import Learner
        from moe_gspo.learner.replay import detach_from_global_replay
        from moe_gspo.mcore.model import build_gpt_model
        from moe_gspo.run.setup import learner_dtype, megatron_router_overrides

        model = build_gpt_model(
            policy_learner.hf_config, ep_size=info.ep_size, params_dtype=learner_dtype(cfg),
            enable_routing_replay=replay_spec(cfg.algo.routing_replay).replays,
            token_dispatcher=cfg.parallel.token_dispatcher,
            vocab_pad_multiple=cfg.model.vocab_pad_multiple, recompute=False,
            batched_experts=cfg.model.batched_experts, expert_layout=cfg.model.expert_layout,
            sdpa_attention=cfg.model.sdpa_attention, fused_rope=cfg.model.fused_rope,
            **megatron_router_overrides(cfg))  # the policy's router dtype (its aux loss never applies: no grad)
        detach_from_global_replay(model)
        model.load_state_dict(policy_learner.model.state_dict(), strict=True)
        model.requires_grad_(False)
        # it replays only the routes each call gives it (the policy's plan), never by a mode of its own
        self.learner = Learner(model, policy_learner.hf_config, parallel=info,
                               algo=dataclasses.replace(cfg.algo, routing_replay=NO_REPLAY), train=None)
        self.micro_batch_size = cfg.train.micro_batch_size

    def logprobs(self, batch: PackedBatch, plan: ReplayPlan) -> torch.Tensor:
        """[B, S] reference log-probs of the batch, replaying the routes the policy's step plan gives the
        reference pass (`plan.routes(LearnerPass.REFERENCE)`, `Learner.plan_replay`)."""
        return self.learner.compute_logprobs(batch, replay_routes=plan.routes(LearnerPass.REFERENCE),
                                             micro_batch_size=self.micro_batch_size).logp_BS


class UpdateDriftProbe:
    """Measures the learner's routing change on the step's batch after the first optimizer step
    (`update/*`) and after all mini-batches (`update_all_minibatches/*`), natural routing, on the rows
    that produce response log-probs; pass `after_optimizer_step` to `Learner.train_step`."""

    def __init__(self, learner, batch: PackedBatch, old_routes: list, num_experts: int):
        self.learner, self.batch, self.old_routes, self.num_experts = learner, batch, old_routes, num_experts
        self.first: Any = None
        self.last: Any = None
        self._last_index = learner.train.num_minibatches - 1
        self.seconds = 0.0
        """Wall time of the probe's passes so far (the first runs inside `Learner.train_step`)."""

    def _pass(self):
        t0 = time.perf_counter()
        out = self.learner.compute_logprobs(self.batch, record_routes=True, no_replay=True)
        self.seconds += time.perf_counter() - t0
        return out

    def after_optimizer_step(self, index: int, applied: bool) -> None:
        if self.first is None and applied:
            self.first = self._pass()
            if index == self._last_index:
                self.last = self.first

    def finish(self):
        """The pass after all mini-batches (reused when the first update was also the last); returns it."""
        if self.last is None:
            self.last = self._pass()
        return self.last

    def metrics(self) -> dict:
        out = {}
        mask = self.batch.response_mask_BS
        if self.first is not None:
            out.update(policy_update_drift(self.old_routes, self.first.routes, mask, num_experts=self.num_experts,
                                           prefix=UPDATE_PREFIX))
        if self.last is not None:
            out.update(policy_update_drift(self.old_routes, self.last.routes, mask, num_experts=self.num_experts,
                                           prefix=UPDATE_ALL_PREFIX))
        return out


@dataclass
class StepPasses:
    """What `learner_update` produced: metrics and the passes the traces need."""

    metrics: dict
    old: Any
    """The old-policy pass, natural routing, with routes (`LogprobResult`)."""
    new: Any
    """The pass after all mini-batches, with routes, or None when drift was not measured this step."""
    replayed_logp_BS: torch.Tensor | None
    """The replayed old-policy pass's log-probs (the loss's pi_old) where the mode runs one (R3); else None."""
    rollout_routes: list | None = None
    """The engine's routes for comparisons and traces: each sequence's cut at its first missing or
    malformed row (`moe_gspo.routing.replay_checks.usable_prefix`); None when not recorded."""


def fuse_old_pass(cfg: Config) -> bool:
    """Whether train.fuse_old_logp_pass applies: the old-policy pass routes naturally and runs in one piece,
    so it can serve the update only where the update replays nothing or its routes (`ReplayModeSpec.fusable`:
    not R3), without micro-batches and activation recompute (the pass computes the entropies with their
    graph, so the entropy bonus works with it)."""
    return (cfg.train.fuse_old_logp_pass and replay_spec(cfg.algo.routing_replay).fusable
            and not cfg.train.micro_batch_size and not cfg.model.recompute)


def learner_update(cfg: Config, policy, batch: PackedBatch, samples, step: int, *,
                   reference: ReferencePolicy | None = None, timer: PhaseTimer | None = None) -> StepPasses:
    """The learner side of one RL step, in order:

    1. old-policy pass with natural routing and routes (R2 records them for its replay) → the
       policy's entropy over the response tokens (`actor/entropy`) and the rollout-vs-learner metrics
       (`mismatch/*`, `mismatch_ratio/*`, `routing/*`, `routing_prompt/*`; the engine's routes cut at
       each sequence's first missing or malformed row), the router diagnostics of both sides
       `router/*`, `moe_gspo.routing.router_diag`;
    2. the step's replay plan (`Learner.plan_replay`, `moe_gspo.learner.replay_plan`): the rollout routes
       checked row by row once; where the mode replays them (R3: `r3/*`; missing or malformed rows take the
       natural routes of pass 1, `moe_gspo.routing.replay_checks`; a warning once per run above
       `algo.r3_fallback_warn_frac`), the old-policy pass replaying them → pi_old of the loss,
       `mismatch_replayed/*` and the replay contract `r3/replay_mismatch_frac` (`check_replay_contract`;
       a stop above `algo.r3_max_mismatch`); the update and the reference pass replay what the plan says;
    3. rollout corrections (`rollout_corr/*`) from pi_old vs pi_rollout, reference log-probs when
       `algo.kl_coef > 0` (steps 1-3: `old_policy_pass`, all they hand on in one `OldPolicyPass`);
    4. the update (`Learner.train_step(batch, old_pass)`; `algo.opsm` masks sequences there,
       `rollout_corr/opsm_*`), with the drift probe every `logging.update_drift_every` steps (`update/*`
       after the first optimizer step, `update_all_minibatches/*` after all).

    `timer` gets the phases old_logp, compare (the rollout-vs-learner metrics), replayed_logp,
    reference, update and drift (the probe's passes, also the one inside the update, are charged to
    drift).
    """
    learner, drift_every = policy.learner, cfg.logging.update_drift_every
    timer = timer if timer is not None else PhaseTimer()
    old, metrics = old_policy_pass(cfg, policy, batch, samples, step, reference=reference, timer=timer)
    natural = old.natural
    probe = (UpdateDriftProbe(learner, batch, natural.routes, policy.num_experts)
             if drift_every and step % drift_every == 0 else None)
    learner.optimizer.set_lr(lr_at(step, **cfg.train.lr_schedule()))  # logged by train_step as train/lr
    t0 = time.perf_counter()
    metrics.update(learner.train_step(batch, old, after_optimizer_step=probe.after_optimizer_step if probe else None))
    inside = probe.seconds if probe is not None else 0.0
    timer.add("update", time.perf_counter() - t0 - inside)
    new = None
    if probe is not None:
        timer.add("drift", inside)
        with timer("drift"):
            new = probe.finish()
            metrics.update(probe.metrics())
    return StepPasses(metrics=metrics, old=natural, new=new, replayed_logp_BS=old.replayed_logp_BS,
                      rollout_routes=old.rollout_routes)


def old_policy_pass(cfg: Config, policy, batch: PackedBatch, samples, step: int, *,
                    reference: ReferencePolicy | None = None, timer: PhaseTimer | None = None
                    ) -> tuple[OldPolicyPass, dict]:
    """Steps 1-3 of `learner_update`: the passes before the update and what they hand to it, as one
    `OldPolicyPass` (the natural pass with its routes and, with `train.fuse_old_logp_pass`, its kept graph;
    pi_old; the step's `ReplayPlan`; the reference log-probs; the rollout corrections), and the step's
    metrics so far. `timer`: the phases old_logp, compare, replayed_logp, reference."""
    learner = policy.learner
    spec = learner.replay_spec
    timer = timer if timer is not None else PhaseTimer()
    with timer("old_logp"):  # train.fuse_old_logp_pass: its graph also serves the first mini-batch's update
        natural = learner.compute_logprobs(batch, record_routes=True, no_replay=True, keep_graph=fuse_old_pass(cfg),
                                           with_entropy=True)
    with timer("compare"):
        plan = learner.plan_replay(batch, old_pass_routes=natural.routes)
        metrics = {"actor/entropy": mean_token_entropy(natural.entropy_BS, batch.response_mask_BS), **plan.metrics}
        metrics.update(rollout_vs_learner(rollout_logp_BS=batch.rollout_logp_BS, learner_logp_BS=natural.logp_BS,
                                     response_mask_BS=batch.response_mask_BS, rollout_routes=plan.comparable_routes,
                                     learner_routes=natural.routes, num_experts=policy.num_experts,
                                     group_ids=[s.prompt_index for s in samples]))
        metrics.update(step_router_diagnostics(samples, natural, batch.response_mask_BS,
                                               num_experts=policy.num_experts,
                                               margin_threshold=cfg.logging.router_margin_threshold))
        metrics["router/dead_experts"] = count_dead_experts(learner, batch, natural.routes,
                                                            window=cfg.logging.dead_expert_window)
    if spec.replays_rollout:
        warn_r3_fallback(learner, plan.metrics, cfg.algo.r3_fallback_warn_frac, step)
    old_logp = natural.logp_BS
    if spec.source(LearnerPass.PI_OLD) is not RouteSource.NONE:
        with timer("replayed_logp"):  # records what its routers used: the replay contract (r3/replay_mismatch_frac)
            replayed = learner.compute_logprobs(batch, replay_routes=plan.routes(LearnerPass.PI_OLD),
                                                record_routes=True)
            old_logp = replayed.logp_BS
            metrics.update(replayed_mismatch(rollout_logp_BS=batch.rollout_logp_BS, replayed_logp_BS=old_logp,
                                             response_mask_BS=batch.response_mask_BS))
            metrics.update(check_replay_contract(plan, replayed.routes, max_mismatch=cfg.algo.r3_max_mismatch,
                                                 step=step))
            del replayed
    is_weights, rs_keep, corr_metrics = step_correction(cfg.algo, batch, old_logp)
    metrics.update(corr_metrics)
    ref_logp = None
    if reference is not None:
        with timer("reference"):
            ref_logp = reference.logprobs(batch, plan)
    fused, natural.fused = natural.fused, None  # the kept graph goes to the update only
    old = OldPolicyPass(logp_BS=old_logp, natural=natural, replay=plan, ref_logp_BS=ref_logp,
                        is_weights_BS=is_weights, rs_keep_BS=rs_keep, fused=fused)
    return old, metrics


def count_dead_experts(learner, batch: PackedBatch, natural_routes: list, *, window: int) -> int:
    """`router/dead_experts`: (MoE layer, expert) pairs to which the learner's old-policy pass (natural routing)
    routed no token of the rows that produce response log-probs (those of `routing/*`) in the last `window` steps,
    this one included (`logging.dead_expert_window`; fewer at the run's start); the window lives on the
    learner (`Learner.expert_usage`, checkpointed). Call once per step."""
    from moe_gspo.routing.expert_usage import expert_token_counts

    lo, hi = response_rows(*response_spans(batch.response_mask_BS))
    counts = expert_token_counts(natural_routes, lo, hi, num_layers=len(learner.layer_ids),
                                 num_experts=learner.num_experts)
    return learner.expert_usage.update(counts, window)


def check_replay_contract(plan: ReplayPlan, used_routes: list, *, max_mismatch: float | None,
                          step: int) -> dict[str, float]:
    """R3's replay contract, checked in the learner's forward: `r3/replay_mismatch_frac`, the share of the
    replayed (token, layer) rows whose experts in the replayed old-policy pass (`used_routes`, recorded by the
    router hooks from the routing map the dispatcher uses) differ from the routes the plan gave it
    (`plan.routes(LearnerPass.PI_OLD)`); rows that fell back to natural routing (the plan's row-by-row check,
    `plan.route_reasons`) are not counted (`r3/fallback_*` counts them;
    `moe_gspo.routing.replay_checks.replay_mismatch`). 0 when replay works. Above `algo.r3_max_mismatch`
    (None = never) the run stops (ValueError, one line naming the step and the share) before the update
    trains on a pi_old that did not replay the rollout routes. Every rank holds the same global routes,
    so every rank stops alike."""
    from moe_gspo.routing.replay_checks import REPLAY_MISMATCH_KEY, replay_mismatch

    out = replay_mismatch(plan.routes(LearnerPass.PI_OLD), used_routes, plan.route_reasons)
    frac = out[REPLAY_MISMATCH_KEY]
    if max_mismatch is not None and frac > max_mismatch:
        raise ValueError(f"step {step}: R3 replay contract broken: {frac:.2%} of the replayed (token, MoE layer) rows "
                         f"ran other experts than the rollout routes they replayed ({REPLAY_MISMATCH_KEY}={frac:.4g} > "
                         f"algo.r3_max_mismatch={max_mismatch:g}); the learner's router replay is not applying the "
                         f"engine's routes (check the replay row order and the routes' layer order)")
    return out


def warn_r3_fallback(learner, r3_metrics: dict, threshold: float, step: int) -> None:
    """One warning per run (rank 0; every rank sees the same global batch) the first time the step's
    `r3/fallback_token_frac` exceeds `algo.r3_fallback_warn_frac`."""
    from moe_gspo.routing.replay_checks import REASONS
    from moe_gspo.run.errors import warn_once

    frac = r3_metrics.get("r3/fallback_token_frac", math.nan)
    if learner.r3_fallback_warned or not frac > threshold:
        return
    learner.r3_fallback_warned = True
    reasons = ", ".join(f"{r} {int(r3_metrics[f'r3/fallback_rows_{r}'])}" for r in REASONS
                        if r3_metrics.get(f"r3/fallback_rows_{r}"))
    warn_once(f"R3, step {step}: {frac:.2%} of the replayed token rows had no usable rollout route ({reasons} rows) "
              f"and replayed the learner's own routing instead (r3/fallback_token_frac > "
              f"algo.r3_fallback_warn_frac={threshold}); check the engine's routes (prefix caching / route "
              "omission, merged or prefix-only requests). Warned once per run.", is_main=learner.parallel.is_main)

"""The learner's log-prob pass (`Learner.compute_logprobs`) and what the old-policy side of an RL step
hands to the update (`OldPolicyPass`, consumed by `Learner.train_step`).

`logprob_pass` runs one pass over the global batch: this rank's shard (`moe_gspo.learner.batch.plan_shards`)
micro-batch by micro-batch, optionally replaying given routes and recording the learner's routing (with the
router recorder it is given), the results gathered over the data-parallel ranks. It uses the Learner's
public pass helpers only; the caller (`Learner.compute_logprobs`) sets the model's train/eval mode.
With `keep_graph` (`train.fuse_old_logp_pass`) it runs in train mode in two pieces and returns the first
mini-batch's piece with its graph (`LogprobResult.fused`, `moe_gspo.learner.backward.FusedPass`), which the
update back-propagates instead of a new forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_gspo.learner.backward import FusedPass
from moe_gspo.learner.batch import PackedBatch, ShardPlan, split_first_minibatch
from moe_gspo.learner.logprobs import token_logprobs
from moe_gspo.learner.replay_plan import ReplayPlan
from moe_gspo.routing.trace import ids_dtype


@dataclass
class LogprobResult:
    """Output of `Learner.compute_logprobs` (global batch, host tensors)."""

    logp_BS: torch.Tensor
    """float32 [B, S] token-aligned log-probs (0 at position 0 and past each sequence's end)."""
    routes: list[np.ndarray] | None = None
    """B arrays [seq_len_b, L, K] (`moe_gspo.routing.trace.ids_dtype`) of the learner's top-k experts, when recorded."""
    probs: list[np.ndarray] | None = None
    """B arrays [seq_len_b, L, K] float32 full-softmax router probabilities of those experts."""
    router_stats: list[np.ndarray] | None = None
    """B arrays [seq_len_b, L, 2] float32 router margin (k-th minus (k+1)-th logit) and router entropy
    (nats) per token and MoE layer, recorded with the routes (`moe_gspo.routing.router_stats`)."""
    entropy_BS: torch.Tensor | None = None
    """float32 [B, S] entropy (nats) of the distribution that predicted each token, aligned like
    `logp_BS`, when asked for (`with_entropy=True`)."""
    fused: FusedPass | None = None
    """With `keep_graph=True`: this rank's piece of the pass kept with its graph (the first mini-batch's
    rows), for the next `Learner.train_step` on this batch (`OldPolicyPass.fused`); else None."""



@dataclass(frozen=True, kw_only=True)
class OldPolicyPass:
    """What the old-policy side of an RL step produces for the update, handed to `Learner.train_step` as its
    one argument besides the batch (built by `moe_gspo.run.learner_passes.old_policy_pass`; a test may give
    only `logp_BS`). Global batch, host tensors; `train_step` changes nothing in it."""

    logp_BS: torch.Tensor
    """[B, S] token-aligned log-probs of pi_old in the loss: the natural pass's, or (R3) those of the pass that
    replays `replay.routes(LearnerPass.PI_OLD)`."""
    natural: LogprobResult | None = None
    """The old-policy pass with the learner's natural routing: its log-probs, routes (which R2 replays),
    router probabilities and stats, entropies (`actor/entropy`)."""
    replay: ReplayPlan | None = None
    """The step's routing replay plan (`Learner.plan_replay`): the routes the update and the reference pass
    replay, the row-by-row check of the rollout routes and its `r3/*` metrics. None: `train_step` plans it
    from the batch and `natural`."""
    ref_logp_BS: torch.Tensor | None = None
    """[B, S] the frozen reference policy's log-probs (needed with `algo.kl_coef > 0`)."""
    is_weights_BS: torch.Tensor | None = None
    """[B, S] rollout-correction IS weights of each token's policy-gradient term (`rollout_corr/*`)."""
    rs_keep_BS: torch.Tensor | None = None
    """[B, S] bool rollout-correction rejection: False removes the token from the loss and the normalisation."""
    fused: FusedPass | None = None
    """The natural pass's piece kept with its graph (`compute_logprobs(keep_graph=True)`,
    `train.fuse_old_logp_pass`): the update's first mini-batch back-propagates through it, which frees the
    graph (a second `train_step` with it is refused)."""

    @property
    def rollout_routes(self) -> list[np.ndarray] | None:
        """The engine's routes for comparisons and traces, each cut at its first missing or malformed row
        (`ReplayPlan.comparable_routes`); None when not recorded (or no plan). Not used by the update."""
        return None if self.replay is None else self.replay.comparable_routes

    @property
    def replayed_logp_BS(self) -> torch.Tensor | None:
        """Under R3 (pi_old is not the natural pass's), the replayed pass's log-probs; else None."""
        return None if self.natural is None or self.logp_BS is self.natural.logp_BS else self.logp_BS


def check_fusable(learner, routes_in: list | None, plan: ShardPlan) -> None:
    """Refuse `compute_logprobs(keep_graph=True)` where the kept graph could not serve the update."""
    if learner.optimizer is None:
        raise ValueError("compute_logprobs(keep_graph=True) needs a training Learner (train=...)")
    if routes_in is not None or not learner.replay_spec.fusable:
        raise ValueError("compute_logprobs(keep_graph=True): the fused pass must route naturally (replay none "
                         "or r2, no replay_routes); R3's update replays the rollout routes, which this pass "
                         "does not")
    if learner.recompute:
        raise ValueError("compute_logprobs(keep_graph=True) with activation recompute: not supported")
    if len(plan.micro_batches) != 1:
        raise ValueError(f"compute_logprobs(keep_graph=True) needs one micro-batch per rank, got "
                         f"{len(plan.micro_batches)}: set train.micro_batch_size=0 (or fuse_old_logp_pass=false)")


def device_ids_dtype(num_experts: int) -> torch.dtype:
    """The device dtype of recorded expert ids while they are gathered over the data-parallel ranks
    (`moe_gspo.routing.trace.ids_dtype(num_experts, collective=True)`, as a torch dtype)."""
    return getattr(torch, ids_dtype(num_experts, collective=True).name)


def logprob_pass(learner, recorder, batch: PackedBatch, plan: ShardPlan, routes_in: list | None, *, record: bool,
                 record_routes: bool, keep_graph: bool, with_entropy: bool = False, num_train_steps: int = 0
                 ) -> tuple[LogprobResult, list[np.ndarray] | None]:
    """The log-prob pass of `Learner.compute_logprobs` over the global `batch`, this rank's shard per `plan`
    (replaying `routes_in`, B arrays [T_b, L, K], when given), the model already in train mode iff
    `keep_graph`. `recorder`: the learner's `MegatronRouterRecorder`. `record`: record the routing (returned
    as the second value, B arrays [T_b, L, K]; also set on the result with `record_routes`). `keep_graph`:
    in two pieces, the first mini-batch's rows with autograd: their graph is the result's `fused` (check it
    first with `check_fusable`), stamped with `num_train_steps` (the learner's updates so far). Collective
    over the learner's ranks."""
    local, local_routes, _ = learner.local_shard(batch.to(learner.device), plan, routes_in)
    S = batch.seq_len_padded
    L, K = len(learner.layer_ids), learner.top_k
    logp_local = torch.zeros((plan.num_rows, S), dtype=torch.float32, device=learner.device)
    ent_local = torch.zeros((plan.num_rows, S), dtype=torch.float32, device=learner.device) if with_entropy else None
    ids_dtype_dev = device_ids_dtype(learner.num_experts)  # gathered over the ranks below
    ids_local = torch.zeros((plan.num_rows, S, L, K), dtype=ids_dtype_dev, device=learner.device) if record else None
    probs_local = torch.zeros((plan.num_rows, S, L, K), dtype=torch.float32, device=learner.device) if record else None
    stats_local = torch.zeros((plan.num_rows, S, L, 2), dtype=torch.float32, device=learner.device) if record else None
    kept, routes = None, None
    if keep_graph:  # the first mini-batch's rows with autograd (kept for its update), the rest without
        first_rows = learner.minibatch_indices(batch.num_seqs)[0]
        first, rest = split_first_minibatch(batch.seq_lens_B.tolist(), first_rows,
                                            dp_rank=learner.parallel.dp_rank, dp_size=learner.parallel.dp_size)
        pieces = [(p.rows, p.num_pad, p.seq_len, grad) for p, grad in ((first, True), (rest, False)) if p is not None]
    else:
        pieces = [(np.arange(mb.start, mb.stop), 0, mb.seq_len, False) for mb in plan.micro_batches]
    recorder.clear()
    recorder.enabled = record
    lens_local = local.seq_lens_B.tolist()  # host metadata (`PackedBatch.to`): no device sync
    try:
        for rows_np, num_pad, S_i, grad in pieces:
            rows = torch.as_tensor(rows_np, dtype=torch.long, device=learner.device)
            ids = local.input_ids_BS[rows, :S_i]
            if num_pad:  # rows of padding tokens: the same shapes on every rank
                ids = torch.cat([ids, ids.new_full((num_pad, S_i), local.pad_id)])
            seq_lens = [lens_local[j] for j in rows_np] + [0] * num_pad
            mb_routes = None if local_routes is None else [local_routes[int(j)] for j in rows_np]
            with torch.set_grad_enabled(grad), learner.replay_context(mb_routes, seq_lens, S_i):
                logits = learner.forward(ids)
                logp, ent = token_logprobs(logits, ids, with_entropy=with_entropy,
                                           support=local.support_index(rows_np, learner.device))
            n = len(rows_np)
            if ent is not None:
                ent_local[rows, :S_i] = ent[:n].detach()
            if grad:
                kept = FusedPass(batch=batch, graph_rows=plan.indices[rows_np], logp_graph=logp,
                                 ent_graph=ent, logp_BS=torch.empty(0), num_train_steps=num_train_steps,
                                 first_rows=first_rows)
            logp_local[rows, :S_i] = logp[:n].detach()
            if record:
                assert recorder.num_calls() == 1, recorder.num_calls()
                B_i = n + num_pad
                for stacked, what in ((ids_local, "ids"), (probs_local, "probs"), (stats_local, "stats")):
                    seqs = recorder.to_sequences([S_i] * B_i, B_i, S_i, probs=what == "probs",
                                                      stats=what == "stats")[:n]
                    if n:
                        stacked[rows, :S_i] = torch.from_numpy(np.stack(seqs)).to(learner.device, stacked.dtype)
                recorder.clear()
    finally:
        recorder.enabled = False
        recorder.clear()
    B = batch.num_seqs
    logp = learner.gather_rows(logp_local, B).cpu()
    logp = torch.where(torch.arange(S)[None, :] < batch.seq_lens_B.cpu()[:, None], logp, 0.0)
    result = LogprobResult(logp_BS=logp)
    if with_entropy:
        ent = learner.gather_rows(ent_local, B).cpu()
        result.entropy_BS = torch.where(torch.arange(S)[None, :] < batch.seq_lens_B.cpu()[:, None], ent, 0.0)
    if record:
        lens = batch.seq_lens_B.tolist()
        id_dtype = ids_dtype(learner.num_experts)
        all_ids = learner.gather_rows(ids_local, B).cpu().numpy()
        all_probs = learner.gather_rows(probs_local, B).cpu().numpy()
        all_stats = learner.gather_rows(stats_local, B).cpu().numpy()
        routes = [np.ascontiguousarray(all_ids[b, :n].astype(id_dtype)) for b, n in enumerate(lens)]
        probs = [all_probs[b, :n].copy() for b, n in enumerate(lens)]  # copies: a view would keep [B, S] alive
        if record_routes:
            result.routes, result.probs = routes, probs
            result.router_stats = [all_stats[b, :n].copy() for b, n in enumerate(lens)]
    if kept is not None:
        kept.logp_BS, kept.entropy_BS = result.logp_BS, result.entropy_BS
        result.fused = kept
    return result, (routes if record else None)


"""The learner's per-mini-batch backward passes (`Learner.train_step`): forward + backward of this rank's
shard micro-batch by micro-batch, or the backward of the first mini-batch through the old-policy pass kept
with its graph (`train.fuse_old_logp_pass`, `Learner.compute_logprobs(keep_graph=True)`, handed to the
update as `LogprobResult.fused` / `OldPolicyPass.fused`).

Both take the `Learner` and use only its public pass helpers (`local_shard`, `replay_context`, `forward`,
`gather_rows`, and its `parallel`, `train`, `algo`, `device`), and `loss_on(logp, rows, S, mask, ent)`,
which returns `(loss, scaled loss to back-propagate, metrics)` for rows of the mini-batch, and return
`(finite, global log-probs [B_mini, S], their entropies or None, the loss metrics when one piece covered
the whole mini-batch, else None)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_gspo.learner.batch import PackedBatch, plan_shards
from moe_gspo.learner.logprobs import token_logprobs


@dataclass
class FusedPass:
    """The first-mini-batch piece of an old-policy pass, kept with its graph (`compute_logprobs(keep_graph=True)`
    returns it as `LogprobResult.fused`; `Learner.train_step` takes it explicitly, `OldPolicyPass.fused`)."""

    batch: PackedBatch
    """The caller's batch object: `train_step` refuses the piece for any other batch object."""
    graph_rows: np.ndarray
    """Global row of each real row of the graph piece (this rank's rows of the first mini-batch)."""
    logp_graph: torch.Tensor
    """[rows + padding rows, S_0] the piece's token log-probs with their graph."""
    logp_BS: torch.Tensor
    """[B, S] the global log-probs of the whole pass (detached, host)."""
    ent_graph: torch.Tensor | None = None
    """[rows + padding rows, S_0] the piece's token entropies with their graph (a pass with `with_entropy=True`)."""
    entropy_BS: torch.Tensor | None = None
    """[B, S] the global entropies of the pass (detached, host), with `ent_graph`."""
    first_rows: np.ndarray | None = None
    """The global rows of the first mini-batch the pass was split for (the same on every rank)."""
    num_train_steps: int = 0
    """`Learner.num_train_steps` when the pass ran: `train_step` refuses the piece after another update."""


def set_router_aux_loss_scale(learner, num_micro_batches: int) -> None:
    """With `algo.router_aux_loss` on: the gradient scale of Megatron's router load-balancing loss for the
    next backward passes, 1 / this rank's micro-batches of the mini-batch (Megatron-LM sets loss_scale /
    num_microbatches), so that after DDP's average over data-parallel ranks the gradient is that of
    coef x the mean per-micro-batch aux loss. Nothing is touched without it."""
    if learner.algo.router_aux_loss == "none":
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / max(num_micro_batches, 1), device=learner.device))
    learner.aux_loss_forwards += num_micro_batches  # the forwards that add to Megatron's tracker (loss/router_aux)


def backward_minibatch(learner, mini: PackedBatch, routes, mask_all, loss_on):
    """Forward + backward of this rank's shard of `mini`, micro-batch by micro-batch. Returns (finite,
    the global log-probs [B_mini, S], their entropies (algo.entropy_coef > 0, else None), the loss
    metrics when one piece covered all)."""
    plan = plan_shards(mini.seq_lens_B.tolist(), dp_rank=learner.parallel.dp_rank, dp_size=learner.parallel.dp_size,
                       micro_batch_size=learner.train.micro_batch_size)
    local, local_routes, (keep_l,) = learner.local_shard(mini, plan, routes, mask_all)
    lens_local = local.seq_lens_B.tolist()  # host metadata (`PackedBatch.to`): no device sync
    logp_local = torch.zeros(keep_l.shape, dtype=torch.float32, device=learner.device)
    with_entropy = learner.algo.entropy_coef > 0
    ent_local = torch.zeros_like(logp_local) if with_entropy else None
    finite_t, m_all = torch.ones((), dtype=torch.bool, device=learner.device), None  # read once, after the loop
    whole = learner.parallel.dp_size == 1 and len(plan.micro_batches) == 1
    set_router_aux_loss_scale(learner, len(plan.micro_batches))
    for mb in plan.micro_batches:
        rows, S_i = slice(mb.start, mb.stop), mb.seq_len
        ids = local.input_ids_BS[rows, :S_i]
        mb_routes = None if local_routes is None else local_routes[rows]
        # the micro-batch's real rows (before any padding rows) are rows plan.indices[rows] of `mini`
        global_rows = torch.as_tensor(plan.indices[rows], dtype=torch.long, device=learner.device)
        n_real = global_rows.numel()
        with learner.replay_context(mb_routes, lens_local[rows], S_i) as handle:
            logp, ent = token_logprobs(learner.forward(ids), ids, with_entropy=with_entropy,
                                       support=local.support_index(range(mb.start, mb.stop), learner.device))
            if n_real:
                loss, scaled, m = loss_on(logp[:n_real], global_rows, S_i, keep_l[rows, :S_i][:n_real],
                                          None if ent is None else ent[:n_real])
            else:  # a padding-only micro-batch: no loss, but every rank runs the backward (EP collectives)
                loss = scaled = logp.sum() * 0.0
                m = None
            if handle is not None:
                handle.backward(scaled)
            else:
                scaled.backward()
        finite_t &= torch.isfinite(loss.detach())
        logp_local[rows, :S_i] = logp.detach()
        if ent is not None:
            ent_local[rows, :S_i] = ent.detach()
        if whole:
            m_all = m
    ent_all = None if ent_local is None else learner.gather_rows(ent_local, mini.num_seqs)
    return bool(finite_t), learner.gather_rows(logp_local, mini.num_seqs), ent_all, m_all


def backward_fused(learner, fused: FusedPass, idx: np.ndarray, mask_all, loss_on):
    """Backward of the first mini-batch (global rows `idx`) through the kept piece of the old-policy pass:
    this rank's rows of its shard that belong to the mini-batch (possibly none: a zero loss, still
    back-propagated, as expert parallelism's backward is collective)."""
    pos = {int(g): j for j, g in enumerate(fused.graph_rows)}
    set_router_aux_loss_scale(learner, 1)
    sel = [(k, pos[int(g)]) for k, g in enumerate(idx) if int(g) in pos]
    S0 = fused.logp_graph.shape[1]
    with_entropy = fused.ent_graph is not None and learner.algo.entropy_coef > 0
    m_all = None
    if sel:
        k_rows = torch.as_tensor([k for k, _ in sel], dtype=torch.long, device=learner.device)
        j_rows = torch.as_tensor([j for _, j in sel], dtype=torch.long, device=learner.device)
        ent = fused.ent_graph[j_rows] if with_entropy else None
        loss, scaled, m = loss_on(fused.logp_graph[j_rows], k_rows, S0, mask_all[k_rows, :S0], ent)
        if learner.parallel.dp_size == 1:
            m_all = m
    else:
        loss = scaled = fused.logp_graph.sum() * 0.0
    scaled.backward()
    rows = torch.as_tensor(idx, dtype=torch.long)
    logp_all = fused.logp_BS[rows].to(learner.device)
    ent_all = fused.entropy_BS[rows].to(learner.device) if with_entropy else None
    return bool(torch.isfinite(loss.detach())), logp_all, ent_all, m_all

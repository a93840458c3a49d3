"""The learner's per-mini-batch backward passes (`Learner.train_step`): forward + backward of this rank's
shard micro-batch by micro-batch, or the backward of the first mini-batch through the old-policy pass kept
with its graph (`train.fuse_old_logp_pass`, `Learner.compute_logprobs(keep_graph=True)`, handed to the
update as `LogprobResult.fused` / `OldPolicyPass.fused`).

Both take the `Learner` only for its public pass helpers (`local_shard`, `replay_context`, `forward`,
`gather_rows`, `parallel`, `device`); what else they need comes as arguments: the shard plan, the routes,
`with_entropy`, and `loss_on(logp, rows, S, mask, ent)`, which returns `(loss, scaled loss to
back-propagate, metrics)` for rows of the mini-batch. They return `(finite, global log-probs [B_mini, S],
their entropies or None, the loss metrics when one piece covered the whole mini-batch, else None)`. The
Learner sets the router aux-loss scale before calling them (`Learner._scale_router_aux_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_gspo.learner.batch import PackedBatch, ShardPlan
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


def backward_minibatch(learner, mini: PackedBatch, plan: ShardPlan, routes, mask_all, loss_on, *,
                       with_entropy: bool):
    """Forward + backward of this rank's shard of `mini` per `plan` (`plan_shards` of the mini-batch),
    micro-batch by micro-batch, replaying `routes` (B_mini arrays, or None). Returns (finite, the global
    log-probs [B_mini, S], their entropies (`with_entropy`, else None), the loss metrics when one piece
    covered all)."""
    local, local_routes, (keep_l,) = learner.local_shard(mini, plan, routes, mask_all)
    lens_local = local.seq_lens_B.tolist()  # host metadata (`PackedBatch.to`): no device sync
    logp_local = torch.zeros(keep_l.shape, dtype=torch.float32, device=learner.device)
    ent_local = torch.zeros_like(logp_local) if with_entropy else None
    finite_t, m_all = torch.ones((), dtype=torch.bool, device=learner.device), None  # read once, after the loop
    whole = learner.parallel.dp_size == 1 and len(plan.micro_batches) == 1
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


def backward_fused(learner, fused: FusedPass, idx: np.ndarray, mask_all, loss_on, *, with_entropy: bool):
    """Backward of the first mini-batch (global rows `idx`) through the kept piece of the old-policy pass:
    this rank's rows of its shard that belong to the mini-batch (possibly none: a zero loss, still
    back-propagated, as expert parallelism's backward is collective). `with_entropy`: the loss takes the
    piece's entropies (when it kept them)."""
    pos = {int(g): j for j, g in enumerate(fused.graph_rows)}
    sel = [(k, pos[int(g)]) for k, g in enumerate(idx) if int(g) in pos]
    S0 = fused.logp_graph.shape[1]
    with_entropy = fused.ent_graph is not None and with_entropy
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

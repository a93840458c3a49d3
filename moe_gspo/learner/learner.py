"""The Megatron-core learner: old-policy log-probs, the GSPO/GRPO update step, Routing Replay.

Data layout and sharding: every rank passes the same *global* `PackedBatch` (see `batch.py`). Passes
over a batch shard it contiguously over the data-parallel ranks (`plan_shards`), pad the shards with
dummy rows so that expert-parallel ranks run identical shapes, and gather the per-token results back,
so every rank returns global values.

The update (`train_step`): the batch is cut into `train.num_minibatches` contiguous mini-batches, one
optimizer step each; every rank processes its shard of a mini-batch in micro-batches of
`train.micro_batch_size` sequences. `policy_loss` averages over the sequences (tokens, for the
token-mean aggregation) of one micro-batch; the micro-batch loss is weighted by `count_mb * dp_size / count_global`
before backward, so after Megatron DDP's gradient reduction (which averages over data-parallel ranks,
expert gradients included) the gradient is that of the loss averaged over the whole mini-batch: EP=2 /
DP=2 equals EP=1 on the full batch up to float rounding. Then: gradient sync (`finish_grad_sync`),
global gradient norm, a NaN/Inf guard agreed on by all ranks (a non-finite loss or norm anywhere skips
that optimizer step everywhere, counted in `train/skipped_steps`), clipping, the optimizer step.
The logged `loss/*`, `clip/*`, `ratio/*` metrics are recomputed without gradient on the gathered global
mini-batch, so rank 0 logs exact global values; mini-batch values are averaged over the steps that
were not skipped. Rollout corrections (`moe_gspo.algos.rollout_correction`) enter as per-token weights
on the policy-gradient term and a rejection mask and-ed into the response mask (also in the
normalisation counts); off-policy sequence masking (`algo.opsm`) is a 0/1 weight on the
policy-gradient term computed in every micro-batch from the current log-probs (normalisation
unchanged); a caller's `after_optimizer_step` hook runs after each optimizer step (the routing-drift
probe of `moe_gspo.run.learner_passes` measures the routing after the first one).

Routing Replay: the mode (`algo.routing_replay`) is a `moe_gspo.learner.replay_plan.ReplayModeSpec`, which
says which routes each pass replays (R2: the update replays the old-policy pass's routes; R3: pi_old and
the update replay the rollout engine's routes, checked row by row, failed rows taking the old pass's).
`plan_replay` builds the step's `ReplayPlan` from the mode and the batch, once; the passes ask it for
their routes. Replay tensors are built per micro-batch with `moe_gspo.routing.align.build_replay_topk`
from the routes of exactly that micro-batch's sequences (`replay.py` drives upstream's RouterReplay).

Hand-offs (`old_pass.py`): `compute_logprobs` returns a `LogprobResult` (with `keep_graph=True` also the
kept first-mini-batch piece, `.fused`); `train_step(batch, old)` takes what the old-policy side produced
as one `OldPolicyPass` (pi_old, the natural pass, the replay plan, reference log-probs, rollout-correction
weights and mask, the kept piece) and changes neither. The log-prob pass itself is `old_pass.logprob_pass`,
the per-mini-batch backward passes `backward.py`; both take what they need as arguments and use only the
public pass helpers below (`forward`, `replay_context`, `local_shard`, `gather_rows`, `minibatch_indices`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from moe_gspo.algos import policy_loss
from moe_gspo.algos.aggregation import num_units, piece_weight
from moe_gspo.algos.rollout_correction import DEFAULT_OPSM_DELTA, opsm_mask
from moe_gspo.config import AlgoConfig, TrainConfig
from moe_gspo.learner.backward import FusedPass, backward_fused, backward_minibatch
from moe_gspo.learner.batch import PackedBatch, ShardPlan, plan_shards
from moe_gspo.learner.old_pass import LogprobResult, OldPolicyPass, check_fusable, logprob_pass
from moe_gspo.learner.offload import LearnerOffload
from moe_gspo.learner.optim import LearnerOptimizer, any_rank, resolve_optimizer_options
from moe_gspo.learner.replay import RoutingReplayDriver
from moe_gspo.learner.replay_plan import LearnerPass, ReplayPlan, RouteSource, build_replay_plan, replay_spec
from moe_gspo.learner.router_hooks import MegatronRouterRecorder
from moe_gspo.mcore.model import TrainModeSwitch, forward_logits, moe_layer_ids, moe_routers, unwrap
from moe_gspo.mcore.parallel import ParallelInfo
from moe_gspo.routing.align import build_replay_topk
from moe_gspo.routing.expert_usage import ExpertUsageWindow


def skip_stop_message(algo_name: str, metrics: dict[str, float], limit: int) -> str:
    """The one line that stops a run whose last `limit` optimizer steps were all skipped by the NaN/Inf guard,
    naming the loss and the non-finite values of the last one (`metrics`: its `loss/*` and `grad/norm`)."""
    bad = [f"{k}={v}" for k, v in metrics.items() if k.startswith("loss/") and not math.isfinite(v)]
    norm = metrics.get("grad/norm")
    if norm is not None and not math.isfinite(norm):
        bad.append(f"grad/norm={norm}")
    what = ", ".join(bad) or "the loss on another rank"
    return (f"train.max_consecutive_skips={limit}: the last {limit} optimizer steps were all skipped by the NaN/Inf "
            f"guard, so the weights did not change; the loss algo.name={algo_name} was not finite ({what}). Fix the "
            "loss (or what makes it NaN/Inf: lower train.lr, set train.grad_clip > 0), or raise "
            "train.max_consecutive_skips (0 = never stop)")


class Learner:
    """Megatron `GPTModel` + DDP + optimizer + routing replay for GSPO / GRPO updates."""

    def __init__(self, model, hf_config, *, parallel: ParallelInfo, algo: AlgoConfig, train: TrainConfig | None,
                 recompute: bool = False):
        """`train=None` builds an inference-only learner (log-probs and routes, as in `moe_gspo.probe`):
        no DDP gradient buffers and no optimizer state are allocated, and `train_step` is refused. The
        routing replay mode is `algo.routing_replay` (`self.replay_spec`)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.model = unwrap(model)
        self.hf_config = hf_config
        self.parallel = parallel
        self.algo = algo
        self.train = train
        self.replay_spec = replay_spec(algo.routing_replay)
        """The routing replay mode: which routes each pass replays (`moe_gspo.learner.replay_plan`)."""
        model_recompute = getattr(self.model.config, "recompute_granularity", None) == "full"
        if bool(recompute) != model_recompute:
            raise ValueError(f"Learner(recompute={recompute}) but the model was built with recompute="
                             f"{model_recompute}; pass the same value to build_gpt_model and Learner")
        self.recompute = bool(recompute)
        self.device = parallel.device
        self.vocab_size = int(hf_config.vocab_size)
        if train is None:
            self.ddp, self.optimizer = self.model, None
        else:
            # Megatron's memory options (distributed optimizer, CPU offload, ...), see learner/optim.py.
            opts = resolve_optimizer_options(train, on_cuda=self.device.type == "cuda")
            if isinstance(model, DistributedDataParallel):
                self.ddp = model
            else:
                ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=opts.grad_reduce_in_fp32,
                                                           overlap_grad_reduce=False,
                                                           use_distributed_optimizer=opts.distributed_optimizer)
                self.ddp = DistributedDataParallel(config=self.model.config, ddp_config=ddp_config, module=self.model)
            self.optimizer = LearnerOptimizer(self.ddp, lr=train.lr, weight_decay=train.weight_decay,
                                              betas=(train.adam_beta1, train.adam_beta2), grad_clip=train.grad_clip,
                                              options=opts)
            self.offload = LearnerOffload(self.ddp, self.optimizer.opt if self.optimizer.use_megatron else None,
                                          mode=opts.offload_during_rollout,
                                          move_optimizer=not opts.precision_aware_optimizer)
            self.offload.release_grads()  # train.offload_during_rollout: no gradient memory until the first update
        self.set_train_mode = TrainModeSwitch(self.ddp)
        """`self.ddp.train(mode)` without walking the modules at every switch (`moe_gspo.mcore.model`)."""
        self.recorder = MegatronRouterRecorder(self.model, record_probs=True, record_stats=True, enabled=False)
        routers = moe_routers(self.model)
        self.replay_driver = (RoutingReplayDriver(self.model, recompute=self.recompute)
                              if all(r.router_replay is not None for r in routers) else None)
        self.replay_spec.check_model(has_replay=self.replay_driver is not None)
        self.top_k = self.recorder.top_k
        self.num_experts = self.recorder.num_experts
        self.layer_ids = moe_layer_ids(hf_config)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        """Optimizer steps skipped by the NaN/Inf guard since the last one applied (`train.max_consecutive_skips`)."""
        self.num_updates = 0
        self.r3_fallback_warned = False
        """Whether this run warned about R3 fallback rows (`moe_gspo.run.learner_passes.warn_r3_fallback`)."""
        self.aux_loss_forwards = 0
        """Update forwards since the last `train_step` that carried the router load-balancing loss (a fused
        old-policy pass's kept piece is one of them; Megatron's tracker holds their sum, cleared here)."""
        if algo.router_aux_loss != "none":
            self._clear_router_aux_tracker()
        self.num_train_steps = 0
        """`train_step` calls so far (seeds the mini-batch shuffle; saved with the optimizer state)."""
        self.expert_usage = ExpertUsageWindow()
        """The old-policy pass's expert token counts of the last steps, for `router/dead_experts`
        (`moe_gspo.run.learner_passes.old_policy_pass`; saved with the optimizer state)."""

    # ------------------------------------------------------------------ pass helpers (old_pass.py, backward.py)
    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] of token ids `ids_BS` [b, s] (the model's padded vocabulary cut off);
        autograd and train/eval mode as the caller set them, replay as the caller's `replay_context`."""
        return forward_logits(self.ddp, ids_BS)[..., :self.vocab_size]

    def minibatch_indices(self, num_seqs: int) -> list[np.ndarray]:
        """The global rows of each mini-batch of the next `train_step` (`train.shuffle_minibatches`: a
        permutation seeded by `train.seed` and the number of `train_step` calls so far)."""
        order = np.arange(num_seqs)
        if self.train is not None and self.train.shuffle_minibatches and self.train.num_minibatches > 1:
            order = np.random.default_rng([self.train.seed, self.num_train_steps]).permutation(num_seqs)
        return np.array_split(order, self.train.num_minibatches if self.train is not None else 1)

    def replay_context(self, routes: list[np.ndarray] | None, seq_lens, seq_len: int):
        """A context in which the model replays `routes` (one array [T_b, L, K] per row of the forward,
        rows `seq_lens` long, padded to `seq_len`); its value is the replay handle, whose `backward(loss)`
        back-propagates under the same routing. `routes=None`: natural routing (a null context, value None)."""
        if routes is None:
            return contextlib.nullcontext(None)
        if self.replay_driver is None:
            raise ValueError("replay routes were given but the model was built without "
                             "enable_routing_replay=True")
        topk = build_replay_topk(routes, [int(n) for n in seq_lens], seq_len, num_experts=self.num_experts,
                                 top_k=self.top_k, order="sb").to(self.device)
        return self.replay_driver.replaying(topk)

    def local_shard(self, batch: PackedBatch, plan: ShardPlan, routes: list | None, *extra_BS: torch.Tensor | None):
        """This rank's shard of the global `batch` per `plan` (`plan_shards`), padded with dummy rows to
        `plan.num_rows`: (the shard, its routes (None when `routes` is None, empty arrays for padding
        rows), the same rows of each `[B, S]` tensor of `extra_BS` (zeros for padding rows))."""
        local = batch.select(plan.indices).pad_rows(plan.num_rows)
        local_routes = None
        if routes is not None:
            empty = np.zeros((0, len(self.layer_ids), self.top_k), dtype=np.int64)
            local_routes = [routes[int(i)] for i in plan.indices] + [empty] * (plan.num_rows - len(plan.indices))
        idx = torch.as_tensor(plan.indices, dtype=torch.long, device=self.device)
        outs = []
        for t in extra_BS:
            if t is None:
                outs.append(None)
                continue
            rows = t[idx]
            pad = torch.zeros((plan.num_rows - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
            outs.append(torch.cat([rows, pad]))
        return local, local_routes, outs

    def gather_rows(self, local: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """Concatenate every data-parallel rank's real rows of `local` ([num_rows, ...]) in rank order: the
        global [num_seqs, ...] (collective over the data-parallel group)."""
        sizes = [len(ix) for ix in np.array_split(np.arange(num_seqs), self.parallel.dp_size)]
        if self.parallel.dp_size == 1:
            return local[:sizes[0]]
        from megatron.core import parallel_state as ps

        bufs = [torch.empty_like(local) for _ in sizes]
        dist.all_gather(bufs, local.contiguous(), group=ps.get_data_parallel_group())
        return torch.cat([b[:n] for b, n in zip(bufs, sizes)])

    def plan_replay(self, batch: PackedBatch, old_pass_routes: list | None = None) -> ReplayPlan:
        """The step's `ReplayPlan` for `batch` under this learner's mode: which routes each pass replays, and
        the one row-by-row check of `batch.rollout_routes` (`moe_gspo.routing.replay_checks`).
        `old_pass_routes`: B arrays [seq_len_b, L, K] of the old-policy pass over this batch with the current
        weights and natural routing (its `routes`); R2 replays them, R3's failed rows take them. None: R3
        runs that pass here when a row needs it."""
        return build_replay_plan(
            self.replay_spec, batch.rollout_routes, batch.seq_lens_B.tolist(), old_pass_routes=old_pass_routes,
            num_layers=len(self.layer_ids), top_k=self.top_k, num_experts=self.num_experts,
            old_pass=lambda: self.compute_logprobs(batch, record_routes=True, no_replay=True).routes)

    # ------------------------------------------------------------------ old-policy pass
    def compute_logprobs(self, batch: PackedBatch, *, record_routes: bool = False, replay_routes=None,
                         micro_batch_size: int = 0, no_replay: bool = False,
                         keep_graph: bool = False, with_entropy: bool = False) -> LogprobResult:
        """Token log-probs of the global `batch` under the current weights (no gradient, eval mode,
        unless `keep_graph`).

        `record_routes`: also return every sequence's learner routing (top-k ids and probabilities).
        Where the mode replays the old-policy pass's routes (R2) they are always recorded and returned:
        the update replays them (`train_step` takes an `OldPolicyPass` whose `natural` this result is).
        `replay_routes` (B arrays [T_b, L, K]): replay that routing; None replays what the mode's pi_old
        pass replays (`LearnerPass.PI_OLD` of `plan_replay(batch)`: R3's checked rollout routes; none and
        R2 route naturally). `micro_batch_size` 0 = `train.micro_batch_size`.
        `no_replay=True`: the learner's natural routing even under R3 (the old-policy pass, drift
        measurement). `with_entropy`: also return each token's predictive entropy (`entropy_BS`, no gradient).
        `keep_graph=True` (the old-policy pass of `train.fuse_old_logp_pass`): the pass runs in train mode
        (the same numbers: the model has no dropout and no auxiliary router loss) in two pieces, this
        rank's rows of the next `train_step`'s first mini-batch with autograd, the other rows without;
        the first piece with its graph is returned as `result.fused`; the next `train_step` on this same
        batch object, given it (`train_step(batch, OldPolicyPass(..., fused=result.fused))`), back-propagates
        the first mini-batch
        through it instead of running that forward again. Needs the natural (or R2) routing and one
        micro-batch per rank; the graph holds one mini-batch's activations (at most) until that
        `train_step` (or until the caller drops `result.fused`).
        """
        if no_replay and replay_routes is not None:
            raise ValueError("compute_logprobs: pass either replay_routes or no_replay=True, not both")
        if replay_routes is not None:
            if len(replay_routes) != batch.num_seqs:
                raise ValueError(f"replay_routes has {len(replay_routes)} entries for B={batch.num_seqs}")
            routes_in = list(replay_routes)
        elif no_replay or self.replay_spec.source(LearnerPass.PI_OLD) is RouteSource.NONE:
            routes_in = None
        else:
            routes_in = self.plan_replay(batch).routes(LearnerPass.PI_OLD)
        record = record_routes = record_routes or self.replay_spec.replays_old_pass
        mbs = micro_batch_size or (self.train.micro_batch_size if self.train is not None else 0)
        plan = plan_shards(batch.seq_lens_B.tolist(), dp_rank=self.parallel.dp_rank,
                           dp_size=self.parallel.dp_size, micro_batch_size=mbs)
        if keep_graph:
            check_fusable(self, routes_in, plan)
        if self.ddp.training != keep_graph:
            self.set_train_mode(keep_graph)
        result, _ = logprob_pass(self, self.recorder, batch, plan, routes_in, record=record,
                                 record_routes=record_routes, keep_graph=keep_graph, with_entropy=with_entropy,
                                 num_train_steps=self.num_train_steps)
        return result

    # ------------------------------------------------------------------ update
    def train_step(self, batch: PackedBatch, old: OldPolicyPass, *,
                   after_optimizer_step: Callable[[int, bool], None] | None = None) -> dict[str, float]:
        """One RL update on the global `batch`: `train.num_minibatches` optimizer steps.

        `old`: what the old-policy side of the step produced (`OldPolicyPass`, e.g.
        `moe_gspo.run.learner_passes.old_policy_pass`): pi_old's [B, S] token-aligned log-probs, the natural
        old-policy pass (`natural`, whose routes R2 replays), the step's `ReplayPlan` (`replay`; None: planned
        here from the batch and `natural`), the reference log-probs (needed when `algo.kl_coef > 0`), the
        rollout corrections (`moe_gspo.algos.rollout_correction`, computed once for the whole batch:
        `is_weights_BS` [B, S] multiply each token's policy-gradient term; `rs_keep_BS` [B, S] bool removes
        the rejected response tokens from the loss, from every logged `loss/`, `clip/`, `ratio/` metric and
        from the mini-batch normalisation) and `fused`, the piece of `compute_logprobs(batch, keep_graph=True)`
        kept with its graph (`LogprobResult.fused`), on this same batch object and with no update in between:
        the first mini-batch back-propagates through it instead of a new forward (ignored when the mini-batch
        split changed since; its graph is used up: a second `train_step` with it is refused). The update
        replays `old.replay.routes(LearnerPass.UPDATE)`. Neither `batch` nor `old` is changed.
        `after_optimizer_step(minibatch_index, applied)` is called on every rank after each mini-batch's
        optimizer step (`applied` False when the NaN guard skipped it), e.g. to measure how the routing
        moved after the first update; it may run no-grad passes of this learner.
        Returns metrics averaged over the mini-batches (see the module docstring).
        """
        if self.optimizer is None:
            raise ValueError("this Learner was built inference-only (train=None); pass a TrainConfig to train")
        if not isinstance(old, OldPolicyPass):
            raise TypeError(f"train_step(batch, old): old must be an OldPolicyPass, got {type(old).__name__}; wrap "
                            "the old log-probs: OldPolicyPass(logp_BS=..., natural=compute_logprobs(batch), ...)")
        fused = old.fused
        B, S = batch.num_seqs, batch.seq_len_padded
        for name in ("logp_BS", "ref_logp_BS", "is_weights_BS", "rs_keep_BS"):
            t = getattr(old, name)
            if t is not None and tuple(t.shape) != (B, S):
                raise ValueError(f"{'old_' if name == 'logp_BS' else ''}{name} has shape {tuple(t.shape)}, "
                                 f"expected the batch's [B, S] = {(B, S)}")
        if not 1 <= self.train.num_minibatches <= B:
            raise ValueError(f"train.num_minibatches={self.train.num_minibatches} must be in [1, B={B}]")
        plan = old.replay
        if plan is None:
            plan = self.plan_replay(batch, old_pass_routes=None if old.natural is None else old.natural.routes)
        elif plan.num_seqs != B:
            raise ValueError(f"train_step: the replay plan is for B={plan.num_seqs} sequences, the batch has B={B}")
        routes = plan.routes(LearnerPass.UPDATE)
        if fused is not None:
            # the kept pass serves as the first mini-batch's forward only if the weights have not changed since
            if fused.batch is not batch:
                raise ValueError("train_step: the fused old-policy pass was kept for another batch object")
            if fused.num_train_steps != self.num_train_steps:
                raise ValueError("train_step: the fused old-policy pass was kept before an update; run it again")
            if self.algo.entropy_coef > 0 and fused.ent_graph is None:
                raise ValueError("train_step: algo.entropy_coef > 0 needs the entropies of the first mini-batch's "
                                 "forward; run the fused old-policy pass with them: compute_logprobs(keep_graph=True, "
                                 "with_entropy=True)")
            if not plan.spec.fusable:
                raise ValueError(f"train_step: a fused old-policy pass (compute_logprobs(keep_graph=True)) routed "
                                 f"naturally, but routing replay {plan.spec.name}'s update replays other routes; run "
                                 "that pass without keep_graph")
        self.offload.restore_grads()  # train.offload_during_rollout: gradient buffers back for the update
        batch = batch.to(self.device)
        old_BS = torch.as_tensor(old.logp_BS).to(self.device, torch.float32)
        ref = None if old.ref_logp_BS is None else old.ref_logp_BS.to(self.device, torch.float32)
        is_w = None if old.is_weights_BS is None else old.is_weights_BS.to(self.device, torch.float32)
        keep = None if old.rs_keep_BS is None else old.rs_keep_BS.to(self.device, torch.bool)
        results = []
        minibatches = self.minibatch_indices(B)
        if fused is not None and not np.array_equal(fused.first_rows, minibatches[0]):
            # kept for another mini-batch split (num_minibatches changed since): a plain forward. Decided from
            # the global split, the same on every rank (a rank's own `graph_rows` differ by rank at DP > 1)
            fused = None
        self.num_train_steps += 1
        for i, idx in enumerate(minibatches):
            t_idx = torch.as_tensor(idx, device=self.device)
            mini_routes = None if routes is None else [routes[int(j)] for j in idx]
            rows = [None if t is None else t[t_idx] for t in (ref, is_w, keep)]
            results.append(self._train_minibatch(batch.select(idx), old_BS[t_idx], *rows, mini_routes,
                                                 fused=fused if i == 0 else None, idx=idx))
            fused = None  # the kept graph is freed after its backward
            limit = self.train.max_consecutive_skips
            if limit and self.consecutive_skips >= limit:  # every rank: the skip is agreed on
                raise ValueError(skip_stop_message(self.algo.name, results[-1][0], limit))
            if after_optimizer_step is not None:
                after_optimizer_step(i, not results[-1][1])
        self.offload.release_grads()
        kept = [m for m, skipped in results if not skipped] or [m for m, _ in results]
        metrics = {k: float(np.mean([m[k] for m in kept])) for k in kept[0]}
        if self.algo.router_aux_loss != "none":
            metrics["loss/router_aux"] = self._router_aux_loss_mean()
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        metrics["train/lr"] = float(self.optimizer.lr)
        return metrics

    def _train_minibatch(self, mini: PackedBatch, old_BS, ref_BS, is_w_BS, keep_BS, routes, *,
                         fused: FusedPass | None = None, idx: np.ndarray | None = None) -> tuple[dict[str, float], bool]:
        """One optimizer step on `mini` (rows `idx` of the step's batch); `fused`: back-propagate through
        the kept old-policy pass instead of a new forward (first mini-batch of a fused step)."""
        algo, dp = self.algo, self.parallel.dp_size
        loss_kw = algo.loss_options()  # clip range, KL, aggregation mode: moe_gspo.algos.policy_loss
        mode = loss_kw["loss_agg_mode"]
        mask_all = mini.response_mask_BS if keep_BS is None else mini.response_mask_BS & keep_BS
        denom = max(num_units(mask_all, mode), 1)  # tokens (token-mean) or sequences the mode averages over

        def loss_on(logp, rows, S_i, mask, ent=None):
            """The loss of mini-batch `rows` (indices into `mini`) from their log-probs `logp` [n, S_i]
            (and entropies `ent` [n, S_i] with algo.entropy_coef > 0)."""
            is_w, opsm_m = self._opsm_weights(mini, rows, logp, None if is_w_BS is None else is_w_BS[rows, :S_i])
            loss, m = policy_loss(algo.name, logp, old_BS[rows, :S_i], mini.advantages_B[rows], mask,
                                  ref_logp_BT=None if ref_BS is None else ref_BS[rows, :S_i],
                                  is_weights_BT=is_w, entropy_BT=ent, **loss_kw)
            return loss, loss * piece_weight(mask, mode, dp_size=dp, num_units_total=denom), {**m, **opsm_m}

        if not self.ddp.training:
            self.set_train_mode(True)
        self.optimizer.zero_grad()
        with_entropy = algo.entropy_coef > 0
        if fused is not None:
            self._scale_router_aux_loss(1)
            finite, logp_all, ent_all, m_all = backward_fused(self, fused, idx, mask_all, loss_on,
                                                              with_entropy=with_entropy)
        else:
            plan = plan_shards(mini.seq_lens_B.tolist(), dp_rank=self.parallel.dp_rank, dp_size=dp,
                               micro_batch_size=self.train.micro_batch_size)
            self._scale_router_aux_loss(len(plan.micro_batches))
            finite, logp_all, ent_all, m_all = backward_minibatch(self, mini, plan, routes, mask_all, loss_on,
                                                                  with_entropy=with_entropy)
        self.ddp.finish_grad_sync()
        norm = self.optimizer.grad_norm()
        skip = any_rank(not (finite and math.isfinite(norm)), self.device)
        if skip:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.optimizer.clip(norm)
            self.optimizer.step()
            self.num_updates += 1
            self.consecutive_skips = 0
        self.optimizer.zero_grad()
        if m_all is None:  # the loss was computed in pieces (ranks, micro-batches): recompute on the whole
            with torch.no_grad():
                all_rows = torch.arange(mini.num_seqs, device=logp_all.device)
                is_w_all, opsm_m = self._opsm_weights(mini, all_rows, logp_all, is_w_BS)
                _, m_all = policy_loss(algo.name, logp_all, old_BS, mini.advantages_B, mask_all, ref_logp_BT=ref_BS,
                                       is_weights_BT=is_w_all, entropy_BT=ent_all, **loss_kw)
                m_all.update(opsm_m)
        out = {k: float(v) for k, v in m_all.items()}
        out["grad/norm"] = norm
        return out, skip

    def _scale_router_aux_loss(self, num_micro_batches: int) -> None:
        """With `algo.router_aux_loss` on: the gradient scale of Megatron's router load-balancing loss for the
        next backward passes, 1 / this rank's micro-batches of the mini-batch (Megatron-LM sets loss_scale /
        num_microbatches), so that after DDP's average over data-parallel ranks the gradient is that of
        coef x the mean per-micro-batch aux loss; the forwards are counted for `loss/router_aux`. Nothing is
        touched without it."""
        if self.algo.router_aux_loss == "none":
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / max(num_micro_batches, 1), device=self.device))
        self.aux_loss_forwards += num_micro_batches  # the forwards that add to Megatron's tracker

    def _clear_router_aux_tracker(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        self.aux_loss_forwards = 0

    def _router_aux_loss_mean(self) -> float:
        """`loss/router_aux`: the load-balancing loss (without its coefficient; Megatron's aux-loss tracker,
        which sums it per MoE layer over the training forwards) averaged over the MoE layers, this step's
        update forwards (one per micro-batch; model.recompute's recomputed forward adds nothing, tested)
        and the data-parallel ranks."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for entry in get_moe_layer_wise_logging_tracker().values():
            total = total + entry["values"].detach().double().sum()
        value = total / (max(self.aux_loss_forwards, 1) * len(self.layer_ids))
        self._clear_router_aux_tracker()
        if self.parallel.dp_size > 1:
            from megatron.core import parallel_state as ps

            dist.all_reduce(value, group=ps.get_data_parallel_group())
            value = value / self.parallel.dp_size
        return float(value)

    def _opsm_weights(self, mini: PackedBatch, rows, logp: torch.Tensor, is_w: torch.Tensor | None):
        """With `algo.opsm`: the rollout-correction weights of `rows` of `mini` times the OPSM keep mask
        computed from the current log-probs `logp` [n, S_i] (`moe_gspo.algos.rollout_correction.opsm_mask`),
        and its metrics; else `(is_w, {})`."""
        if not self.algo.opsm:
            return is_w, {}
        S_i = logp.shape[1]
        delta = DEFAULT_OPSM_DELTA if self.algo.opsm_delta is None else self.algo.opsm_delta
        keep, m = opsm_mask(logp.detach(), mini.rollout_logp_BS[rows, :S_i], mini.advantages_B[rows],
                            mini.response_mask_BS[rows, :S_i], delta=delta)
        keep = keep.to(logp.dtype)
        return (keep if is_w is None else is_w * keep), m

    # ------------------------------------------------------------------ memory during the rollout
    def offload_for_rollout(self) -> None:
        """Free this learner's GPU memory for the rollout engine per `train.offload_during_rollout`
        (see `moe_gspo.learner.offload`); `reload_after_rollout()` before the next learner pass."""
        if self.optimizer is not None:
            self.offload.offload_for_rollout()

    def reload_after_rollout(self) -> None:
        if self.optimizer is not None:
            self.offload.reload_after_rollout()

    # ------------------------------------------------------------------ weights and checkpoints
    def hf_weight_stream(self):
        """The weights as a stream of HF-named tensors, one layer at a time, for the rollout engine's
        weight sync (`engine.update_weights(learner.hf_weight_stream())`): experts are all-gathered over
        the EP group per layer, never the whole model at once. Collective: every rank must consume the
        stream to its end, in the same order (see `moe_gspo.mcore.weight_stream`)."""
        from moe_gspo.mcore.weight_stream import HFWeightStream

        return HFWeightStream(self.model, self.hf_config, layout="per_expert")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF state dict (on-disk per-expert names) on every rank's device, for small models and
        tests: every layer's experts are gathered at once (~61 GiB per GPU for Qwen3-30B-A3B at EP=8).
        The HF export (`moe_gspo.mcore.checkpoint.save_hf_checkpoint(learner.model, ...)`) and the
        rollout sync (`hf_weight_stream`) stream one layer at a time instead. Collective over the EP
        group: every rank must call it. Tensors alias the weights (clone for a snapshot)."""
        from moe_gspo.mcore.weights import gather_hf_state_dict

        return gather_hf_state_dict(self.model, self.hf_config, layout="per_expert")

    def state_dict(self) -> dict:
        """This rank's model and optimizer state (per-rank checkpoint)."""
        if self.optimizer is None:
            raise ValueError("an inference-only Learner (train=None) has no training state to save")
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                "num_updates": self.num_updates,
                "num_train_steps": self.num_train_steps, "expert_usage": self.expert_usage.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict`. The optimizer state loads first and the weights last (see
        `LearnerOptimizer.load_state_dict`: Megatron's CPU-offloaded optimizer writes into the model
        while its state loads)."""
        self.optimizer.load_state_dict(state["optimizer"],
                                       load_weights=lambda: self.model.load_state_dict(state["model"]))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.num_updates = int(state.get("num_updates", 0))
        self.num_train_steps = int(state.get("num_train_steps", self.num_updates // self.train.num_minibatches))
        self.expert_usage.load_state_dict(state.get("expert_usage"))  # absent in older checkpoints: empty

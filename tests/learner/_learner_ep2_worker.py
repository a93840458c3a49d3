"""torchrun worker (2 processes, EP=2 / DP=2): every expert-parallel check of the learner in one launch.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 _learner_ep2_worker.py OUT.json
Each rank writes its results; rank 0 collects them (all_gather_object) and writes OUT.json atomically
as {"ranks": [rank0, rank1]}; an exception is reported as {"error": traceback} for that rank.
The batch has B=7 sequences (odd: uneven shards plus a dummy row), micro-batches of 2.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist

from _learner_common import (flip_fraction, hf_token_logprobs, make_batch, make_learner, old_pass,
                             params_snapshot, tiny_pair)
from moe_gspo.config import AlgoConfig
from moe_gspo.learner.batch import plan_shards
from moe_gspo.learner.router_hooks import MegatronRouterRecorder
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder

EP2_BATCH = dict(num=7, seed=11)
EP2_TRAIN = dict(lr=1e-2, num_minibatches=2, micro_batch_size=2)
EP2_ALGO = dict(name="gspo", clip_low=0.2, clip_high=0.2)  # wide clip: the 2 steps move the policy
EP2_FUSED_TRAIN = dict(lr=1e-2, num_minibatches=2, micro_batch_size=0, shuffle_minibatches=True, seed=3)


def _seen_in_update(rec, mini_seq_lens: list[list[int]], info, mbs: int) -> dict[int, np.ndarray]:
    """Global sequence index -> routes the router hooks saw during one train_step on this rank."""
    seen, call, offset = {}, 0, 0
    for lens in mini_seq_lens:
        plan = plan_shards(lens, dp_rank=info.dp_rank, dp_size=info.dp_size, micro_batch_size=mbs)
        padded = [lens[i] for i in plan.indices] + [0] * (plan.num_rows - len(plan.indices))
        for mb in plan.micro_batches:
            seqs = rec.to_sequences(padded[mb.start:mb.stop], mb.stop - mb.start, mb.seq_len, call=call)
            for j, row in enumerate(range(mb.start, mb.stop)):
                if row < len(plan.indices):
                    seen[offset + int(plan.indices[row])] = seqs[j]
            call += 1
        offset += len(lens)
    assert call == rec.num_calls(), (call, rec.num_calls())
    return seen


def run(info) -> dict:
    out: dict = {"rank": info.rank, "ep_rank": info.ep_rank, "dp_size": info.dp_size}
    batch = make_batch(**EP2_BATCH, with_routes=True)
    out["input_ids"] = batch.input_ids_BS.tolist()

    # 1. log-probs and routes vs transformers; the gathered HF state dict is the original one
    cfg, hf, model = tiny_pair(ep_size=2)
    learner = make_learner(model, cfg, info, algo=AlgoConfig(**EP2_ALGO), **EP2_TRAIN)
    from moe_gspo.mcore.checkpoint import to_per_expert_layout

    sd = learner.hf_state_dict()
    ref = to_per_expert_layout(hf.state_dict(), hf.config)
    out["hf_state_dict_exact"] = set(sd) == set(ref) and all(torch.equal(sd[k], v) for k, v in ref.items())
    ref = hf_token_logprobs(hf, batch)
    res = learner.compute_logprobs(batch, record_routes=True)
    out["logp_vs_hf_max_abs"] = float((res.logp_BS - ref).abs().max())
    with HFRouterRecorder(hf, record_probs=False) as hrec, torch.no_grad():
        hf(batch.input_ids_BS)
        hf_ids = hrec.pop()[0].topk_ids_NLK.view(batch.num_seqs, batch.seq_len_padded, 2, 2).numpy()
    out["routes_vs_hf_flip"] = flip_fraction(res.routes, [hf_ids[b, :n] for b, n in
                                                          enumerate(batch.seq_lens_B.tolist())])

    # 2. R3: a random routing replayed on each rank's shard is what the hooks record
    r3 = learner.compute_logprobs(batch, record_routes=True, replay_routes=batch.rollout_routes)
    out["r3_flip_vs_given"] = flip_fraction([r[:len(g)] for r, g in zip(r3.routes, batch.rollout_routes)],
                                            batch.rollout_routes)
    out["r3_flip_free_vs_given"] = flip_fraction([r[:len(g)] for r, g in zip(res.routes, batch.rollout_routes)],
                                                 batch.rollout_routes)

    # 3. two GSPO steps (2 mini-batches x micro-batches of 2 each), then the log-probs
    out["metrics"] = [learner.train_step(batch, old_pass(res.logp_BS)) for _ in range(2)]
    out["logp_after_2_steps"] = learner.compute_logprobs(batch).logp_BS.tolist()

    # 4. NaN guard: a NaN advantage on rank 1's shard only; every rank skips, weights unchanged
    before = params_snapshot(model)
    poisoned = batch.select(range(batch.num_seqs))
    poisoned.advantages_B = poisoned.advantages_B.clone()
    poisoned.advantages_B[-1] = float("nan")
    learner.train.num_minibatches = 1
    m = learner.train_step(poisoned, old_pass(res.logp_BS))
    out["nan_skipped_steps"] = m["train/skipped_steps"]
    out["nan_weights_unchanged"] = all(torch.equal(before[k], p) for k, p in params_snapshot(model).items())

    # 5. R2: old routing recorded globally, replayed on each rank's shard of each mini-batch
    cfg, _, model2 = tiny_pair(ep_size=2)
    r2 = make_learner(model2, cfg, info, replay="r2", algo=AlgoConfig(name="grpo"), lr=5e-2, **{
        k: v for k, v in EP2_TRAIN.items() if k != "lr"})
    old = r2.compute_logprobs(batch, record_routes=True)
    r2.train_step(batch, old_pass(old.logp_BS, natural=old, fused=old.fused))
    new = r2.compute_logprobs(batch, record_routes=True)
    out["r2_flip_without_replay"] = flip_fraction(old.routes, new.routes)
    out["r2_flip_replayed_eval"] = flip_fraction(
        old.routes, r2.compute_logprobs(batch, record_routes=True, replay_routes=old.routes).routes)
    minis = [batch.seq_lens_B[ix].tolist() for ix in np.array_split(np.arange(batch.num_seqs), 2)]
    with MegatronRouterRecorder(model2, record_probs=False) as rec:
        r2.train_step(batch, old_pass(old.logp_BS, natural=old))
        seen = _seen_in_update(rec, minis, info, EP2_TRAIN["micro_batch_size"])
    out["r2_update_seqs_seen"] = sorted(seen)
    out["r2_update_flip_vs_old"] = flip_fraction([seen[i] for i in sorted(seen)], [old.routes[i] for i in sorted(seen)])
    out["r2_update_flip_vs_new"] = flip_fraction([seen[i] for i in sorted(seen)], [new.routes[i] for i in sorted(seen)])

    # 6. fused old-policy pass + shuffled mini-batches (whole shards per pass) + batched experts (4 local
    # experts per rank): 2 steps, then the log-probs
    cfg, _, model3 = tiny_pair(ep_size=2, batched_experts=True)
    fused = make_learner(model3, cfg, info, algo=AlgoConfig(**EP2_ALGO), **EP2_FUSED_TRAIN)
    out["fused_metrics"] = []
    for _ in range(2):
        old3 = fused.compute_logprobs(batch, record_routes=True, keep_graph=True)
        out["fused_metrics"].append(fused.train_step(batch, old_pass(old3.logp_BS, fused=old3.fused)))
    out["fused_logp_after_2_steps"] = fused.compute_logprobs(batch).logp_BS.tolist()
    return out


def main() -> None:
    path = sys.argv[1]
    info = init_distributed(ep_size=2, num_experts=8, seed=0)
    try:
        result = run(info)
    except Exception:
        result = {"rank": info.rank, "error": traceback.format_exc()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if info.rank == 0:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"ranks": gathered}, f)
        os.replace(tmp, path)
    destroy_distributed()


if __name__ == "__main__":
    main()

"""Router margin and entropy on the learner side: the Megatron hook computes them from the router's own
logits (the same numbers as transformers' router on the same fp32 weights), and the old-policy pass
returns them per sequence next to the routes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _learner_common import make_batch, make_learner
from moe_gspo.learner.router_hooks import MegatronRouterRecorder
from moe_gspo.mcore.model import forward_logits
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder

pytestmark = pytest.mark.usefixtures("dist")


def test_megatron_stats_match_transformers_per_sequence(pair):
    _, hf, model = pair
    batch = make_batch(5, seed=4)
    B, S = batch.num_seqs, batch.seq_len_padded
    with MegatronRouterRecorder(model) as rec, torch.no_grad():
        forward_logits(model, batch.input_ids_BS)
        stats = rec.to_sequences(batch.seq_lens_B.tolist(), B, S, stats=True)
    with HFRouterRecorder(hf) as hrec, torch.no_grad():
        hf(batch.input_ids_BS)
        hf_stats = hrec.pop()[0].stats_NL2.view(B, S, 2, 2).numpy()
    for b, n in enumerate(batch.seq_lens_B.tolist()):
        assert stats[b].shape == (n, 2, 2) and stats[b].dtype == np.float32
        np.testing.assert_allclose(stats[b], hf_stats[b, :n], atol=1e-5)
    assert (np.concatenate(stats)[..., 0] >= 0).all()
    with MegatronRouterRecorder(model, record_stats=False) as rec, torch.no_grad():
        forward_logits(model, batch.input_ids_BS)
        with pytest.raises(ValueError, match="record_stats"):
            rec.to_sequences(batch.seq_lens_B.tolist(), B, S, stats=True)
    with MegatronRouterRecorder(model) as rec, torch.no_grad():
        forward_logits(model, batch.input_ids_BS)
        with pytest.raises(ValueError, match="not both"):
            rec.to_sequences(batch.seq_lens_B.tolist(), B, S, probs=True, stats=True)


def test_old_policy_pass_returns_router_stats_with_the_routes(pair, dist):
    cfg, hf, model = pair
    learner = make_learner(model, cfg, dist, micro_batch_size=2)  # several micro-batches: rows land right
    batch = make_batch(5, seed=4)
    out = learner.compute_logprobs(batch, record_routes=True)
    assert len(out.router_stats) == batch.num_seqs
    with MegatronRouterRecorder(model) as rec, torch.no_grad():
        forward_logits(model, batch.input_ids_BS)
        ref = rec.to_sequences(batch.seq_lens_B.tolist(), batch.num_seqs, batch.seq_len_padded, stats=True)
    for st, routes, r in zip(out.router_stats, out.routes, ref):
        assert st.shape == routes.shape[:2] + (2,)
        np.testing.assert_allclose(st, r, atol=1e-5)
    assert learner.compute_logprobs(batch).router_stats is None

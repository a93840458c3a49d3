"""Router margin and entropy recorded on the rollout side: the transformers hooks and the compact decoder
give the statistics of the router logits the model computed, per token row like the routes."""

from __future__ import annotations

import numpy as np
import torch

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder, find_routers
from moe_gspo.routing.router_stats import token_router_stats
from moe_gspo.tiny import build_tiny_model

PROMPTS = [[2, 5, 6, 7, 8, 9], [2, 9, 12], [2, 17, 16, 15]]
SAMPLING = SamplingParams(n=3, max_new_tokens=6, seed=2)


def test_hook_stats_are_those_of_the_router_logits():
    model = build_tiny_model(seed=3)
    logits = {}
    extra = [r.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0].detach()))
             for i, (_, r) in enumerate(find_routers(model))]
    ids = torch.tensor([[2, 5, 6, 7], [2, 9, 12, 3]])
    with HFRouterRecorder(model) as rec, torch.no_grad():
        model(ids)
        (call,) = rec.pop()
    for h in extra:
        h.remove()
    assert call.stats_NL2.shape == (8, 2, 2) and call.stats_NL2.dtype == torch.float32
    for layer, z_NE in logits.items():
        torch.testing.assert_close(call.stats_NL2[:, layer], token_router_stats(z_NE, 2))
        z_sorted = z_NE.sort(-1, descending=True).values
        torch.testing.assert_close(call.stats_NL2[:, layer, 0], z_sorted[:, 1] - z_sorted[:, 2])
    with HFRouterRecorder(model, record_stats=False) as rec, torch.no_grad():
        model(ids)
        assert rec.pop()[0].stats_NL2 is None


def test_engine_margins_and_entropies_per_token_row():
    model = build_tiny_model(seed=1)
    compact = HFEngine(model, device="cpu", dtype="bfloat16").generate(PROMPTS, SAMPLING)
    hooks = HFEngine(model, device="cpu", dtype="bfloat16", compact_decode=False).generate(PROMPTS, SAMPLING)
    for a, b in zip(compact, hooks):
        T, L, _ = a.routes_TLK.shape
        for s in (a, b):
            assert s.router_margin_TL.shape == (T, L) and s.router_margin_TL.dtype == np.float16
            assert s.router_entropy_TL.shape == (T, L) and s.router_entropy_TL.dtype == np.float16
            assert (s.router_margin_TL >= 0).all() and (s.router_entropy_TL > 0).all()
            assert (s.router_entropy_TL <= np.log(8) + 1e-3).all()
        # the compact decoder computes the same logits as transformers' forward in bf16: bit for bit
        np.testing.assert_array_equal(a.router_margin_TL, b.router_margin_TL)
        np.testing.assert_array_equal(a.router_entropy_TL, b.router_entropy_TL)
    # the prompt rows of the prefill agree with a plain bf16 forward of the same tokens, row by row. Another
    # shape (one unpadded row instead of the left-padded prompts; and outside `generate`, without the fp32-GEMM
    # scope the engine uses on CPUs without bf16 kernels): other GEMM kernels, so the bf16 hidden states may
    # differ by a rounding step (issue 51), and the margins (continuous in the logits) to a tolerance
    engine = HFEngine(model, device="cpu", dtype="bfloat16", compact_decode=False)
    s = hooks[0]
    with torch.no_grad():
        engine.recorder.clear()
        engine.model(torch.as_tensor(np.concatenate([s.prompt_ids, s.response_ids[:-1]]))[None])
        (call,) = engine.recorder.pop()
    P = len(s.prompt_ids)
    plain = call.stats_NL2[:, :, 0].numpy()[:P]
    recorded = s.router_margin_TL[:P].astype(np.float32)
    np.testing.assert_allclose(recorded, plain, rtol=0.05, atol=0.03)
    # ... tight enough to see rows out of place (each row's margin against its neighbour's)
    assert not np.allclose(recorded[1:], plain[:-1], rtol=0.05, atol=0.03)


def test_no_stats_without_probs():
    model = build_tiny_model(seed=1)
    for compact in (True, False):
        s = HFEngine(model, device="cpu", record_probs=False, compact_decode=compact).generate(PROMPTS, SAMPLING)[0]
        assert s.routes_TLK is not None and s.router_margin_TL is None and s.router_entropy_TL is None

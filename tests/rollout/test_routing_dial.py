"""The routing-drift dial in the transformers rollout engine (moe_gspo/rollout/routing_dial.py): both decoders
give the same samples, log-probs, routes and counts bit for bit; the recorded routes are the dialled ones; the
realised rate follows p; the config refuses it for vLLM and bad values with one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_gspo.config_load import load_config
from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder
from moe_gspo.tiny import build_tiny_model

PROMPTS = [[2, 5, 6, 7, 8], [2, 9], [2, 10, 11, 12, 13, 14, 15, 16, 17]]
SAMPLING = SamplingParams(n=4, max_new_tokens=10, seed=3)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=1)


def _samples(model, *, compact, dtype="bfloat16", **dial):
    return HFEngine(model, dtype=dtype, device="cpu", compact_decode=compact, **dial).generate(PROMPTS, SAMPLING)


def _rate(samples):
    return sum(s.extra["dial_changed"] for s in samples) / sum(s.extra["dial_rows"] for s in samples)


@pytest.mark.parametrize("dial", [dict(router_flip_prob=0.3), dict(router_noise_std=0.5),
                                  dict(router_noise_std=0.2, router_flip_prob=0.2)], ids=["flip", "noise", "both"])
def test_both_decoders_give_the_same_dialled_rollouts_bit_for_bit(model, dial):
    """The compact decoder and transformers' forward call the same kernels on the same shapes (tests/rollout/
    test_hf_decoders.py) and draw the dial's stream in the same order: the same numbers, bit for bit."""
    a, b = _samples(model, compact=True, **dial), _samples(model, compact=False, **dial)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_array_equal(x.response_logprobs, y.response_logprobs)
        np.testing.assert_array_equal(x.routes_TLK, y.routes_TLK)
        np.testing.assert_array_equal(x.router_probs_TLK, y.router_probs_TLK)
        assert x.extra == y.extra and x.extra["dial_rows"] == len(x.response_ids) * 2
    assert 0 < _rate(a) < 1
    undialled = _samples(model, compact=True)
    assert all("dial_changed" not in s.extra for s in undialled)
    assert any(not np.array_equal(x.routes_TLK, y.routes_TLK) for x, y in zip(a, undialled))


def test_the_dial_at_zero_is_not_built(model):
    engine = HFEngine(model, dtype="bfloat16", device="cpu", router_noise_std=0.0, router_flip_prob=0.0)
    assert engine.routing_dial is None


def test_flip_one_changes_every_counted_route_and_the_recorded_routes_are_the_dialled_ones(model):
    """p = 1 swaps the k-th expert of every (token, layer): every counted route changed, and the recorded routes'
    sets differ from the clean top-k that a teacher-forced fp32 forward of the same tokens gives."""
    samples = _samples(model, compact=True, dtype="float32", router_flip_prob=1.0)
    assert all(s.extra["dial_changed"] == s.extra["dial_rows"] for s in samples)
    engine_model = HFEngine(model, dtype="float32", device="cpu").model
    differ = total = 0
    for s in samples:
        ids = torch.as_tensor(np.concatenate([s.prompt_ids, s.response_ids]))[None]
        with HFRouterRecorder(engine_model) as rec, torch.no_grad():
            engine_model(ids)
            (call,) = rec.pop()
        P, R = len(s.prompt_ids), len(s.response_ids)
        clean = np.sort(call.topk_ids_NLK.numpy()[P - 1:P + R - 1], -1)
        dialled = np.sort(s.routes_TLK[P - 1:P + R - 1].astype(np.int64), -1)
        differ += int((clean != dialled).any(-1).sum())
        total += clean.shape[0] * clean.shape[1]
    assert differ / total > 0.97  # fp32 forwards of other shapes may round a near-tie differently


def test_realised_rate_follows_p_within_sampling_error(model):
    p = 0.3
    samples = _samples(model, compact=True, router_flip_prob=p)
    n = sum(s.extra["dial_rows"] for s in samples)
    assert abs(_rate(samples) - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_the_stream_follows_the_sampling_seed(model):
    engine = HFEngine(model, dtype="bfloat16", device="cpu", router_noise_std=0.5)
    a, b = engine.generate(PROMPTS, SAMPLING), engine.generate(PROMPTS, SAMPLING)
    assert all(np.array_equal(x.routes_TLK, y.routes_TLK) and x.extra == y.extra for x, y in zip(a, b))


def test_config_refuses_the_dial_for_vllm_and_bad_values_with_one_line():
    cfg = load_config(None, ["rollout.router_flip_prob=0.3", "rollout.router_noise_std=0.5"])
    assert cfg.rollout.router_flip_prob == 0.3 and cfg.rollout.router_noise_std == 0.5
    with pytest.raises(ValueError, match=r"rollout\.router_flip_prob=0\.3 .*rollout\.engine=hf only"):
        load_config(None, ["rollout.engine=vllm", "rollout.router_flip_prob=0.3"])
    with pytest.raises(ValueError, match=r"rollout\.router_flip_prob=1\.5 must be in \[0, 1\]"):
        load_config(None, ["rollout.router_flip_prob=1.5"])
    with pytest.raises(ValueError, match=r"rollout\.router_noise_std=-1\.0 must be"):
        load_config(None, ["rollout.router_noise_std=-1.0"])


def test_different_steps_and_seeds_give_different_dial_draws():
    """Issue 60, mutant 1: the dial's stream seeded with a constant gives every step the same draws. `begin` takes
    each generation's sampling seed (`derive_seed(train.seed, step, share)`, moe_gspo/run/steps.py): the same
    seed replays the same draws; another step or train.seed draws others."""
    from moe_gspo.rollout.routing_dial import RoutingDial
    from moe_gspo.run.setup import derive_seed

    logits = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    dial = RoutingDial(noise_std=0.3, flip_prob=0.3)

    def draws(seed):
        dial.begin(seed)
        _, ids, _ = dial.route(logits, 2, True, torch.float32)
        return ids, dial.pop_changed()

    seeds = {(train_seed, step): derive_seed(train_seed, step, 0) for train_seed in (0, 1) for step in (0, 1, 2)}
    got = {key: draws(s) for key, s in seeds.items()}
    again = draws(seeds[(0, 1)])
    assert torch.equal(again[0], got[(0, 1)][0]) and torch.equal(again[1], got[(0, 1)][1])
    keys = sorted(got)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not torch.equal(got[a][1], got[b][1]), (a, b)  # which routes changed differs
            assert not torch.equal(got[a][0], got[b][0]), (a, b)

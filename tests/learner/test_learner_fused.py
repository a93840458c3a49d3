"""The fused old-policy pass (`compute_logprobs(keep_graph=True)`, train.fuse_old_logp_pass, its kept graph
handed to `train_step` explicitly) and shuffled mini-batches (train.shuffle_minibatches) at EP=1: same maths
as the plain passes; the `OldPolicyPass` hand-off."""

from __future__ import annotations

import pytest
import torch

from _learner_common import make_batch, make_learner, old_pass, params_snapshot, tiny_pair
from moe_gspo.config import AlgoConfig

pytestmark = pytest.mark.usefixtures("dist")
WIDE = dict(clip_low=0.2, clip_high=0.2)  # wide clip so that the steps move the policy


def _run(dist, *, fuse: bool, replay="none", algo="gspo", steps=2, entropy_coef=0.0, **train_kw):
    # Megatron's own attention: its results do not depend on the batch's size, whereas the fused SDPA kernel's
    # backward sums in a batch-size-dependent order, a rounding difference that Adam's first steps amplify
    # (measured: weights 1e-3 apart after 2 steps at lr 1e-2); SDPA's own equivalence: tests/mcore
    cfg, _, model = tiny_pair(enable_routing_replay=replay != "none", sdpa_attention=False)
    learner = make_learner(model, cfg, dist, replay=replay, algo=AlgoConfig(name=algo, entropy_coef=entropy_coef, **WIDE),
                           **{"num_minibatches": 2, **train_kw})
    batch = make_batch(8, seed=21)
    metrics, olds = [], []
    for _ in range(steps):
        old = learner.compute_logprobs(batch, record_routes=True, keep_graph=fuse, with_entropy=entropy_coef > 0)
        olds.append(old)
        # the pass itself: log-probs, routes (R2), kept graph
        metrics.append(learner.train_step(batch, old_pass(old.logp_BS, natural=old, fused=old.fused)))
    return params_snapshot(model), metrics, olds, learner, batch


@pytest.mark.parametrize("algo,replay,shuffle,entropy_coef", [
    ("gspo", "none", False, 0.0), ("gspo", "none", True, 0.0), ("grpo", "r2", True, 0.0),
    ("gspo", "none", True, 0.05),  # the entropy bonus back-propagates through the kept pass too
])
def test_fused_old_pass_gives_the_same_update(dist, algo, replay, shuffle, entropy_coef):
    kw = dict(replay=replay, algo=algo, shuffle_minibatches=shuffle, entropy_coef=entropy_coef)
    plain_w, plain_m, plain_old, _, _ = _run(dist, fuse=False, **kw)
    fused_w, fused_m, fused_old, _, _ = _run(dist, fuse=True, **kw)
    # the pass in two pieces (train mode, autograd on for the first) gives the same old log-probs (up to the
    # rounding of Megatron's attention at another padded length) and routes; the second step's pass follows an Adam
    # step at lr 1e-2, which amplifies the first step's rounding (1.0e-4 measured under oneDNN's SSE4.1 kernels)
    for step, (a, b) in enumerate(zip(plain_old, fused_old)):
        assert (a.logp_BS - b.logp_BS).abs().max() <= (1e-5 if step == 0 else 5e-4)
        assert all((x == y).all() for x, y in zip(a.routes, b.routes))
    # gradients agree to float rounding (grad/norm below); Adam's ~lr * sign(grad) first steps amplify that
    # where a gradient is ~0: measured <= 1.3e-4 after 2 steps at lr 1e-2 (the steps move weights by ~2e-2)
    assert max(float((plain_w[k] - fused_w[k]).abs().max()) for k in plain_w) <= 5e-4
    moved = params_snapshot(tiny_pair(sdpa_attention=False)[2])
    assert max(float((plain_w[k] - moved[k]).abs().max()) for k in plain_w) > 1e-3  # the steps did something
    for step, (a, b) in enumerate(zip(plain_m, fused_m)):
        for key in ("loss/total", "grad/norm", "ratio/seq_mean", "clip/seq_frac") + (("loss/entropy",) if entropy_coef else ()):
            assert a[key] == pytest.approx(b[key], rel=1e-5 if step == 0 else 1e-3, abs=1e-7), (step, key)


def test_shuffled_minibatches_change_the_update_deterministically(dist):
    a_w, a_m, _, learner, _ = _run(dist, fuse=False, shuffle_minibatches=True, seed=5)
    b_w, _, _, _, _ = _run(dist, fuse=False, shuffle_minibatches=True, seed=5)
    c_w, _, _, _, _ = _run(dist, fuse=False, shuffle_minibatches=False, seed=5)
    d_w, _, _, _, _ = _run(dist, fuse=False, shuffle_minibatches=True, seed=6)
    diff = lambda x, y: max(float((x[k] - y[k]).abs().max()) for k in x)  # noqa: E731
    assert diff(a_w, b_w) == 0.0  # same seed, same order
    assert diff(a_w, c_w) > 1e-4 and diff(a_w, d_w) > 1e-4  # another order is another trajectory
    assert learner.num_train_steps == 2 and learner.state_dict()["num_train_steps"] == 2


def test_kept_graph_is_handed_on_explicitly_used_once_and_only_for_its_batch(dist):
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="gspo", **WIDE), num_minibatches=2)
    batch = make_batch(8, seed=21)
    plain = learner.compute_logprobs(batch)
    assert plain.fused is None and not hasattr(learner, "_fused")
    old = learner.compute_logprobs(batch, keep_graph=True)
    assert old.fused is not None and old.fused.logp_graph.requires_grad
    other = batch.select(range(batch.num_seqs))  # equal content, another object: refused
    with pytest.raises(ValueError, match="another batch object"):
        learner.train_step(other, old_pass(old.logp_BS, fused=old.fused))
    hand_off = old_pass(old.logp_BS, natural=old, fused=old.fused)
    learner.train_step(batch, hand_off)
    assert hand_off.fused is old.fused  # train_step changes nothing in its input; the graph is used up
    with pytest.raises(ValueError, match="before an update"):  # the weights moved since that pass
        learner.train_step(batch, hand_off)


def _snapshot(x):
    """A deep copy of the tensors and arrays of a dataclass (or list) for before/after comparisons."""
    import dataclasses

    import numpy as np

    if dataclasses.is_dataclass(x):
        return {f.name: _snapshot(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_snapshot(v) for v in x]
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


def _same(a, b) -> bool:
    import numpy as np

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a is b or a == b


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_train_step_changes_neither_the_batch_nor_the_hand_off(dist, replay):
    """`train_step(batch, old)`: every tensor, array and field of the batch and of the `OldPolicyPass` (its
    natural pass and replay plan included) is the same after the update; a plan made beforehand
    (`Learner.plan_replay`) and one made inside `train_step` give the same update, bit for bit."""
    batch = make_batch(8, seed=21, with_routes=True)
    g = torch.Generator().manual_seed(3)
    w = 0.5 + torch.rand(batch.input_ids_BS.shape, generator=g)
    keep = torch.rand(batch.input_ids_BS.shape, generator=g) > 0.2
    runs = []
    for planned in (False, True):
        cfg, _, model = tiny_pair(enable_routing_replay=True)
        learner = make_learner(model, cfg, dist, replay=replay, algo=AlgoConfig(name="grpo", kl_coef=0.1, **WIDE),
                               num_minibatches=2)
        natural = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
        plan = learner.plan_replay(batch, old_pass_routes=natural.routes) if planned else None
        hand_off = old_pass(natural.logp_BS, natural=natural, replay=plan, ref_logp_BS=natural.logp_BS - 0.01,
                            is_weights_BS=w, rs_keep_BS=keep)
        before = (_snapshot(batch), _snapshot(hand_off))
        m = learner.train_step(batch, hand_off)
        assert _same(before[0], _snapshot(batch)) and _same(before[1], _snapshot(hand_off))
        runs.append((params_snapshot(model), m))
    (wa, ma), (wb, mb) = runs
    assert ma == mb
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_fused_pass_without_entropies_is_refused_by_an_update_with_an_entropy_bonus(dist):
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="gspo", entropy_coef=0.01, **WIDE), num_minibatches=2)
    batch = make_batch(8, seed=21)
    old = learner.compute_logprobs(batch, keep_graph=True)  # no with_entropy
    with pytest.raises(ValueError, match="with_entropy=True"):
        learner.train_step(batch, old_pass(old.logp_BS, fused=old.fused))


def test_keep_graph_refuses_what_it_cannot_fuse(dist):
    cfg, _, model = tiny_pair()
    batch = make_batch(8, seed=21)
    r3 = make_learner(model, cfg, dist, replay="r3", num_minibatches=2)
    with pytest.raises(ValueError, match="route naturally"):
        r3.compute_logprobs(batch.select(range(8)), keep_graph=True, no_replay=True)
    mb = make_learner(tiny_pair()[2], cfg, dist, num_minibatches=2, micro_batch_size=2)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        mb.compute_logprobs(batch, keep_graph=True)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_fused_pass_on_the_default_model_keeps_one_minibatch_graph(dist, entropy_coef):
    """The default learner (SDPA attention, grouped expert GEMMs, fused RoPE): the kept graph is the first
    mini-batch's rows only (not the whole batch's), its log-probs are the old log-probs of those rows
    exactly (so their ratio is exactly 1 in the first optimizer step, as on-policy maths says), and the
    update matches the plain passes up to kernel rounding (per-row results can depend on which rows share
    a grouped expert GEMM: measured <= 5e-7 on the old log-probs)."""
    def run(fuse):
        cfg, _, model = tiny_pair(enable_routing_replay=False, batched_experts=True)
        learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="gspo", entropy_coef=entropy_coef, **WIDE),
                               num_minibatches=3)
        batch = make_batch(9, seed=21)
        olds, metrics, kept = [], [], []
        for _ in range(2):
            old = learner.compute_logprobs(batch, record_routes=True, keep_graph=fuse, with_entropy=True)
            kept.append(old.fused)
            olds.append(old)
            metrics.append(learner.train_step(batch, old_pass(old.logp_BS, fused=old.fused)))
        return params_snapshot(model), metrics, olds, kept

    (pw, pm, po, _), (fw, fm, fo, kept) = run(False), run(True)
    lens = make_batch(9, seed=21).seq_lens_B[:3]
    for k, old in zip(kept, fo):
        assert k.graph_rows.tolist() == [0, 1, 2] and k.logp_graph.requires_grad
        S0 = k.logp_graph.shape[1]
        inside = torch.arange(S0)[None, :] < lens[:, None]
        assert torch.equal(k.logp_graph.detach()[inside], old.logp_BS[:3, :S0][inside])
    assert (po[0].logp_BS - fo[0].logp_BS).abs().max() <= 1e-6  # same weights
    assert (po[1].logp_BS - fo[1].logp_BS).abs().max() <= 2e-4  # after a step at lr 1e-2 (Adam amplifies rounding)
    for a, b in zip(po, fo):
        assert all((x == y).all() for x, y in zip(a.routes, b.routes))
    assert max(float((pw[k] - fw[k]).abs().max()) for k in pw) <= 5e-4
    for step, (a, b) in enumerate(zip(pm, fm)):
        for key in ("loss/total", "grad/norm", "ratio/seq_mean") + (("loss/entropy",) if entropy_coef else ()):
            assert a[key] == pytest.approx(b[key], rel=1e-5 if step == 0 else 1e-2, abs=1e-6), (step, key)

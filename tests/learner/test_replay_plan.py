"""The replay decision in one place (`moe_gspo.learner.replay_plan`): per mode, which routes each learner pass
replays (hand-written table), and what a step's `ReplayPlan` holds for a batch with valid, missing and
malformed rollout routes. Pure numpy: no model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_gspo.learner.replay_plan import (REPLAY_MODES, LearnerPass, ReplayModeSpec, RouteSource, build_replay_plan,
                                          replay_spec)

NONE, OLD, ROLLOUT = RouteSource.NONE, RouteSource.OLD_PASS, RouteSource.ROLLOUT

EXPECTED = {  # pass: old, pi_old, update, recompute, reference (the table of the module docstring)
    "none": (NONE, NONE, NONE, NONE, NONE),
    "r2": (NONE, NONE, OLD, OLD, OLD),
    "r3": (NONE, ROLLOUT, ROLLOUT, ROLLOUT, ROLLOUT),
}
PASSES = (LearnerPass.OLD, LearnerPass.PI_OLD, LearnerPass.UPDATE, LearnerPass.RECOMPUTE, LearnerPass.REFERENCE)


@pytest.mark.parametrize("mode", ["none", "r2", "r3"])
def test_each_mode_says_which_routes_each_pass_replays(mode):
    spec = replay_spec(mode)
    assert spec.name == mode and replay_spec(spec) is spec
    assert {p: spec.source(p) for p in PASSES} == dict(zip(PASSES, EXPECTED[mode]))
    # what the code asks instead of comparing names
    assert spec.replays is (mode != "none")  # the model needs enable_routing_replay=True
    assert spec.replays_old_pass is (mode == "r2")  # every log-prob pass records its routes
    assert spec.replays_rollout is (mode == "r3")  # r3/* checks, fallback warning, replay contract
    assert spec.fusable is (mode != "r3")  # train.fuse_old_logp_pass can serve the update
    assert set(REPLAY_MODES) == {"none", "r2", "r3"}


def test_the_config_offers_exactly_the_modes_the_specs_define():
    """`moe_gspo.config` sits below the learner and lists the names for `--routing-replay` and the config's
    type; they are the specs' names."""
    import typing

    from moe_gspo.config import REPLAYS, AlgoConfig

    assert tuple(REPLAY_MODES) == REPLAYS
    assert typing.get_args(typing.get_type_hints(AlgoConfig)["routing_replay"]) == REPLAYS


def test_unknown_mode_and_a_model_without_replay_are_refused():
    with pytest.raises(ValueError, match=r"algo\.routing_replay='r4' is not a routing replay mode; choose one of "
                                         r"none, r2, r3"):
        replay_spec("r4")
    replay_spec("none").check_model(has_replay=False)
    for mode in ("r2", "r3"):
        with pytest.raises(ValueError, match=f"routing replay {mode} needs .*enable_routing_replay=True"):
            replay_spec(mode).check_model(has_replay=False)
    assert isinstance(replay_spec("r2"), ReplayModeSpec)
    for mode in ("none", "r2", "r3"):
        replay_spec(mode).check_rollout(record_routes=True)
    replay_spec("r2").check_rollout(record_routes=False)
    with pytest.raises(ValueError, match=r"^algo\.routing_replay=r3 replays the rollout engine's routes, but "
                                         r"rollout\.record_routes=false; set rollout\.record_routes=true or "
                                         r"choose algo\.routing_replay=r2/none$"):
        replay_spec("r3").check_rollout(record_routes=False)


L, K, E = 2, 2, 8
LENS = [4, 5, 3]


def _routes(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(n)]).astype(np.uint8)


def _batch():
    """Sequence 0: the engine's n - 1 rows, all valid; sequence 1: no routes; sequence 2: row 1 names
    expert E (out of range). The old-policy pass's natural routes: n rows each."""
    rollout = [_routes(LENS[0] - 1, 1), None, _routes(LENS[2] - 1, 2)]
    rollout[2][1, 0, 0] = E
    natural = [_routes(n, 10 + b) for b, n in enumerate(LENS)]
    return rollout, natural


def _plan(mode, rollout, natural, **kw):
    return build_replay_plan(replay_spec(mode), rollout, LENS, old_pass_routes=natural, num_layers=L, top_k=K,
                             num_experts=E, **kw)


@pytest.mark.parametrize("mode", ["none", "r2", "r3"])
def test_plan_holds_the_routes_of_each_pass_and_the_one_check(mode):
    rollout, natural = _batch()
    plan = _plan(mode, rollout, natural)
    # the check, the same under every mode (the batch has routes): per row, 0 = usable
    reasons = [[0, 0, 0, 1], [1, 1, 1, 1, 1], [0, 4, 1]]  # 1 = missing (also the absent last row), 4 = range
    assert [r.tolist() for r in plan.route_reasons] == reasons
    # replayed rows are 0 .. n-2: 3 + 4 + 2 = 9, of which 4 (sequence 1) + 1 (sequence 2, row 1) failed
    assert plan.route_metrics["r3/num_rows"] == 9.0 and plan.fallback_token_frac == pytest.approx(5 / 9)
    assert plan.route_metrics["r3/fallback_rows_missing"] == 4.0 and plan.route_metrics["r3/fallback_rows_range"] == 1
    assert plan.metrics == (plan.route_metrics if mode == "r3" else {})
    # comparisons: each sequence cut at its first failed row
    assert [len(r) for r in plan.comparable_routes] == [3, 0, 1]
    np.testing.assert_array_equal(plan.comparable_routes[0], rollout[0])
    for p, source in zip(PASSES, EXPECTED[mode]):
        got = plan.routes(p)
        if source is NONE:
            assert got is None, p
        elif source is OLD:
            assert all(np.array_equal(a, b) for a, b in zip(got, natural)), p
        else:  # the engine's rows where usable, the natural rows elsewhere
            for b, (g, r, nat, c) in enumerate(zip(got, rollout, natural, reasons)):
                want = nat.copy()
                ok = [t for t, code in enumerate(c) if code == 0]
                if ok:
                    want[ok] = np.asarray(r)[ok]
                np.testing.assert_array_equal(g, want, err_msg=f"{p}, sequence {b}")
                assert g.dtype == np.uint8


def test_r3_runs_the_old_pass_only_when_a_replayed_row_needs_it():
    rollout, natural = _batch()
    calls = []

    def old_pass():
        calls.append(1)
        return natural

    plan = _plan("r3", rollout, None, old_pass=old_pass)
    assert calls == [1] and plan.routes(LearnerPass.UPDATE)[1].shape == (LENS[1], L, K)
    valid = [_routes(n - 1, 20 + b) for b, n in enumerate(LENS)]
    plan = _plan("r3", valid, None, old_pass=old_pass)
    assert calls == [1]  # every replayed row usable: the natural pass is not run
    assert [len(r) for r in plan.routes(LearnerPass.PI_OLD)] == [n - 1 for n in LENS]


def test_plan_refusals_name_the_fix():
    rollout, natural = _batch()
    with pytest.raises(ValueError, match="rollout.record_routes=true"):
        _plan("r3", None, None)
    everything_falls_back = _plan("r3", None, natural)  # no engine routes at all: all rows natural, counted
    assert everything_falls_back.fallback_token_frac == 1.0
    assert all(np.array_equal(a, b) for a, b in zip(everything_falls_back.routes(LearnerPass.UPDATE), natural))
    with pytest.raises(ValueError, match="run on another batch"):
        _plan("r2", rollout, natural[:2])
    no_routes = _plan("r2", None, None)
    assert no_routes.routes(LearnerPass.PI_OLD) is None and no_routes.route_reasons is None
    with pytest.raises(ValueError, match="r2 replays the old-policy pass's routes"):
        no_routes.routes(LearnerPass.UPDATE)
    assert math.isnan(no_routes.fallback_token_frac) and no_routes.comparable_routes is None

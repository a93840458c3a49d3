"""The `router/*` step metrics (moe_gspo.routing.router_diag) on a hand-computed batch, and a tiny training run
that logs them on both sides and saves router margins in its traces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_gspo import train
from moe_gspo.routing.trace import load_trace
from moe_gspo.routing.router_diag import router_diagnostics

ROOT = Path(__file__).resolve().parents[2]

# Two sequences, S = 5; seq 0: P=2, R=3 (response log-probs from rows 1..3), seq 1: P=1, R=1 (row 0).
# 2 MoE layers, top-1 of 2 experts. The rollout routes T = P+R-1 rows, the learner P+R.
MASK = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
RO_IDS = [np.array([[0, 0], [0, 0], [1, 0], [1, 0]])[..., None], np.array([[1, 1]])[..., None]]
LE_IDS = [np.array([[0, 0], [0, 0], [1, 0], [0, 0], [1, 1]])[..., None], np.array([[1, 0], [0, 0]])[..., None]]
RO_MARGIN = [np.array([[7, 7], [0.5, 0.2], [0.02, 0.1], [0.004, 0.05]]), np.array([[0.3, 0.001]])]
RO_ENTROPY = [np.full((4, 2), 0.6), np.full((1, 2), 0.6)]
LE_MARGIN = [np.array([[9, 9], [0.5, 0.2], [0.005, 0.1], [0.002, 0.05], [9, 9]]), np.array([[0.3, 0.001], [9, 9]])]
LE_STATS = [np.stack([m, np.broadcast_to([1.0, 0.5], m.shape)], -1) for m in LE_MARGIN]


def _diag(**kw):
    args = dict(response_mask_BS=MASK, num_experts=2, margin_threshold=0.01, learner_routes=LE_IDS,
                learner_stats=LE_STATS, rollout_routes=RO_IDS, rollout_margin=RO_MARGIN, rollout_entropy=RO_ENTROPY)
    return router_diagnostics(**{**args, **kw})


def test_hand_computed_batch():
    m = _diag()
    # rows: seq 0 rows 1..3, seq 1 row 0. Rollout layer 0 ids [0 1 1 1] -> loads [1 3], mean 2 -> 0.5;
    # layer 1 [0 0 0 1] -> 0.5. Learner layer 0 [0 1 0 1] -> 0; layer 1 [0 0 0 0] -> (4 - 2) / 2 = 1.
    assert m["router/max_vio_rollout"] == pytest.approx([0.5, 0.5])
    assert m["router/max_vio_learner"] == pytest.approx([0.0, 1.0])
    assert m["router/max_vio_learner_mean"] == pytest.approx(0.5) and m["router/max_vio_learner_max"] == 1.0
    assert m["router/margin_rollout"] == pytest.approx([(0.5 + 0.02 + 0.004 + 0.3) / 4, (0.2 + 0.1 + 0.05 + 0.001) / 4])
    assert m["router/margin_small_frac_rollout"] == pytest.approx([0.25, 0.25])
    assert m["router/margin_learner"] == pytest.approx([(0.5 + 0.005 + 0.002 + 0.3) / 4, (0.2 + 0.1 + 0.05 + 0.001) / 4])
    assert m["router/margin_small_frac_learner"] == pytest.approx([0.5, 0.25])
    assert m["router/margin_small_frac_learner_mean"] == pytest.approx(3 / 8)
    assert m["router/entropy_rollout"] == pytest.approx([0.6, 0.6])
    assert m["router/entropy_learner"] == pytest.approx([1.0, 0.5]) and m["router/entropy_learner_mean"] == 0.75
    # flips (rollout vs learner): layer 0 at seq 0 row 3 (margin 0.002), layer 1 at seq 1 row 0 (0.001);
    # the learner's small-margin pairs: 0.005 (agreed), 0.002, 0.001 -> 2/3; the other five agree
    assert m["router/flip_frac_small_margin"] == pytest.approx(2 / 3)
    assert m["router/flip_frac_large_margin"] == 0.0


def test_missing_or_partial_rollout_inputs():
    # vLLM: ids only -> MaxVio on the rollout side, everything on the learner side
    m = _diag(rollout_margin=None, rollout_entropy=None)
    assert not any(k.startswith(("router/margin_rollout", "router/entropy_rollout", "router/margin_small_frac_rollout"))
                   for k in m)
    assert m["router/max_vio_rollout"] == pytest.approx([0.5, 0.5]) and "router/flip_frac_small_margin" in m
    # no rollout routes at all: the learner's keys only
    m = _diag(rollout_routes=None, rollout_margin=None, rollout_entropy=None)
    assert all(k.endswith(("learner", "learner_mean", "learner_max")) or "_learner" in k for k in m)
    assert "router/flip_frac_small_margin" not in m
    # seq 1 lost its routes (or holds an id out of range): both sides on seq 0's rows 1..3 only
    for bad in (None, np.array([[5, 1]])[..., None]):
        m = _diag(rollout_routes=[RO_IDS[0], bad])
        assert m["router/max_vio_rollout"] == pytest.approx([1 / 3, 1.0])  # [0 1 1] -> (2 - 1.5) / 1.5; [0 0 0]
        assert m["router/max_vio_learner"] == pytest.approx([1 / 3, 1.0])  # [0 1 0]; [0 0 0]
        assert m["router/margin_learner"][1] == pytest.approx((0.2 + 0.1 + 0.05) / 3)


SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "logging.wandb_mode=disabled",
         "logging.progress=false", "train.export_hf=false", "logging.trace_every=1", "train.checkpoint_every=0",
         "eval.every=0"]


def test_default_config_run_logs_router_metrics_on_both_sides(tmp_path):
    run_dir = tmp_path / "run"
    assert train.main(["--run-dir", str(run_dir), "train.steps=2", *SMALL]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for side in ("rollout", "learner"):
            assert len(r[f"router/max_vio_{side}"]) == 2 and len(r[f"router/margin_{side}"]) == 2
            for key in (f"router/max_vio_{side}_mean", f"router/margin_{side}_mean",
                        f"router/margin_small_frac_{side}_mean", f"router/entropy_{side}_mean"):
                assert math.isfinite(r[key]), key
            assert 0 <= r[f"router/entropy_{side}_mean"] <= math.log(8)
        assert r["router/max_vio_rollout_max"] >= r["router/max_vio_rollout_mean"] >= 0
        # the same rows as routing/*: the rollout's bf16 margins are close to the learner's fp32 ones
        assert r["router/margin_rollout_mean"] == pytest.approx(r["router/margin_learner_mean"], rel=0.05)
    rollout, learner = (load_trace(run_dir / "traces" / f"step_000001_{k}.npz") for k in ("rollout", "learner"))
    for t in (rollout, learner):
        assert t.router_margin is not None and t.router_margin.shape == t.topk_ids.shape[:2]


def test_usable_rows_matches_the_row_by_row_rule():
    """`_usable_rows` checks every sequence's ids at once; it gives what the rule says row by row: the rows
    before a sequence's first row with an id outside [0, E), all rows of a clean sequence, 0 for a missing,
    misshapen or non-integer array."""
    from moe_gspo.routing.router_diag import _usable_rows

    rng = np.random.default_rng(0)
    E, L, K = 8, 2, 2
    arrays = []
    for b in range(40):
        T = int(rng.integers(0, 9))
        a = rng.integers(0, E, size=(T, L, K)).astype(np.int16)
        if T and b % 3 == 0:
            a[rng.integers(0, T), rng.integers(0, L), rng.integers(0, K)] = rng.choice([-1, E, 99])
        arrays.append(a)
    arrays += [None, np.zeros((4, L, K + 1), np.int16), np.zeros((4, L, K), np.float32)]

    def by_row(a):
        if a is None or a.shape[1:] != (L, K) or a.dtype.kind not in "iu":
            return 0
        bad = [t for t in range(len(a)) if ((a[t] < 0) | (a[t] >= E)).any()]
        return bad[0] if bad else len(a)

    assert _usable_rows(arrays, (L, K), E).tolist() == [by_row(a) for a in arrays]
    assert _usable_rows([None, np.zeros((0, L, K), np.int16)], (L, K), E) is None

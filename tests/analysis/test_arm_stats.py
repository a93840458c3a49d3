"""analysis.arm_stats: per-layer means and ratio variance vs response length per arm, by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from analysis.arm_stats import arm_length_variance, layer_means
from analysis.load import RunData


def _run(rows: list[list[float | None]]) -> RunData:
    return RunData(source=Path("x"), traces={},
                   records=[{"step": i, "update/layer_change": r} for i, r in enumerate(rows)])


def test_layer_means_mean_over_steps_then_seeds():
    runs = [(0, _run([[0.1, 0.2], [0.3, None]])),  # seed means [0.2, 0.2] (the null step left out)
            (1, _run([[0.5, 0.4]])),               # seed means [0.5, 0.4]
            (2, RunData(source=Path("y"), records=[{"step": 0}], traces={}))]  # never logged it
    m = layer_means(runs, "update/layer_change")
    assert m.num_seeds == 2
    np.testing.assert_allclose(m.mean_L, [0.35, 0.3])
    np.testing.assert_allclose(m.min_L, [0.2, 0.2])
    np.testing.assert_allclose(m.max_L, [0.5, 0.4])
    assert layer_means(runs, "routing/layer_disagree") is None


def _lp(d_per_seq: list[list[float]]) -> dict[str, np.ndarray]:
    d = np.concatenate([np.asarray(x, np.float64) for x in d_per_seq])
    return {"rollout_logp": np.zeros(d.size, np.float32), "learner_logp": d.astype(np.float32),
            "response_lens": np.asarray([len(x) for x in d_per_seq], np.int32)}


def test_arm_length_variance_shares_bins_and_pools_seeds():
    arm_sets = {
        "a": [[_lp([[.1], [-.1], [.2, 0.], [0., -.2]])],      # seed 0
              [_lp([[.3], [-.3]]), _lp([[.1, .1], [-.1, -.1]])]],  # seed 1, two traced steps
        "b": [[_lp([[.2, .2, .2], [0., 0., 0.]])]],
    }
    # lengths of all arms: 1 x4, 2 x4, 3 x2 -> 2 quantile bins with edges [1, 2, 3]: {1} and {2, 3}
    edges, out = arm_length_variance(arm_sets, num_bins=2)
    np.testing.assert_array_equal(edges, [1, 2, 3])
    e, var = np.exp, np.var
    a, b = out["a"], out["b"]
    assert a.num_seeds == 2 and b.num_seeds == 1
    np.testing.assert_array_equal(a.pooled["num_seqs"], [4, 4])
    np.testing.assert_allclose(a.pooled["token_var"], [var(e([.1, -.1, .3, -.3])),
                                                       var(e([.2, 0, 0, -.2, .1, .1, -.1, -.1]))], rtol=1e-5)
    np.testing.assert_allclose(a.pooled["seq_norm_var"], [var(e([.1, -.1, .3, -.3])),
                                                          var(e([.1, -.1, .1, -.1]))], rtol=1e-5)
    # seed band: per-seed values on the same bins
    np.testing.assert_allclose(a.seed_min["token_var"], [var(e([.1, -.1])), var(e([.1, .1, -.1, -.1]))],
                               rtol=1e-5)
    np.testing.assert_allclose(a.seed_max["token_var"], [var(e([.3, -.3])), var(e([.2, 0, 0, -.2]))],
                               rtol=1e-5)
    np.testing.assert_allclose(a.seed_min["seq_norm_var"], [var(e([.1, -.1]))] * 2, rtol=1e-5)
    # arm b has no length-1 response: its first bin is empty (NaN), not a bin of its own
    np.testing.assert_array_equal(b.pooled["num_seqs"], [0, 2])
    assert np.isnan(b.pooled["token_var"][0]) and np.isnan(b.pooled["len_mid"][0])
    np.testing.assert_allclose(b.pooled["token_var"][1], var(e([.2] * 3 + [0] * 3)), rtol=1e-5)
    np.testing.assert_allclose(b.pooled["seq_norm_var"][1], var(e([.2, 0])), rtol=1e-5)
    np.testing.assert_allclose(b.pooled["len_mid"], [np.nan, 3])


def test_arm_length_variance_leaves_out_arms_with_only_empty_responses():
    empty = {"rollout_logp": np.zeros(0, np.float32), "learner_logp": np.zeros(0, np.float32),
             "response_lens": np.zeros(3, np.int32)}
    edges, out = arm_length_variance({"a": [[_lp([[.1], [-.1]])]], "b": [[empty]]})
    assert list(out) == ["a"]

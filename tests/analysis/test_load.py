"""analysis.load: lenient JSONL reading, trace listing, headline numbers, the variance-by-length stats."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from analysis.load import (
    ReportInputError, RunDataWarning, headline_numbers, list_traces,
    load_run, matrix_series, probe_headline, ratio_variance_by_length, read_jsonl, series,
)
from synth_run import (
    NUM_LAYERS, NUM_STEPS, TRACE_STEPS, recompute_headline, synthetic_probe, write_synthetic_run,
)


def test_headline_numbers_match_recomputation(synthetic_run):
    run = load_run(synthetic_run)
    got = headline_numbers(run.records)
    want = recompute_headline(synthetic_run / "metrics.jsonl")
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_headline_numbers_missing_metric_is_nan():
    recs = [{"step": i, "reward/mean": float(i)} for i in range(20)]
    h = headline_numbers(recs)
    assert h["reward_first10_mean"] == pytest.approx(0.5)  # steps 0, 1
    assert h["reward_last10_mean"] == pytest.approx(18.5)  # steps 18, 19
    assert math.isnan(h["k3_kl_mean"]) and math.isnan(h["update_token_seq_var_ratio"])


def test_truncated_line_skipped_with_line_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward/mean": 0.5}\n\n{"step": 1, "reward/mean": 0.7}\n{"step": 2, "rew')
    with pytest.warns(RunDataWarning, match="line 4"):
        records, notes = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1]
    assert len(notes) == 1 and "line 4" in notes[0]


def test_duplicate_step_keeps_later_line_and_non_objects_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "x": 1.0}, {"step": 0, "x": 0.0}, [1, 2], {"x": 3.0}, {"step": 1, "x": 9.0}]
    path.write_text("\n".join(json.dumps(v) for v in lines) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records, notes = read_jsonl(path)
    assert [(r["step"], r["x"]) for r in records] == [(0, 0.0), (1, 9.0)]
    assert len(notes) == 3 and len([w for w in caught if w.category is RunDataWarning]) == 3


def test_series_null_becomes_nan_and_matrix_skips_bad_shapes():
    recs = [{"step": 0, "a": None, "m": [0.1, 0.2]}, {"step": 1, "a": 2.0, "m": [0.3]},
            {"step": 2, "m": [0.5, None]}]
    steps, vals = series(recs, "a")
    assert steps.tolist() == [0, 1] and math.isnan(vals[0]) and vals[1] == 2.0
    steps, mat = matrix_series(recs, "m")
    assert steps.tolist() == [0, 2] and mat.shape == (2, 2) and math.isnan(mat[1, 1])


def test_load_run_errors(tmp_path):
    with pytest.raises(ReportInputError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportInputError, match="no metrics.jsonl"):
        load_run(tmp_path / "empty")


def test_load_run_reads_traces(synthetic_run):
    run = load_run(synthetic_run)
    assert len(run.records) == NUM_STEPS and run.done is not None
    assert sorted(run.traces) == list(TRACE_STEPS)
    assert set(run.traces[TRACE_STEPS[0]]) == {"rollout", "learner", "updated", "logprobs"}


def test_list_traces_groups_rank_files(tmp_path):
    for name in ("step_000010_rollout_rank1.npz", "step_000010_rollout_rank0.npz",
                 "step_000020_logprobs.npz", ".step_000010_logprobs_rank0.tmp.npz", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    traces = list_traces(tmp_path)
    assert list(traces) == [10, 20]
    assert [p.name for p in traces[10]["rollout"]] == ["step_000010_rollout_rank0.npz",
                                                      "step_000010_rollout_rank1.npz"]
    assert list(traces[20]) == ["logprobs"]


def test_ratio_variance_by_length_hand_example():
    d = np.asarray([0.1, -0.1, 0.2, 0.0, 0.0, -0.2])  # responses of length 1, 1, 2, 2
    lp = {"rollout_logp": np.zeros(6, np.float32), "learner_logp": d.astype(np.float32),
          "response_lens": np.asarray([1, 1, 2, 2], np.int32)}
    out = ratio_variance_by_length([lp], num_bins=2)
    np.testing.assert_allclose(out["len_mid"], [1, 2])
    np.testing.assert_array_equal(out["num_seqs"], [2, 2])
    np.testing.assert_allclose(out["seq_logprod_var"], [0.01, 0.04], rtol=1e-5)  # var([±.1]), var([±.2])
    e = np.exp
    np.testing.assert_allclose(out["token_var"], [np.var(e([.1, -.1])), np.var(e([.2, 0, 0, -.2]))],
                               rtol=1e-5)
    np.testing.assert_allclose(out["seq_norm_var"], [np.var(e([.1, -.1])), np.var(e([.1, -.1]))],
                               rtol=1e-5)


def test_probe_headline_reads_mismatch_ratio_names_and_the_older_ratio_names():
    probe = synthetic_probe()
    h = probe_headline(probe)
    assert h["mismatch_ratio/token_var_flipped"] == 3e-2 and h["num_tokens"] == 1234
    old = dict(probe)
    old["ratio/token_var_flipped"] = old.pop("mismatch_ratio/token_var_flipped")  # a probe file from before
    assert probe_headline(old)["mismatch_ratio/token_var_flipped"] == 3e-2
    assert math.isnan(probe_headline({})["mismatch/k3_kl"])


def test_synthetic_run_has_layers(synthetic_run):
    steps, mat = matrix_series(load_run(synthetic_run).records, "routing/layer_disagree")
    assert mat.shape == (NUM_STEPS, NUM_LAYERS)


def test_load_run_with_traces_only(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "r")
    (run_dir / "metrics.jsonl").unlink()
    run = load_run(run_dir)
    assert run.records == [] and len(run.traces) == len(TRACE_STEPS)


def test_null_steps_are_left_out_of_means_not_counted_as_zero(tmp_path):
    """A variance share of an empty subset is NaN, written as null: the headline mean skips it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shares = [0.5, None, 0.7, float("nan")]
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, v in enumerate(shares):
            f.write(json.dumps({"step": step, "reward/mean": 0.1,
                                "mismatch_ratio/token_var_share_flipped": v}).replace("NaN", "null") + "\n")
    h = headline_numbers(load_run(run_dir).records)
    assert h["flipped_var_share_mean"] == pytest.approx(0.6)
    assert math.isnan(h["k3_kl_replayed_mean"])  # never logged


def test_a_config_yaml_alias_bomb_is_refused_not_expanded(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n')
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefgh"):
        prev = "a" if i == 0 else "bcdefgh"[i - 1]
        bomb.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    (tmp_path / "config.yaml").write_text("\n".join(bomb) + "\n")  # 10**8 values if expanded
    with pytest.raises(ReportInputError, match="config.yaml.*aliases"):  # crafted: one line, exit 2 in the tools
        load_run(tmp_path)
    (tmp_path / "config.yaml").write_text("train: {seed: 3}\nalgo: {name: gspo}\n")
    assert load_run(tmp_path).config == {"train": {"seed": 3}, "algo": {"name": "gspo"}}

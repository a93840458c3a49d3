"""analysis.mechanism / mechanism_step (issue 58): the step replay on the tiny model measures what it says. Before the
first update nothing has moved (ratios 1, no expert changed, no routing error); after it the routes and ratios
move; R2 is its own reference; R3's error at k = 0 is the dial's flips, absent without the dial; TIS differs from
GRPO only when the dial puts a mismatch in; the exponents are statsmodels' fit of a known power law; bad input is one
line."""

from __future__ import annotations

import json
from dataclasses import replace
import math

import numpy as np
import pytest
import torch

from analysis import mechanism
from analysis.mechanism_step import StepSetting, measure_step
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

TINY = dict(length=6, minibatches=2, groups=2, group_size=4, prompt_len=6)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/analysis/conftest.py


def _rows(dose: float) -> dict:
    torch.manual_seed(0)
    cfg = tiny_qwen3_moe_config(num_hidden_layers=2, mlp_only_layers=[0])
    model = build_tiny_model(cfg, seed=0)
    rows = measure_step(model, StepSetting(dose=dose, **TINY), vocab=cfg.vocab_size)
    return {(r["k"], r["method"]): r for r in rows}


@pytest.fixture(scope="module")
def clean():
    return _rows(0.0)


@pytest.fixture(scope="module")
def dialled():
    return _rows(0.5)


def test_before_the_first_update_nothing_has_moved(clean, dialled):
    for rows in (clean, dialled):
        for m in ("grpo", "gspo", "grpo+r2", "grpo+tis"):
            r = rows[(0, m)]
            assert r["token_logratio_var"] < 1e-12 and r["clipped_token_frac"] == 0 and r["experts_changed"] == 0
            assert r["grad_err_routing"] < 1e-5 and r["grad_cos_routing"] > 1 - 1e-9
            assert math.isfinite(r["grad_snr"]) and r["grad_snr"] > 0


def test_after_an_update_routes_and_ratios_move_and_r2_is_its_own_reference(clean):
    r = clean[(1, "grpo")]
    assert r["experts_changed"] > 0 and r["token_logratio_var"] > 0 and r["seq_logratio_sum_var"] > 0
    assert r["grad_err_routing"] > 1e-4  # the routes changed since pi_old: removing that change moves the gradient
    assert clean[(1, "grpo+r2")]["grad_err_routing"] == 0.0
    assert math.isnan(r["grad_snr"])  # SNR only at k = 0, across the mini-batches of one policy
    assert set(k for k in r if k.startswith("experts_changed_layer")) == {"experts_changed_layer0"}


def test_r3_error_at_k0_is_the_dials_flips_and_tis_sees_the_dial(clean, dialled):
    assert clean[(0, "grpo+r3")]["grad_err_routing"] < 1e-5  # no dial: the rollout's routes are pi_old's
    assert dialled[(0, "grpo+r3")]["grad_err_routing"] > 1e-3  # replaying the flipped routes changes the gradient
    assert clean[(0, "grpo+tis")]["grad_err_tis_vs_grpo"] < 1e-5
    assert dialled[(0, "grpo+tis")]["grad_err_tis_vs_grpo"] > 1e-4
    # without replay the dial never enters the ratio: GRPO's ratio at k = 0 is exactly 1 with or without it
    assert dialled[(0, "grpo")]["token_logratio_var"] < 1e-12


def test_route_flips_count_the_dials_flips_per_minibatch(clean, dialled):
    """`route_flips`: token-layers of mini-batch k's rows whose experts differ between the rollout and pi_old; the
    same on every method's row of that k; at a dose of 0.5 the dialled token-layers flip with probability 0.5 (margins
    far above a tie), without the dial none (or ties only)."""
    # 8 rows / 2 mini-batches x (6 prompt + 6 response - 1 positions) x 1 MoE layer
    for rows in (clean, dialled):
        for k in (0, 1):
            assert {rows[(k, m)]["route_token_layers"] for m in ("grpo", "grpo+r3")} == {4 * 11}
            assert rows[(k, "grpo")]["route_flips"] == rows[(k, "grpo+r3")]["route_flips"]
    for k in (0, 1):
        c = clean[(k, "grpo")]
        assert c["route_flips"] == 0 or c["route_flip_margin_max"] <= 1e-5
        assert c["route_flips"] > 0 or math.isnan(c["route_flip_margin_max"])
    flips = sum(dialled[(k, "grpo")]["route_flips"] for k in (0, 1))
    assert 5 <= flips <= 2 * 4 * 11  # each dialled token-layer flips with probability 0.5
    assert max(dialled[(k, "grpo")]["route_flip_margin_max"] for k in (0, 1)) > 1e-3


def test_exponents_recover_a_known_power_law():
    rng = np.random.default_rng(0)
    rows = [{"k": 1, "method": "grpo", "length": L, "depth": d, "dose": 0.0, "seed": seed,
             "grad_err_routing": 0.01 * L ** 0.5 * d ** 1.5 * math.exp(rng.normal(0, 0.01)),
             "token_logratio_var": 1.0, "seq_logratio_mean_var": 1.0, "experts_changed": 0.1}
            for L in (16, 32, 64, 128) for d in (2, 4, 8) for seed in (0, 1, 2)]
    fits = {(f["metric"], f["against"]): f for f in mechanism.exponents(rows)}
    assert fits[("grad_err_routing", "length")]["exponent"] == pytest.approx(0.5, abs=0.02)
    lo, hi = fits[("grad_err_routing", "depth")]["lo"], fits[("grad_err_routing", "depth")]["hi"]
    assert lo < 1.5 < hi and hi - lo < 0.1 and fits[("grad_err_routing", "depth")]["seeds"] == 3
    assert fits[("token_logratio_var", "length")]["exponent"] == pytest.approx(0.0, abs=1e-9)
    # one seed: its rows share a model and a rollout, so no CI (the seed is the unit of replication)
    one = {(f["metric"], f["against"]): f for f in mechanism.exponents([r for r in rows if r["seed"] == 0])}
    assert one[("grad_err_routing", "length")]["exponent"] == pytest.approx(0.5, abs=0.02)
    assert math.isnan(one[("grad_err_routing", "length")]["lo"]) and one[("grad_err_routing", "length")]["seeds"] == 1
    assert "n/a: one seed" in mechanism.page([dict(r, minibatches=2, warm_steps=0, grad_cos_routing=1.0,
                                                    seq_logratio_sum_var=1.0, clipped_token_frac=0.0,
                                                    clipped_seq_frac=0.0, grad_snr=1.0)
                                              for r in rows if r["seed"] == 0],
                                             mechanism.exponents([r for r in rows if r["seed"] == 0]))


def test_the_command_writes_its_files_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "m"
    argv = ["--out", str(out), "--depths", "1", "--lengths", "4", "--minibatches", "2", "--groups", "2",
            "--group-size", "2", "--methods", "grpo,grpo+r2"]
    assert mechanism.main(argv) == 0
    rows = [json.loads(line) for line in (out / "mechanism.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"grpo", "grpo+r2"} and {r["k"] for r in rows} == {0, 1}
    assert "| grpo+r2 |" in (out / "mechanism.md").read_text()
    with pytest.raises(SystemExit) as e:
        mechanism.main(argv)  # would overwrite its rows
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mechanism.main(["--out", str(tmp_path / "x"), "--methods", "grpo,ppo"])
    assert "['ppo'] unknown" in capsys.readouterr().err
    assert mechanism.main(["--out", str(tmp_path / "y"), "--lengths", "4", "--minibatches", "3"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_a_users_checkpoint_is_measured_at_its_own_depth(tmp_path, capsys):
    from moe_gspo.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, num_hidden_layers=4, mlp_only_layers=[0])
    out = tmp_path / "m"
    assert mechanism.main(["--model", str(ckpt), "--out", str(out), "--lengths", "4", "--minibatches", "2",
                           "--groups", "2", "--group-size", "2", "--methods", "grpo", "--depths", "7"]) == 0
    rows = [json.loads(line) for line in (out / "mechanism.jsonl").read_text().splitlines()]
    assert {r["depth"] for r in rows} == {3}  # its three MoE layers; --depths is for the tiny models only
    assert {k for k in rows[0] if k.startswith("experts_changed_layer")} == {f"experts_changed_layer{i}" for i in range(3)}
    assert mechanism.main(["--model", str(tmp_path / "none"), "--out", str(tmp_path / "z")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_warm_up_steps_train_the_policy_and_the_measured_step_starts_from_it():
    """The policy state axis: W GRPO steps (their own rollouts at dose 0) before the measured step, with the optimizer
    it then uses; the measured step's pi_old is the warmed policy's (nothing moved before its first update)."""
    cfg = tiny_qwen3_moe_config(num_hidden_layers=2, mlp_only_layers=[0])
    fresh = build_tiny_model(cfg, seed=0)
    warmed = build_tiny_model(cfg, seed=0)
    s = StepSetting(**TINY)
    a = {(r["k"], r["method"]): r for r in measure_step(fresh, s, vocab=cfg.vocab_size, methods=("grpo",))}
    b = {(r["k"], r["method"]): r for r in measure_step(warmed, replace(s, warm_steps=2), vocab=cfg.vocab_size,
                                                         methods=("grpo",))}
    assert b[(0, "grpo")]["warm_steps"] == 2 and math.isfinite(b[(0, "grpo")]["warm_reward_last"])
    assert math.isnan(a[(0, "grpo")]["warm_reward_last"])
    assert b[(0, "grpo")]["token_logratio_var"] < 1e-12 and b[(0, "grpo")]["experts_changed"] == 0
    assert b[(0, "grpo")]["grad_norm"] != a[(0, "grpo")]["grad_norm"]  # another policy, another rollout
    with pytest.raises(ValueError, match="warm_steps"):
        measure_step(build_tiny_model(cfg, seed=0), replace(s, warm_steps=-1), vocab=cfg.vocab_size)

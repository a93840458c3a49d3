"""Issue 60, item 5: the probe accepts the routing-drift dial (`rollout.router_flip_prob`, `router_noise_std`), from
the command line or from a dialled run's config, says so, and reports its realised rate apart from the rest of the
drift (on a tiny checkpoint the test writes; in-process, world size 1)."""

from __future__ import annotations

import json

import pytest

from moe_gspo import probe
from moe_gspo.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe_dial")
    make_tiny_checkpoint(d / "model", seed=1)
    (d / "prompts.txt").write_text("0123:\nabcd<\n57+21=\nhello world\n")
    return d


def _run(ckpt, tmp_path, *extra):
    out = tmp_path / "drift.json"
    rc = probe.main(["--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"), "--out", str(out),
                     "--samples-per-prompt", "8", "--max-new-tokens", "12", "--dtype", "float32", *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_flip_prob_on_the_command_line_reports_about_that_many_injected_flips(ckpt, tmp_path, capsys):
    """fp32 rollouts (no natural drift on this checkpoint: test_probe.py) with p = 0.1: the dial changes ~10% of
    the (token, MoE layer) routes, and the probe reports it apart from the total."""
    res = _run(ckpt, tmp_path, "rollout.router_flip_prob=0.1")
    out = capsys.readouterr().out
    assert res["routing/dial_flip_prob"] == 0.1 and res["routing/dial_noise_std"] == 0.0
    routes = res["num_tokens"] * len(res["layer_ids"])
    assert routes > 500  # 32 sequences: the binomial sd of the rate is ~0.013
    assert res["routing/dial_flip_frac"] == pytest.approx(0.1, abs=0.045)
    total = sum(res["routing/layer_disagree"]) / len(res["routing/layer_disagree"])
    assert total >= res["routing/dial_flip_frac"] - 0.02  # the learner sees the dialled routes as flips
    assert "note: the routing-drift dial is on (rollout.router_flip_prob=0.1, rollout.router_noise_std=0, from the " \
           "command line)" in out
    assert "routing-drift dial ON (rollout.router_flip_prob=0.1, rollout.router_noise_std=0)" in out
    assert f"injected: routes the dial changed        {res['routing/dial_flip_frac']:.3f}" in out
    assert "the dial's injected drift included" in out


def test_a_dialled_config_probes_with_its_dial_and_says_so(ckpt, tmp_path, capsys):
    """`--config runs/flip/config.yaml` (p = 0.2) used to measure the checkpoint undialled without a word."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text("rollout:\n  engine: hf\n  dtype: float32\n  router_flip_prob: 0.2\ntask:\n  name: copy\n")
    args = probe.parse_args(["--config", str(cfg), "--prompts", "p", "--out", "o.json", "--model", str(ckpt / "model")])
    c = probe.probe_config(args)
    assert (c.rollout.router_flip_prob, c.rollout.router_noise_std) == (0.2, 0.0)
    assert probe.dial_note(c, args).startswith(
        f"note: the routing-drift dial is on (rollout.router_flip_prob=0.2, rollout.router_noise_std=0, from --config {cfg})")
    args = probe.parse_args(["--config", str(cfg), "--prompts", "p", "--out", "o.json", "rollout.router_flip_prob=0"])
    assert probe.dial_note(probe.probe_config(args, need_model=False), args) is None  # switched off: no note
    args = probe.parse_args(["--config", str(cfg), "--prompts", "p", "--out", "o.json", "rollout.router_noise_std=0.5"])
    assert "from the command line" in probe.dial_note(probe.probe_config(args, need_model=False), args)


def test_an_undialled_probe_has_no_dial_keys_or_lines():
    res = {"model": "m", "engine": "hf", "dtype": "float32", "num_sequences": 1, "num_tokens": 1, "layer_ids": [1],
           "routing/layer_disagree": [0.0], "routing/any_layer_flip": 0.0, "mismatch/k1_kl": 0.0, "mismatch/k3_kl": 0.0,
           "mismatch/logp_abs_diff_mean": 0.0, "mismatch/logp_abs_diff_max": 0.0, "mismatch/extreme_frac_ln2": 0.0,
           "mismatch/extreme_frac_ln5": 0.0, "mismatch_ratio/token_var": 0.0, "mismatch_ratio/seq_var": 0.0,
           "mismatch_ratio/token_var_share_flipped": None, "mismatch_ratio/token_var_share_agreed": None}
    text = probe.summary_text(res)
    assert "dial" not in text and "(fraction of tokens whose top-k set differs):" in text
    dialled = probe.summary_text(res | {"routing/dial_flip_prob": 0.2, "routing/dial_noise_std": 0.0,
                                        "routing/dial_flip_frac": 0.19, "routing/layer_disagree": [0.25]})
    assert "at least 0.060 (total - injected)" in dialled


def test_the_dial_with_the_vllm_engine_is_one_line(ckpt, tmp_path, capsys):
    rc = probe.main(["--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"), "--out",
                     str(tmp_path / "x.json"), "--engine", "vllm", "rollout.router_flip_prob=0.1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("error:") == 1 and "router_flip_prob" in err
    assert not (tmp_path / "x.json").exists()

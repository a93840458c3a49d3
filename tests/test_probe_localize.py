"""`python -m moe_gspo.probe --localize` (issue 41): the divergence localiser end to end on a tiny checkpoint."""

import json

import pytest

from moe_gspo import probe
from moe_gspo.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe_localize")
    make_tiny_checkpoint(d / "model", seed=1)
    (d / "prompts.txt").write_text("0123:\nabcd<\n57+21=\nhello world\n")
    return d


def _run(ckpt, tmp_path, *extra):
    out = tmp_path / "drift.json"
    rc = probe.main(["--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"), "--out", str(out),
                     "--samples-per-prompt", "6", "--max-new-tokens", "12", "--localize", *extra])
    assert rc == 0
    return out, json.loads(out.read_text())


def test_bf16_localize_names_the_first_diverging_layer_and_tensor(ckpt, tmp_path, capsys):
    out, res = _run(ckpt, tmp_path, "--dtype", "bfloat16", "--localize-out", str(tmp_path / "loc.json"))
    first = res["localize/first_divergence"]
    assert first is not None and first["layer"] in (0, 1, 2, "final")
    assert first["tensor"] in res["localize/compared"]
    assert res["localize/tol"] == 1e-2  # the bf16 default
    # a bf16 rollout differs from the fp32 learner from the first attention output on
    assert res["localize/first_difference"]["layer"] == 0
    assert res["localize/first_difference"]["tensor"] == "attn_out"
    rel = res["localize/rel_err"]
    assert len(rel["hidden_after_mlp"]) == 3 and rel["router_logits"][0] is None  # layer 0 is dense
    assert all(v > 0 for v in rel["hidden_after_mlp"])
    s = res["localize/logp"]
    assert 0 < s["p95"] <= s["p99"] <= s["max"] and s["num_tokens"] == res["num_tokens"]
    assert s["max"] == pytest.approx(res["mismatch/logp_abs_diff_max"], rel=1e-6)
    assert set(s["argmax"]) == {"sequence", "token"}
    assert (tmp_path / "drift_localize_depth.png").stat().st_size > 0
    assert (tmp_path / "loc_localize_depth.png").stat().st_size > 0
    alone = json.loads((tmp_path / "loc.json").read_text())
    assert alone["localize/first_divergence"] == first
    printed = capsys.readouterr().out
    assert "first divergence layer" in printed and "p95 / p99" in printed


def test_fp32_localize_is_below_tolerance_and_names_the_first_bitwise_difference(ckpt, tmp_path):
    _, res = _run(ckpt, tmp_path, "--dtype", "float32")
    assert res["localize/tol"] == 1e-5
    assert res["localize/first_divergence"] is None
    assert res["localize/logp"]["max"] <= 1e-5
    assert res["localize/rel_err"]["topk_ids"][1:] == [0.0, 0.0]
    # the two fp32 stacks agree bit for bit up to the first MoE block's output (its combine), not beyond
    first = res["localize/first_difference"]
    assert first is not None and (first["layer"], first["tensor"]) == (1, "mlp_out")
    assert res["localize/rel_err"]["attn_out"][:2] == [0.0, 0.0]


def test_localize_tol_must_be_positive(ckpt, tmp_path, capsys):
    rc = probe.main(["--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"),
                     "--out", str(tmp_path / "x.json"), "--localize", "--localize-tol", "0"])
    assert rc == 2
    assert "--localize-tol" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()

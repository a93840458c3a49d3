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
    assert "first divergence layer" in printed and "p95 / p99" in printed and "only the top-k ids" not in printed


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


def test_vllm_branch_compares_routes_and_log_probs_only(ckpt):
    """What `--engine vllm` can compare (its outputs hold log-probs and routed experts, no hidden states): the
    route-only branch, fed samples of the transformers engine (fp32: identical routes)."""
    import torch

    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.mcore.checkpoint import load_hf_config, load_megatron_from_hf_dir
    from moe_gspo.mcore.model import forward_logits, moe_layer_ids
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.hf_engine import HFEngine
    from moe_gspo.probe_localize import VLLM_NOTE, probe_localize

    model_dir = ckpt / "model"
    hf_config = load_hf_config(model_dir)
    init_distributed(ep_size=1, num_experts=hf_config.num_experts, seed=0)
    try:
        model, _ = load_megatron_from_hf_dir(model_dir, ep_size=1, params_dtype=torch.float32,
                                             enable_routing_replay=False, token_dispatcher="allgather")
        engine = HFEngine(model_dir, dtype="float32", device="cpu")
        samples = engine.generate([[3, 4, 5, 6], [7, 8]], SamplingParams(n=2, temperature=1.0, max_new_tokens=6,
                                                                         seed=0))
        batch = PackedBatch.from_samples(samples, torch.zeros(len(samples)), 0)
        with torch.no_grad():
            lp = torch.log_softmax(forward_logits(model, batch.input_ids_BS).float(), -1)
        logp_BS = torch.zeros_like(batch.rollout_logp_BS)
        logp_BS[:, 1:] = lp[:, :-1].gather(-1, batch.input_ids_BS[:, 1:, None])[..., 0]
        res = probe_localize(None, "vllm", model, samples, logp_BS, tol=1e-5, layer_ids=[0, 1, 2],
                             moe_layer_ids=moe_layer_ids(hf_config))
    finally:
        destroy_distributed()
    assert res["compared"] == ["topk_ids"] and res["note"] == VLLM_NOTE
    from moe_gspo.routing.localize import summary_lines

    # issue 49: the console line says what was compared ("first bitwise difference ... topk_ids" alone misled)
    assert summary_lines(res)[0].endswith("(only the top-k ids and log-probs were compared: the engine returns no "
                                          "hidden states, router logits or expert outputs)")
    assert res["rel_err"] == {"topk_ids": [None, 0.0, 0.0]}
    assert res["first_divergence"] is None
    assert res["logp"]["max"] <= 1e-5 and res["logp"]["num_tokens"] == sum(len(s.response_ids) for s in samples)

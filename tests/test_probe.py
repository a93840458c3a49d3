"""moe_gspo.probe on a tiny checkpoint the test writes (in-process, world size 1)."""

import json

import pytest

from moe_gspo import probe
from moe_gspo.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    make_tiny_checkpoint(d / "model", seed=1)
    (d / "prompts.txt").write_text("0123:\nabcd<\n\n57+21=\nhello world\n")
    return d


def _run(ckpt, tmp_path, *extra):
    out = tmp_path / "drift.json"
    rc = probe.main(["--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"), "--out", str(out),
                     "--samples-per-prompt", "6", "--max-new-tokens", "12", *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_fp32_rollout_matches_learner_exactly(ckpt, tmp_path, capsys):
    res = _run(ckpt, tmp_path, "--dtype", "float32")
    assert res["num_sequences"] == 4 * 6
    assert res["num_tokens"] > 0
    assert len(res["routing/layer_disagree"]) == len(res["layer_ids"]) == 2
    assert res["routing/layer_disagree"] == [0.0, 0.0]
    assert res["routing/any_layer_flip"] == 0.0
    assert res["mismatch/logp_abs_diff_max"] <= 1e-4
    for key in ("mismatch/k1_kl", "mismatch/k3_kl", "mismatch/extreme_frac_ln2", "mismatch_ratio/token_var",
                "mismatch_ratio/seq_var"):
        assert key in res
    # issue 43: one meaning per name: ratio/* is the new/old policy ratio of metrics.jsonl, which a probe has not
    assert not any(k.startswith("ratio/") for k in res)
    assert "any-layer flip fraction" in capsys.readouterr().out


def test_bf16_rollout_shows_routing_drift(ckpt, tmp_path):
    res = _run(ckpt, tmp_path, "--dtype", "bfloat16")
    assert res["routing/any_layer_flip"] > 0
    assert max(res["routing/layer_disagree"]) > 0
    assert res["mismatch/logp_abs_diff_mean"] > 1e-4
    # the flipped/agreed split covers the response tokens
    assert 0 <= res["mismatch_ratio/flipped_token_frac"] <= 1


@pytest.mark.parametrize("case,msg", [
    ("missing_dir", "is not a directory"),
    ("dense", "qwen3_moe"),
    ("empty_prompts", "holds no prompts"),
])
def test_bad_inputs_exit_2_with_one_clear_message(ckpt, tmp_path, capsys, case, msg):
    model, prompts = ckpt / "model", ckpt / "prompts.txt"
    if case == "missing_dir":
        model = tmp_path / "nope"
    elif case == "dense":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        cfg = Qwen3Config(vocab_size=51, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        model = tmp_path / "dense"
        Qwen3ForCausalLM(cfg).save_pretrained(model)
    else:
        prompts = tmp_path / "empty.txt"
        prompts.write_text("\n \n")
    rc = probe.main(["--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "x.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("error:") == 1
    assert not (tmp_path / "x.json").exists()


def test_read_prompts_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b", "answer": 1}\n')
    assert probe.read_prompts(f) == ["a", "b"]
    f.write_text('{"prompt": "a"}\n{"q": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:2"):
        probe.read_prompts(f)


@pytest.mark.slow
def test_probe_under_torchrun_ep2_fp32_has_no_drift(ckpt, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "drift_ep2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moe_gspo.probe", "--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"),
           "--out", str(out), "--dtype", "float32", "--samples-per-prompt", "3", "--max-new-tokens", "6"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["num_sequences"] == 4 * 3
    assert res["routing/any_layer_flip"] == 0.0
    assert res["mismatch/logp_abs_diff_max"] <= 1e-4


def test_no_loading_weights_bar_with_logging_progress_false(ckpt, tmp_path, capfd):
    """transformers' "Loading weights" bar showed with logging.progress=false (issue 22, item 8)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # another test's run may have turned it off in this process
    try:
        _run(ckpt, tmp_path, "--dtype", "float32")
        assert "Loading weights" in capfd.readouterr().err  # the bar this test is about
        _run(ckpt, tmp_path, "--dtype", "float32", "logging.progress=false")
        assert "Loading weights" not in capfd.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_a_prompt_longer_than_the_context_is_named_before_the_model_loads(ckpt, tmp_path, capsys, monkeypatch):
    """Issue 22, item 1: the probe's prompt file is checked like the training data."""
    import moe_gspo.mcore.checkpoint as mcore_ckpt

    def load(*a, **k):
        raise AssertionError("the model was loaded before the prompt lengths were checked")

    monkeypatch.setattr(mcore_ckpt, "load_megatron_from_hf_dir", load)
    prompts = tmp_path / "p.txt"
    prompts.write_text("0123:\n\n" + "1" * 250 + "\n")  # the tiny model's context is 256 tokens
    rc = probe.main(["--model", str(ckpt / "model"), "--prompts", str(prompts), "--out", str(tmp_path / "d.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert (f"{prompts}:3: the prompt has 250 tokens, more than the 224 that fit the hf engine's context (the model's "
            "max_position_embeddings=256, minus --max-new-tokens (rollout.max_new_tokens)=32") in err


def test_overrides_and_config_reach_the_probe(ckpt, tmp_path, capsys):
    """Issue 22, item 7: the probe takes --config and section.key=value like train."""
    args = probe.parse_args(["--prompts", "p", "--out", "o.json", "--model", str(ckpt / "model"),
                             "model.tokenizer=TOK", "rollout.max_model_len=64", "--engine", "vllm"])
    cfg = probe.probe_config(args)
    assert (cfg.model.tokenizer, cfg.rollout.max_model_len, cfg.rollout.engine, cfg.rollout.max_new_tokens) == \
        ("TOK", 64, "vllm", 32)
    args = probe.parse_args(["--config", "configs/tiny_cpu.yaml", "--prompts", "p", "--out", "o.json",
                             "model.path=M", "--max-new-tokens", "5"])
    cfg = probe.probe_config(args)
    assert (cfg.model.path, cfg.rollout.max_new_tokens, cfg.rollout.record_routes) == ("M", 5, True)
    for argv, msg in ((["train.lr=1"], "the probe does not use train.lr"),
                      (["--max-new-tokens", "5", "rollout.max_new_tokens=6"], "contradicts the override"),
                      (["configs/tiny_cpu.yaml"], "did you mean --config configs/tiny_cpu.yaml")):
        rc = probe.main(["--model", str(ckpt / "model"), "--prompts", "p", "--out", str(tmp_path / "o.json"), *argv])
        assert rc == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and msg in err, err


def test_probe_help_lists_the_fields_it_uses_with_their_values(capsys):
    with pytest.raises(SystemExit) as e:
        probe.parse_args(["--help", "rollout.max_model_len=64", "--engine", "vllm"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "values of the probe's defaults with rollout.max_model_len=64" in out
    assert "rollout.max_model_len = 64 (built-in default null)" in out
    assert "rollout.max_new_tokens = 32 (built-in default 8)" in out
    assert "train.lr" not in out and "model.tokenizer = null" in out


def test_quantization_reaches_the_probe_config(tmp_path):
    args = probe.parse_args(["--prompts", "p", "--out", "o.json", "--model", str(tmp_path), "--quantization", "fp8",
                             "rollout.fp8_scale=tensor"])
    cfg = probe.probe_config(args)
    assert (cfg.rollout.quantization, cfg.rollout.fp8_scale) == ("fp8", "tensor")
    res = {k: 0.0 for k in ("routing/any_layer_flip", "mismatch/k1_kl", "mismatch/k3_kl", "mismatch/logp_abs_diff_mean",
                            "mismatch/logp_abs_diff_max", "mismatch/extreme_frac_ln2", "mismatch/extreme_frac_ln5",
                            "mismatch_ratio/token_var", "mismatch_ratio/seq_var",
                            "mismatch_ratio/token_var_share_flipped", "mismatch_ratio/token_var_share_agreed")}
    summary = probe.summary_text(dict(res, model="m", engine="hf", dtype="bfloat16", quantization="fp8",
                                      fp8_scale="tensor", num_sequences=1, num_tokens=1, layer_ids=[],
                                      **{"routing/layer_disagree": []}))
    assert "rollout: hf engine in bfloat16 with FP8 (e4m3) weights, per-tensor scales (emulated)" in summary


def test_every_override_the_help_shows_is_accepted(tmp_path, capsys):
    """`--help` used to show the train CLI's example `train.steps=20`, which the probe refuses (issue 32,
    defect 6): every `section.key=value` the probe's help shows must pass the probe's own checks, each
    example together with the overrides written next to it (e.g. the vLLM ones after rollout.engine=vllm)."""
    import re

    with pytest.raises(SystemExit) as e:
        probe.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    groups: list[list[str]] = []
    end = None
    for m in re.finditer(r"(?<![\w.])([a-z_0-9]+\.[a-z_0-9]+)=([^\s`,;)]+)", text):
        if m.group(1) == "section.key":
            continue
        override = f"{m.group(1)}={m.group(2).rstrip('.:')}".replace("=DIR", f"={tmp_path}")  # a placeholder
        if end is not None and not text[end:m.start()].strip():
            groups[-1].append(override)  # written next to the previous one: one example
        else:
            groups.append([override])
        end = m.end()
    shown = [o for g in groups for o in g]
    assert [o for o in shown if o.split("=")[0] not in probe.PROBE_KEYS] == []
    assert "rollout.max_new_tokens=64" in shown  # the overrides' own example
    assert ["rollout.engine=vllm", "rollout.max_model_len=4096", "rollout.kv_cache_gib=2", f"model.tokenizer={tmp_path}"] in groups
    for group in groups:
        args = probe.build_parser().parse_intermixed_args(["--prompts", "-", "--out", "-", *group])
        probe.probe_config(args, need_model=False)  # raises ValueError when refused
    # the check is the one that refused the old example
    args = probe.build_parser().parse_intermixed_args(["--prompts", "-", "--out", "-", "train.steps=20"])
    with pytest.raises(ValueError, match="the probe does not use train.steps"):
        probe.probe_config(args, need_model=False)

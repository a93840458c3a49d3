import re
import warnings

import pytest
import yaml

from moe_gspo.config import AlgoConfig, Config, TrainConfig
from moe_gspo.config_load import config_from_dict, field_docs, load_config, parse_override


def test_defaults_validate_and_roundtrip_yaml(tmp_path):
    cfg = load_config(None)
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    assert load_config(p) == cfg


def test_overrides_typed():
    cfg = load_config(None, ["train.lr=1e-4", "rollout.max_new_tokens=3", "algo.name=grpo", "model.path=null"])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.rollout.max_new_tokens == 3 and cfg.algo.name == "grpo" and cfg.model.path is None
    assert cfg.algo.clip_range() == (0.2, 0.27)
    assert load_config(None, ["algo.name=gspo"]).algo.clip_range() == (3e-4, 4e-4)
    assert load_config(None, ["algo.clip_low=1e-3", "algo.clip_high=2e-3"]).algo.clip_range() == (1e-3, 2e-3)


@pytest.mark.parametrize("overrides,msg", [
    (["train.lr=abc"], "train.lr='abc' must be a number"),
    (["train.steps=1.5"], "train.steps=1.5 must be an integer"),
    (["train.steps=0"], "train.steps=0 must be > 0"),
    (["train.bogus=1"], "unknown config key 'train.bogus'"),
    (["nosection.x=1"], "must be section.key"),
    (["trainlr"], "must look like section.key=value"),
    (["algo.name=ppo"], "algo.name='ppo' is not one of"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.top_k=-1"], "rollout.top_k=-1 must be in [0, rollout.support_cap=256]"),
    (["rollout.top_k=300"],
     "rollout.top_k=300 must be in [0, rollout.support_cap=256] (0 = off); raise rollout.support_cap"),
    (["rollout.support_cap=0"], "rollout.support_cap=0 must be > 0"),
    (["rollout.engine=vllm", "rollout.top_p=0.9", "rollout.temperature=0.7"],
     "rollout.engine=vllm with rollout.top_p=0.9 / rollout.top_k=0 and rollout.temperature=0.7: the engine's "
     "same-support log-probs are vLLM's processed_logprobs"),
    (["rollout.record_routes=yes_please"], "rollout.record_routes"),
    (["algo.routing_replay=r3", "rollout.record_routes=false"], "algo.routing_replay=r3"),
    (["algo.aggregation=token_mean"], "algo.loss_agg_mode=token-mean (algo.aggregation=token_mean) does not apply to gspo"),
    (["algo.name=gmpo", "algo.loss_agg_mode=seq-mean-token-sum"], "does not apply to gmpo: a sequence-level method"),
    (["algo.name=grpo", "algo.aggregation=seq_mean", "algo.loss_agg_mode=token-mean"],
     "algo.aggregation=seq_mean (the old name of algo.loss_agg_mode=seq-mean-token-mean) contradicts"),
    (["algo.name=grpo", "algo.loss_scale_factor=8"], "algo.loss_scale_factor=8.0 has no effect"),
    (["algo.name=grpo", "algo.loss_agg_mode=mean"], "algo.loss_agg_mode='mean' is not one of"),
    (["algo.kl_estimator=k4"], "algo.kl_estimator='k4' is not one of"),
    (["algo.scale_rewards=std"], "algo.scale_rewards='std' is not one of"),
    (["algo.name=sapo", "algo.clip_high=0.2"], "algo.clip_high=0.2 has no effect with algo.name=sapo"),
    (["algo.name=grpo", "algo.options.tau_neg=2"],
     "algo.options.tau_neg=2 is not an option of algo.name=grpo (its options: none); it is an option of algo.name=sapo"),
    (["algo.name=sapo", "algo.options.tau_pos=0"], "algo.options.tau_pos=0.0 must be > 0 (gate temperature"),
    (["algo.name=sapo", "algo.options.tau_pos=hot"], "algo.options.tau_pos='hot' must be a number"),
    (["algo.name=sapo", "algo.options.temperature=1"], "algo.options.temperature=1 is not an option of algo.name=sapo "
                                                       "(its options: tau_pos, tau_neg)"),
    (["algo.name=sapo", "algo.sapo_tau_pos=1.2"],  # an old key: one line naming the new one
     "algo.sapo_tau_pos is now algo.options.tau_pos; write algo.options.tau_pos=1.2 (in YAML: options: {tau_pos: 1.2}"),
    (["algo.options=3"], "algo.options must be a mapping"),
    (["train.lr.x=1"], "train.lr is not a mapping field"),
    (["algo.name=gmpo", "algo.clip_low=0"], "algo.clip_low=0.0 must be > 0 (a log-space bound"),
    (["algo.name=cispo", "algo.clip_high=-1"], "algo.clip_high=-1.0 must be > 0"),
    (["algo.max_num_gen_batches=3"], "algo.max_num_gen_batches=3 has no effect with algo.dynamic_sampling=false"),
    (["algo.dynamic_sampling=true", "algo.max_num_gen_batches=0"], "algo.max_num_gen_batches=0 must be > 0"),
    (["task.name=jsonl"], "task.path"),
    (["algo.rollout_is=tis"], "algo.rollout_is='tis' is not one of"),
    (["algo.rollout_rs=geometric"], "algo.rollout_rs=geometric needs algo.rollout_rs_threshold"),
    (["algo.rollout_rs=token", "algo.rollout_rs_threshold=0.9"], "algo.rollout_rs_threshold=0.9 must be > 1"),
    (["algo.rollout_rs=token", "algo.rollout_rs_threshold=2", "algo.rollout_rs_threshold_lower=1.5"],
     "algo.rollout_rs_threshold_lower=1.5 must be in"),
    (["algo.rollout_rs_threshold=2"], "algo.rollout_rs_threshold=2.0 has no effect with algo.rollout_rs=none"),
    (["algo.opsm_delta=0.01"], "algo.opsm_delta=0.01 has no effect with algo.opsm=false"),
    (["algo.opsm=true", "algo.opsm_delta=-0.1"], "algo.opsm_delta=-0.1 must be >= 0"),
    (["algo.r3_fallback_warn_frac=1.5"], "algo.r3_fallback_warn_frac=1.5 must be in [0, 1]"),
    (["algo.rollout_is_threshold=3"], "algo.rollout_is_threshold=3.0 has no effect with algo.rollout_is=none"),
    (["algo.rollout_is=token", "algo.rollout_is_threshold=0"], "algo.rollout_is_threshold=0.0 must be > 0"),
    (["logging.update_drift_every=-1"], "logging.update_drift_every=-1 must be >= 0"),
    (["rollout.prompts_per_step=3", "rollout.samples_per_prompt=3"], "not divisible by train.num_minibatches"),
    # issue 12, defect 6: accepted silently before
    (["rollout.samples_per_prompt=1", "rollout.prompts_per_step=4"], "rollout.samples_per_prompt=1: group-relative"),
    (["train.lr=.nan"], "train.lr=nan must be a finite number"),
    (["train.grad_clip=inf"], "train.grad_clip=inf must be a finite number"),
    (["parallel.collective_timeout_s=0"], "parallel.collective_timeout_s=0.0 must be > 0"),
    # the transformers engine's fast paths (issue 33)
    (["rollout.engine=vllm", "rollout.compact_decode=true"], "rollout.compact_decode=true applies to rollout.engine=hf only"),
    (["rollout.engine=vllm", "rollout.fp32_gemm=false"], "rollout.fp32_gemm=false applies to rollout.engine=hf only"),
    (["rollout.dtype=float32", "rollout.fp32_gemm=true"],
     "rollout.fp32_gemm=true computes bf16 GEMMs as fp32 GEMMs, but rollout.dtype=float32"),
    (["rollout.compact_decode=sometimes"], "rollout.compact_decode"),
])
def test_bad_values_name_the_field(overrides, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        load_config(None, overrides)


def test_unknown_section_and_bad_file(tmp_path):
    with pytest.raises(ValueError, match="unknown config section 'optimizer'"):
        config_from_dict({"optimizer": {}})
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping of sections"):
        load_config(bad)


def test_gspo_with_token_level_clip_warns_and_grpo_with_sequence_clip_warns():
    with pytest.warns(UserWarning, match="token-level range"):
        load_config(None, ["algo.name=gspo", "algo.clip_low=0.2", "algo.clip_high=0.2"])
    with pytest.warns(UserWarning, match="clips almost every token"):
        load_config(None, ["algo.name=grpo", "algo.clip_low=3e-4", "algo.clip_high=4e-4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["algo.name=grpo"])  # paper defaults: no warning


def test_algorithm_defaults_and_loss_options():
    from moe_gspo.algos import ALGOS, KL_ESTIMATORS, LOSS_AGG_MODES, SCALE_REWARDS
    from moe_gspo.config import LOSS_AGG_MODES as CONFIG_MODES

    # the config's copies of the modes (config.py imports no torch) stay in step; the defaults are the AlgoSpecs'
    assert set(CONFIG_MODES) == set(LOSS_AGG_MODES)
    hints = {f: AlgoConfig.__dataclass_fields__[f].type for f in ("kl_estimator", "scale_rewards")}
    assert all(k in hints["kl_estimator"] for k in KL_ESTIMATORS) and all(k in hints["scale_rewards"] for k in SCALE_REWARDS)
    expected = {"gspo": ((3e-4, 4e-4), "seq-mean-token-mean"), "gspo_token": ((3e-4, 4e-4), "seq-mean-token-mean"),
                "grpo": ((0.2, 0.27), "seq-mean-token-mean"), "gmpo": ((0.4, 0.4), "seq-mean-token-mean"),
                "cispo": ((1.0, 0.27), "token-mean"), "sapo": ((None, None), "seq-mean-token-mean")}
    assert set(expected) <= set(ALGOS)
    for algo, (clip, mode) in expected.items():
        opts = load_config(None, [f"algo.name={algo}"]).algo.loss_options()
        assert ((opts["clip_low"], opts["clip_high"]), opts["loss_agg_mode"]) == (clip, mode), algo
        assert opts["kl_estimator"] == "k3"
        # each algorithm's own options only (sapo's temperatures, at the paper's values)
        assert opts["options"] == ({"tau_pos": 1.0, "tau_neg": 1.05} if algo == "sapo" else {}), algo
    # an option given is checked as its type; the others keep their defaults
    cfg = load_config(None, ["algo.name=sapo", "algo.options.tau_neg=2"])
    assert cfg.algo.options == {"tau_neg": 2.0} and isinstance(cfg.algo.options["tau_neg"], float)
    assert cfg.algo.loss_options()["options"] == {"tau_pos": 1.0, "tau_neg": 2.0}
    # an older run's config.yaml (every key written, the temperatures null) still loads
    assert load_config(None, ["algo.name=sapo", "algo.sapo_tau_pos=null", "algo.sapo_tau_neg=null"]).algo.options == {}
    # old configs keep working: aggregation is an alias of loss_agg_mode
    cfg = load_config(None, ["algo.name=grpo", "algo.aggregation=token_mean"])
    assert cfg.algo.loss_options()["loss_agg_mode"] == "token-mean"
    assert load_config(None, ["algo.name=grpo", "algo.aggregation=token_mean",
                              "algo.loss_agg_mode=token-mean"]).algo.resolved_loss_agg_mode() == "token-mean"
    # Dr. GRPO's constant: rollout.max_new_tokens unless given
    cfg = load_config(None, ["algo.name=sapo", "algo.loss_agg_mode=seq-mean-token-sum-norm", "rollout.max_new_tokens=13"])
    assert cfg.algo.loss_options()["loss_scale_factor"] == 13.0
    cfg = load_config(None, ["algo.name=cispo", "algo.loss_agg_mode=seq-mean-token-sum-norm", "algo.loss_scale_factor=64",
                             "algo.kl_estimator=k2", "algo.scale_rewards=none", "algo.clip_low=0.5"])
    assert (cfg.algo.loss_options()["loss_scale_factor"], cfg.algo.kl_estimator, cfg.algo.clip_range()) == (64.0, "k2", (0.5, 0.27))
    assert cfg.algo.num_gen_batches_bound() == 1
    assert load_config(None, ["algo.dynamic_sampling=true"]).algo.num_gen_batches_bound() == 10
    assert load_config(None, ["algo.dynamic_sampling=true", "algo.max_num_gen_batches=3"]).algo.num_gen_batches_bound() == 3


def test_every_algo_takes_routing_replay_and_corrections():
    """Every method compares new and old log-probs of the same tokens, so R2/R3 (the same routes in
    both passes) and the rollout corrections apply to all of them."""
    for algo in ("gmpo", "cispo", "sapo"):
        for replay in ("none", "r2", "r3"):
            cfg = load_config(None, [f"algo.name={algo}", f"algo.routing_replay={replay}", "algo.rollout_is=token"])
            assert (cfg.algo.name, cfg.algo.routing_replay) == (algo, replay)


def test_rollout_corrections_accepted_on_every_algo():
    for algo in ("gspo", "gspo_token", "grpo", "gmpo", "cispo", "sapo"):
        cfg = load_config(None, [f"algo.name={algo}", "algo.rollout_is=sequence", "algo.rollout_is_threshold=5",
                                 "algo.rollout_rs=geometric", "algo.rollout_rs_threshold=1.001"])
        assert (cfg.algo.rollout_is, cfg.algo.rollout_rs, cfg.algo.rollout_rs_threshold) == ("sequence", "geometric", 1.001)


def test_tempered_sampling_warns_naming_the_fields():
    for overrides in (["rollout.temperature=0.7"], ["rollout.temperature=0.7", "rollout.top_p=0.9"]):
        with pytest.warns(UserWarning, match=r"rollout.temperature=0.7: .*biased"):
            load_config(None, overrides)


def test_top_p_and_top_k_alone_are_exact_same_support_sampling():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no bias warning: both sides renormalise over the sampled support
        cfg = load_config(None, ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.support_cap=64"])
    assert (cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.support_cap) == (0.9, 20, 64)
    from moe_gspo.algos.support import DEFAULT_SUPPORT_CAP
    assert load_config(None).rollout.support_cap == DEFAULT_SUPPORT_CAP and load_config(None).rollout.top_k == 0
    assert load_config(None, ["rollout.engine=vllm", "rollout.top_k=5"]).rollout.top_k == 5  # temperature 1


def test_every_field_has_a_docstring():
    import dataclasses
    for sec in dataclasses.fields(Config):
        cls = type(getattr(Config(), sec.name))
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without docstring: {missing}"


def test_shipped_configs_load():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert files, "no configs shipped"
    for f in files:
        data = yaml.safe_load(f.read_text())
        if "base_config" in data:  # the ablation matrix file, not a run config
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(f)


def test_parse_override_yaml_values():
    assert parse_override("model.tiny={num_experts: 16}") == ("model", "tiny", {"num_experts": 16})
    # one entry of a mapping field, merged into what the file or an earlier override gave
    assert parse_override("algo.options.tau_pos=1.5") == ("algo", "options.tau_pos", 1.5)
    cfg = config_from_dict({"algo": {"name": "sapo", "options": {"tau_pos": 1.5}}}, ["algo.options.tau_neg=2"])
    assert cfg.algo.options == {"tau_pos": 1.5, "tau_neg": 2.0}
    assert parse_override("train.export_hf=false")[2] is False


def test_duplicate_yaml_key_is_rejected_naming_key_and_line(tmp_path):
    """Issue 12, defect 6: a second `train:` section used to replace the first silently."""
    f = tmp_path / "dup.yaml"
    f.write_text("train:\n  steps: 3\nrollout:\n  dtype: float32\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ValueError, match=r"dup.yaml' line 5: duplicate key 'train' \(first given on line 1\)"):
        load_config(f)
    f.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ValueError, match=r"line 3: duplicate key 'steps' \(first given on line 2\)"):
        load_config(f)


@pytest.mark.parametrize("body", ["train:\n  - steps\n", "train: [1, 2]\n", "train: 3\n"])
def test_section_of_the_wrong_type_is_one_clear_error(tmp_path, body):
    """Issue 12, defect 7: a section given as a list was a TypeError / an unrelated ValueError."""
    f = tmp_path / "c.yaml"
    f.write_text(body)
    with pytest.raises(ValueError, match="config section 'train' must be a mapping"):
        load_config(f)


def test_non_utf8_config_names_file_and_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"train:\n  steps: 3\n# caf\xe9\n")
    with pytest.raises(ValueError, match=r"c.yaml' line 3: not valid UTF-8"):
        load_config(f)


def test_default_and_shipped_configs_resolve_outside_the_checkout(tmp_path, monkeypatch):
    """Issue 32, defect 1: `configs/NAME` (the train default included) is found from any directory, and
    --help lists the default config's values, not the dataclass defaults."""
    from moe_gspo.config_load import CONFIG_DIR, load_config
    from moe_gspo.run.cli import TRAIN_DEFAULT_CONFIG, _train_help

    monkeypatch.chdir(tmp_path)
    shipped = yaml.safe_load((CONFIG_DIR / "tiny_cpu.yaml").read_text())
    cfg = load_config(TRAIN_DEFAULT_CONFIG)
    assert cfg.train.steps == shipped["train"]["steps"] != Config().train.steps
    help_text = _train_help([])
    assert f"train.steps = {shipped['train']['steps']}" in help_text and "does not load" not in help_text
    with pytest.raises(ValueError, match=r"'configs/nope.yaml' does not exist .*tiny_cpu.yaml"):
        load_config("configs/nope.yaml")
    # a file of the user's own in the working directory wins over the shipped one of the same name
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny_cpu.yaml").write_text("train:\n  steps: 3\n")
    assert load_config(TRAIN_DEFAULT_CONFIG).train.steps == 3


def test_jsonl_task_without_an_eval_set_turns_eval_off_with_a_warning(tmp_path):
    """The README's `task.name=jsonl task.path=FILE` on the default config (eval.every: 50) must run."""
    from moe_gspo.config_load import load_config

    with pytest.warns(UserWarning, match=r"eval.every=50 with task.name=jsonl but no prompts to evaluate on: "
                                         r"evaluation is off"):
        cfg = load_config("configs/tiny_cpu.yaml", ["task.name=jsonl", "task.path=x.jsonl"])
    assert cfg.eval.every == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config("configs/tiny_cpu.yaml", ["task.name=jsonl", "task.path=x.jsonl",
                                                     "eval.holdout=1"]).eval.every == 50


def test_fast_path_fields_default_to_today_and_reach_the_builders(monkeypatch):
    """model.fused_rope reaches both Megatron model builds (policy and KL reference); rollout.compact_decode and
    rollout.fp32_gemm reach the transformers engine; the defaults keep the measured-faster paths."""
    from types import SimpleNamespace

    import torch

    import moe_gspo.mcore.model as mcore_model
    from moe_gspo.run.learner_passes import ReferencePolicy
    from moe_gspo.run.setup import build_engine, build_policy
    from moe_gspo.tiny import build_tiny_model

    cfg = load_config(None)
    assert cfg.model.fused_rope is True and cfg.rollout.compact_decode is None and cfg.rollout.fp32_gemm is None

    class Built(Exception):
        pass

    def fake_build(hf_config, **kw):
        raise Built(kw)

    monkeypatch.setattr(mcore_model, "build_gpt_model", fake_build)
    for value in (True, False):
        cfg = load_config(None, [f"model.fused_rope={str(value).lower()}"])
        info = SimpleNamespace(ep_size=1, ep_rank=0)
        with pytest.raises(Built) as policy:
            build_policy(cfg, info)
        with pytest.raises(Built) as reference:
            ReferencePolicy(cfg, info, SimpleNamespace(hf_config=None))
        assert policy.value.args[0]["fused_rope"] is value and reference.value.args[0]["fused_rope"] is value

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    model = build_tiny_model(seed=0)
    if not torch.cuda.is_available():  # (fp32_gemm=true is for CPU engines; on CUDA it is an error)
        cfg = load_config(None, ["rollout.compact_decode=false", "rollout.fp32_gemm=true"])
        engine = build_engine(cfg, model, tok)
        assert not engine.compact_decode and engine.fp32_gemm
    cfg = load_config(None, ["rollout.compact_decode=true", "rollout.fp32_gemm=false"])
    engine = build_engine(cfg, model, tok)
    assert engine.compact_decode and not engine.fp32_gemm

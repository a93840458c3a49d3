"""moe_gspo.ablate: spec validation, arm expansion, resume / skip / failure handling (with a fake arm
runner in place of torchrun), the dry run, and the real subprocess runner on trivial commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from moe_gspo.ablate import (
    Arm, SubprocessArmRunner, arm_state, build_command, dry_run, expand_arms, format_override, load_spec,
    main, parse_spec, run_ablation,
)


def _spec_dict(tmp_path: Path, **changes) -> dict:
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 3\n")
    d = {"base_config": str(base), "algos": ["gspo", "grpo"], "routing_replay": ["none", "r2"],
         "seeds": [0, 1], "overrides": {"train.steps": 4, "rollout.record_probs": False},
         "nproc": 2, "parallel_arms": 1, "out_dir": str(tmp_path / "abl"),  # one run at a time, on any machine
         "exclude": [{"algo": "gspo", "routing_replay": "r2"}]}
    d.update(changes)
    return d


def _write_spec(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump(_spec_dict(tmp_path, **changes)))
    return path


class FakeRunner:
    """Writes a small finished run dir instead of training; fails the arms named in `fail`."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.fail = set(fail)
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, arm: Arm, command: list[str], log_path: Path) -> int:
        self.calls.append((arm.name, command))
        log_path.write_text("fake training log\n")
        if arm.name in self.fail:
            return 3
        with open(arm.run_dir / "metrics.jsonl", "w") as f:
            for step in range(4):
                f.write(json.dumps({"step": step, "reward/mean": 0.1 * step + 0.01 * arm.seed,
                                    "clip/token_frac": 0.02, "ratio/token_var": 1e-3,
                                    "ratio/seq_var": 1e-4, "routing/any_layer_flip": 0.03,
                                    "update/expert_change_frac": 0.1}) + "\n")
        (arm.run_dir / "done.json").write_text(json.dumps({"step": 4, "wall_s": 0.1, "summary": {}}))
        return 0


def test_expand_arms_applies_exclude(tmp_path):
    arms = expand_arms(parse_spec(_spec_dict(tmp_path)))
    assert [a.name for a in arms] == ["gspo-none-s0", "gspo-none-s1", "grpo-none-s0", "grpo-none-s1",
                                      "grpo-r2-s0", "grpo-r2-s1"]
    assert arms[0].run_dir == tmp_path / "abl" / "gspo-none-s0"


def test_build_command(tmp_path):
    spec = parse_spec(_spec_dict(tmp_path))
    arm = expand_arms(spec)[-1]
    cmd = build_command(spec, arm, resume=False)
    assert cmd[:7] == [sys.executable, "-m", "moe_gspo.launch", "--standalone",
                       "--nproc-per-node", "2", "-m"]
    assert cmd[7] == "moe_gspo.train"
    i = cmd.index("--algo")
    assert cmd[i + 1] == "grpo" and cmd[cmd.index("--routing-replay") + 1] == "r2"
    assert cmd[cmd.index("--run-dir") + 1] == str(arm.run_dir)
    assert cmd[-3:] == ["train.seed=1", "train.steps=4", "rollout.record_probs=false"]
    assert "--resume" not in cmd
    resumed = build_command(spec, arm, resume=True)
    assert resumed.index("--resume") < resumed.index("train.seed=1")  # flags before overrides


def test_format_override():
    assert format_override("a.b", True) == "a.b=true"
    assert format_override("a.b", None) == "a.b=null"
    assert format_override("a.b", [1, 2]) == "a.b=[1, 2]"
    assert format_override("a.b", 3e-4) == "a.b=0.0003"


@pytest.mark.parametrize("change, match", [
    ({"algos": ["gspo", "ppo"]}, "unknown algos"),
    ({"routing_replay": []}, "non-empty list"),
    ({"seeds": [0, 0]}, "distinct"),
    ({"overrides": {"train.seed": 3}}, "list seeds under 'seeds'"),
    ({"overrides": {"steps": 3}}, "must be dotted"),
    ({"nproc": 0}, "positive int"),
    ({"exclude": [{"algorithm": "gspo"}]}, "'exclude'"),
    ({"bogus": 1}, "unknown keys"),
])
def test_parse_spec_rejects(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(_spec_dict(tmp_path, **change))


def test_missing_required_key(tmp_path):
    d = _spec_dict(tmp_path)
    del d["seeds"]
    with pytest.raises(ValueError, match="missing required keys \\['seeds'\\]"):
        parse_spec(d)


def test_second_invocation_skips_finished_arms(tmp_path):
    spec = load_spec(_write_spec(tmp_path))
    runner = FakeRunner()
    first = run_ablation(spec, runner, progress=False)
    assert len(runner.calls) == 6 and all(r.status == "finished" for r in first)
    assert (spec.out_dir / "comparison" / "report.html").is_file()
    second = run_ablation(spec, runner, progress=False, compare=False)
    assert len(runner.calls) == 6  # no new calls
    assert [r.status for r in second] == ["skipped"] * 6


def test_failed_arm_is_reported_and_others_run(tmp_path, capsys):
    runner = FakeRunner(fail=("grpo-none-s0",))
    code = main([str(_write_spec(tmp_path))], arm_runner=runner)
    assert code == 1
    assert len(runner.calls) == 6
    out = capsys.readouterr().out
    log = tmp_path / "abl" / "grpo-none-s0" / "train.log"
    assert f"FAILED grpo-none-s0: exit code 3; log: {log}" in out
    assert "5 finished, 0 skipped (already done), 1 failed" in out
    assert arm_state(Arm("grpo", "none", 1, tmp_path / "abl" / "grpo-none-s1")) == "done"
    # The rerun retries only the failed arm.
    runner2 = FakeRunner()
    assert main([str(_write_spec(tmp_path))], arm_runner=runner2) == 0
    assert [name for name, _ in runner2.calls] == ["grpo-none-s0"]


def test_exit_zero_without_done_json_is_a_failure(tmp_path):
    spec = load_spec(_write_spec(tmp_path, algos=["grpo"], routing_replay=["none"], seeds=[0]))
    results = run_ablation(spec, lambda arm, cmd, log: 0, progress=False, compare=False)
    assert results[0].status == "failed" and "no done.json" in results[0].message


def test_runner_exception_fails_only_that_arm(tmp_path):
    spec = load_spec(_write_spec(tmp_path, algos=["grpo"], routing_replay=["none"]))
    fake = FakeRunner()

    def runner(arm, cmd, log):
        if arm.seed == 0:
            raise OSError("no such launcher")
        return fake(arm, cmd, log)

    results = run_ablation(spec, runner, progress=False, compare=False)
    assert [r.status for r in results] == ["failed", "finished"]
    assert "OSError: no such launcher" in results[0].message


def test_unfinished_arm_with_checkpoint_resumes(tmp_path):
    spec = load_spec(_write_spec(tmp_path, algos=["grpo"], routing_replay=["none"], seeds=[0]))
    run_dir = spec.out_dir / "grpo-none-s0"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    runner = FakeRunner()
    results = run_ablation(spec, runner, progress=False, compare=False)
    assert "--resume" in runner.calls[0][1] and results[0].status == "finished"
    assert not run_dir.with_name("grpo-none-s0.prev1").exists()


def test_unfinished_arm_without_checkpoint_is_moved_aside(tmp_path):
    spec = load_spec(_write_spec(tmp_path, algos=["grpo"], routing_replay=["none"], seeds=[0]))
    run_dir = spec.out_dir / "grpo-none-s0"
    (run_dir / "checkpoints" / "step_000002.tmp").mkdir(parents=True)  # incomplete: not a checkpoint
    (run_dir / "train.log").write_text("crashed\n")
    runner = FakeRunner()
    results = run_ablation(spec, runner, progress=False, compare=False)
    assert "--resume" not in runner.calls[0][1]
    prev = run_dir.with_name("grpo-none-s0.prev1")
    assert (prev / "train.log").read_text() == "crashed\n"
    assert str(prev) in results[0].message and results[0].status == "finished"


def test_dry_run_lists_arms_and_touches_nothing(tmp_path, capsys):
    spec_path = _write_spec(tmp_path)
    runner = FakeRunner()
    assert main([str(spec_path), "--dry-run", "--out", str(tmp_path / "other")], arm_runner=runner) == 0
    out = capsys.readouterr().out
    for name in ("gspo-none-s0", "gspo-none-s1", "grpo-none-s0", "grpo-r2-s1"):
        assert name in out
    assert "gspo-r2" not in out and "6 runs (3 arms x 2 seeds), 6 to run" in out
    assert str(tmp_path / "other" / "grpo-r2-s1") in out
    assert runner.calls == [] and not (tmp_path / "other").exists()


def test_bad_spec_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    spec_path = _write_spec(tmp_path, base_config=str(tmp_path / "nope.yaml"))
    assert main([str(spec_path)], arm_runner=FakeRunner()) == 2
    assert "base_config" in capsys.readouterr().err


def test_shipped_ablation_config_parses():
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "ablation_tiny.yaml")
    arms = expand_arms(spec)
    assert {a.algo for a in arms} == {"gspo", "gspo_token", "grpo"}
    assert {a.group for a in arms if a.algo == "grpo"} == {"grpo-none", "grpo-r2", "grpo-r3"}
    assert spec.overrides["train.steps"] == 200 and spec.nproc == 2


def test_subprocess_runner_logs_and_returns_code(tmp_path):
    arm = Arm("grpo", "none", 0, tmp_path)
    log = tmp_path / "train.log"
    code = SubprocessArmRunner()(arm, [sys.executable, "-c", "import sys; print('hello'); sys.exit(4)"], log)
    assert code == 4
    text = log.read_text()
    assert text.startswith("$ ") and "hello" in text


def test_subprocess_runner_timeout_kills(tmp_path):
    arm = Arm("grpo", "none", 0, tmp_path)
    log = tmp_path / "train.log"
    code = SubprocessArmRunner(timeout_s=0.5)(arm, [sys.executable, "-c", "import time; time.sleep(60)"], log)
    assert code == 124 and "killed after 0.5 s" in log.read_text()


def test_commands_parse_with_the_train_cli():
    cli = pytest.importorskip("moe_gspo.run.cli")
    spec = load_spec(Path(__file__).resolve().parents[1] / "configs" / "ablation_tiny.yaml")
    spec.base_config = Path(__file__).resolve().parents[1] / spec.base_config
    for arm in expand_arms(spec):
        cmd = build_command(spec, arm, resume=True)
        args, cfg = cli.parse_train_args(cmd[cmd.index("moe_gspo.train") + 1:])
        assert (cfg.algo.name, cfg.algo.routing_replay, cfg.train.seed) == (arm.algo, arm.routing_replay,
                                                                            arm.seed)
        assert cfg.train.steps == 200 and args.resume and args.run_dir == str(arm.run_dir)


def test_variants_axis_names_runs_and_orders_overrides(tmp_path):
    spec = parse_spec(_spec_dict(tmp_path, algos=["grpo"], routing_replay=["none"], seeds=[0],
                                 variants={"none": {}, "tis": {"algo.rollout_is": "token", "train.steps": 5}},
                                 exclude=[{"variant": "none", "seed": 1}]))
    arms = expand_arms(spec)
    assert [(a.name, a.group) for a in arms] == [("grpo-none-none-s0", "grpo-none-none"),
                                                 ("grpo-none-tis-s0", "grpo-none-tis")]
    assert arms[1].run_dir == tmp_path / "abl" / "grpo-none-tis-s0"
    cmd = build_command(spec, arms[1], resume=False)
    # the variant's overrides come after the spec's, so its train.steps=5 wins over train.steps=4
    assert cmd[-5:] == ["train.seed=0", "train.steps=4", "rollout.record_probs=false", "algo.rollout_is=token",
                        "train.steps=5"]
    assert build_command(spec, arms[0], resume=False)[-1] == "rollout.record_probs=false"


def test_algo_overrides_apply_per_algorithm_before_the_variant(tmp_path):
    spec = parse_spec(_spec_dict(tmp_path, algos=["grpo", "gspo"], routing_replay=["none"], seeds=[0], exclude=[],
                                 algo_overrides={"gspo": {"train.lr": 0.002, "train.steps": 6}},
                                 variants={"v": {"train.steps": 5}}))
    by_name = {a.name: a for a in expand_arms(spec)}
    gspo = build_command(spec, by_name["gspo-none-v-s0"], resume=False)
    grpo = build_command(spec, by_name["grpo-none-v-s0"], resume=False)
    # spec overrides, then the algorithm's, then the variant's (the variant's train.steps wins)
    assert gspo[-6:] == ["train.seed=0", "train.steps=4", "rollout.record_probs=false", "train.lr=0.002",
                         "train.steps=6", "train.steps=5"]
    assert not any(a.startswith("train.lr=") for a in grpo)


@pytest.mark.parametrize("algo_overrides,match", [
    ({"sapo": {"train.lr": 1.0}}, "not in 'algos'"),
    ({"grpo": {"algo.name": "gspo"}}, "axis of the matrix"),
    ({"grpo": ["train.lr=1"]}, "must map dotted keys"),
])
def test_bad_algo_overrides_are_rejected(tmp_path, algo_overrides, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(_spec_dict(tmp_path, algo_overrides=algo_overrides))


@pytest.mark.parametrize("variants,match", [
    ({"a-b": {}}, "variant name"),
    ({"x": {"algo.name": "gspo"}}, "axis of the matrix"),
    ({"x": {"train.seed": 3}}, "list seeds"),
    ({"x": ["algo.rollout_is=token"]}, "must map dotted keys"),
    ([], "must be a mapping"),
])
def test_bad_variants_are_rejected(tmp_path, variants, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(_spec_dict(tmp_path, variants=variants))


def test_dry_run_reports_invalid_arm_configs(tmp_path, capsys):
    spec_path = _write_spec(tmp_path, variants={"ok": {}, "bad": {"algo.rollout_rs": "geometric"}})
    assert main([str(spec_path), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "invalid config" in out and "algo.rollout_rs=geometric needs algo.rollout_rs_threshold" in out
    assert "12 runs (6 arms x 2 seeds), 6 to run, 6 with an invalid config" in out


def test_shipped_rollout_correction_ablation_validates(capsys):
    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "configs" / "ablation_rollout_corr.yaml")
    spec.base_config = root / spec.base_config
    arms = expand_arms(spec)
    assert {a.algo for a in arms} == {"grpo"} and len(spec.variants) == 5
    assert {a.variant for a in arms} == {"none", "tis_token", "tis_seq", "mis_token", "mis_geo"}
    rows = dry_run(spec)
    assert all(action == "run" or action.startswith("skip") or action == "resume" for _, action, _ in rows)
    cli = pytest.importorskip("moe_gspo.run.cli")
    for arm in arms:
        cmd = build_command(spec, arm, resume=False)
        _, cfg = cli.parse_train_args(cmd[cmd.index("moe_gspo.train") + 1:])
        assert cfg.algo.name == "grpo"
        assert (cfg.algo.rollout_is != "none") == arm.variant.startswith("tis")
        assert (cfg.algo.rollout_rs != "none") == arm.variant.startswith("mis")


def test_shipped_paper_claims_ablation_validates(capsys):
    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "configs" / "ablation_paper_claims.yaml")
    spec.base_config = root / spec.base_config
    arms = expand_arms(spec)
    assert len(arms) == 24 and spec.seeds == [0, 1, 2]
    assert {a.group for a in arms} == {f"{g}-{v}" for g in ("gspo-none", "grpo-none", "grpo-r2", "grpo-r3")
                                       for v in ("base", "lr_high")}
    rows = dry_run(spec)
    assert all(action == "run" or action.startswith("skip") or action == "resume" for _, action, _ in rows)
    assert "24 runs (8 arms x 3 seeds)" in capsys.readouterr().out
    cli = pytest.importorskip("moe_gspo.run.cli")
    base_lr = yaml.safe_load(spec.base_config.read_text())["train"]["lr"]
    for arm in arms:
        cmd = build_command(spec, arm, resume=False)
        _, cfg = cli.parse_train_args(cmd[cmd.index("moe_gspo.train") + 1:])
        assert (cfg.algo.name, cfg.algo.routing_replay) == (arm.algo, arm.routing_replay)
        assert cfg.train.steps == 150 and cfg.logging.trace_every == 10 and cfg.task.name == "copy"
        assert cfg.train.lr == (2.0e-3 if arm.variant == "lr_high" else base_lr)


def test_shipped_algorithms_ablation_validates(capsys):
    """configs/ablation_algos.yaml (issue 21): the six algorithms without replay and GRPO with R2 / R3, 3 seeds,
    each arm with its algorithm's defaults."""
    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "configs" / "ablation_algos.yaml")
    spec.base_config = root / spec.base_config
    arms = expand_arms(spec)
    assert len(arms) == 24 and spec.seeds == [0, 1, 2]
    assert {a.group for a in arms} == {f"{a}-none" for a in ("gspo", "gspo_token", "grpo", "gmpo", "cispo", "sapo")} | {
        "grpo-r2", "grpo-r3"}
    rows = dry_run(spec)
    assert all(action == "run" or action.startswith("skip") or action == "resume" for _, action, _ in rows)
    assert "24 runs (8 arms x 3 seeds)" in capsys.readouterr().out
    cli = pytest.importorskip("moe_gspo.run.cli")
    for arm in arms:
        cmd = build_command(spec, arm, resume=False)
        _, cfg = cli.parse_train_args(cmd[cmd.index("moe_gspo.train") + 1:])
        assert (cfg.algo.name, cfg.algo.routing_replay) == (arm.algo, arm.routing_replay)
        assert cfg.train.steps == 150 and cfg.task.name == "copy" and not cfg.algo.dynamic_sampling
        assert cfg.algo.resolved_loss_agg_mode() == ("token-mean" if arm.algo == "cispo" else "seq-mean-token-mean")


def test_seed_keys_set_every_listed_key_per_seed(tmp_path):
    """`seed_keys: [train.seed, model.init_seed]`: each seed also draws its own initial model (issue 47)."""
    spec = parse_spec(_spec_dict(tmp_path, seed_keys=["train.seed", "model.init_seed"]))
    arm = expand_arms(spec)[-1]
    cmd = build_command(spec, arm, resume=False)
    assert cmd[-4:] == ["train.seed=1", "model.init_seed=1", "train.steps=4", "rollout.record_probs=false"]
    assert parse_spec(_spec_dict(tmp_path)).seed_keys == ["train.seed"]  # the default: today's commands


@pytest.mark.parametrize("seed_keys,match", [
    (["model.init_seed"], "includes train.seed"), (["train.seed", "train.seed"], "distinct"),
    ("train.seed", "must be a list"), (["train.seed", "steps"], "dotted"),
])
def test_bad_seed_keys_are_rejected(tmp_path, seed_keys, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(_spec_dict(tmp_path, seed_keys=seed_keys))
    with pytest.raises(ValueError, match="set per seed"):
        parse_spec(_spec_dict(tmp_path, seed_keys=["train.seed", "train.steps"]))


def test_ablation_tiny_keeps_its_local_command_lines():
    """Issue 50: `executor: local` stays the default, and configs/ablation_tiny.yaml gives the command lines it
    gave before the SLURM executor (checked against commit 972fbf5's --dry-run)."""
    spec = load_spec("ablation_tiny")
    from moe_gspo.run.ablation_spec import default_parallel_arms

    assert spec.executor == "local" and str(spec.base_config).endswith("configs/tiny_cpu.yaml")
    assert spec.parallel_arms == default_parallel_arms(spec.nproc)  # the key is not set: the machine's rule
    arms = expand_arms(spec)
    assert [a.name for a in arms] == [f"{g}-s{s}" for g in ("gspo-none", "gspo-r3", "gspo_token-none", "grpo-none",
                                                            "grpo-r2", "grpo-r3") for s in (0, 1)]
    assert build_command(spec, arms[3], resume=False) == [
        sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train",
        "--config", str(spec.base_config), "--algo", "gspo", "--routing-replay", "r3",
        "--run-dir", "runs/ablation_tiny/gspo-r3-s1", "train.seed=1", "train.steps=200", "logging.trace_every=10"]
    resumed = build_command(spec, arms[3], resume=True)
    assert resumed[16] == "--resume" and resumed[:16] + resumed[17:] == build_command(spec, arms[3], resume=False)

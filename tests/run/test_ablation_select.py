"""Issue 60 item 3: a phase matrix from the command line. `ablate --seeds / --only` shrink a spec without editing
it (one line for a seed or an arm not in it); the dose-naming rule (`moe_gspo.run.dose_names`) is enforced when
a spec is read; the shipped template for one's own model validates."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moe_gspo.ablate import main
from moe_gspo.run.ablation_arms import expand_arms, select_runs
from moe_gspo.run.ablation_spec import load_spec, parse_spec
from moe_gspo.run.dose_names import check_variant_names

ROOT = Path(__file__).resolve().parents[2]


def test_seeds_and_only_shrink_the_phase_matrix(capsys, tmp_path):
    """The issue's command lists exactly 2 runs, in the full matrix's run directories."""
    code = main(["--config", str(ROOT / "configs" / "ablation_phase.yaml"), "--out", str(tmp_path / "phase"),
                 "--seeds", "1000", "--only", "grpo-none-p0,grpo-none-p10", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("grpo")]
    assert rows == ["grpo-none-p0-s1000", "grpo-none-p10-s1000"]
    assert "2 runs (2 arms x 1 seed), 2 to run" in out
    assert "warning" not in err  # the exclude rules of the other seeds are not "matching no arm"


def test_selection_keeps_the_specs_order_and_its_exclude_rules():
    spec = load_spec(ROOT / "configs" / "ablation_phase.yaml")
    full = expand_arms(spec, warn=False)
    small = select_runs(spec, "1003,1000", None)
    assert small.seeds == [1000, 1003]
    arms = expand_arms(small, warn=False)
    assert {a.name for a in arms} == {a.name for a in full if a.seed in (1000, 1003)}  # bf16 etc.: 1000 only
    assert len(arms) == 19 + 16
    only = expand_arms(select_runs(spec, None, "gspo-none-p40,grpo-r3-p0"), warn=False)
    assert [a.run_dir for a in only] == [a.run_dir for a in full if a.group in ("gspo-none-p40", "grpo-r3-p0")]
    assert len(only) == 20


@pytest.mark.parametrize("argv,msg", [
    (["--seeds", "5,1000"], "error: --seeds: 5 not among the spec's seeds 1000, 1001,"),
    (["--seeds", "1000,x"], "error: --seeds 1000,x: give comma-separated integers, e.g. --seeds 1000,1001"),
    (["--only", "grpo-none-p7"], "error: --only: grpo-none-p7 not an arm of the spec (<algo>-<replay>[-<variant>]); "
                                 "its arms: grpo-none-p0, grpo-none-p2.5,"),
    (["--only", "gspo-r3-p0"], "error: --only: gspo-r3-p0 not an arm of the spec"),  # excluded by the spec
])
def test_a_seed_or_arm_not_in_the_spec_is_one_line(capsys, tmp_path, argv, msg):
    code = main(["--config", str(ROOT / "configs" / "ablation_phase.yaml"), "--out", str(tmp_path / "p"), "--dry-run",
                 *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith(msg), err
    assert not (tmp_path / "p").exists()


def _spec(tmp_path: Path, variants: dict, **more) -> dict:
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 3\n")
    return {"base_config": str(base), "algos": ["grpo"], "routing_replay": ["none"], "seeds": [0],
            "out_dir": str(tmp_path / "abl"), "variants": variants, **more}


@pytest.mark.parametrize("variants,overrides", [
    ({"p0": {}, "p10": {"rollout.router_flip_prob": 0.1}, "p2.5_tis": {"rollout.router_flip_prob": 0.025,
                                                                       "algo.rollout_is": "token"}}, {}),
    ({"p0": {}, "s0.25": {"rollout.router_noise_std": 0.25}, "bf16": {"rollout.dtype": "bfloat16"}}, {}),
    ({"p0": {"rollout.router_flip_prob": 0.0}, "p20": {}}, {"rollout.router_flip_prob": 0.2}),  # the spec's own
    ({"none": {}, "tis": {"algo.rollout_is": "token"}}, {}),  # no dial: any names
    ({"mb1": {"train.num_minibatches": 1}, "mb16": {"train.num_minibatches": 16}}, {}),
])
def test_names_by_the_rule_pass(tmp_path, variants, overrides):
    spec = parse_spec(_spec(tmp_path, variants, overrides=overrides))
    assert list(spec.variants) == list(variants)


@pytest.mark.parametrize("variants,msg", [
    ({"zero": {}, "n05": {"rollout.router_noise_std": 0.05}},
     "variant 'n05' sets the routing-drift dial (rollout.router_flip_prob=0, rollout.router_noise_std=0.05) but is "
     "not named by the dose-naming rule: a variant that sets the routing-drift dial is named <dose>[_<fix>], p0 for "
     "zero drift, p<N> for rollout.router_flip_prob = N/100"),
    ({"p0": {}, "p10": {"rollout.router_flip_prob": 0.2}},
     "variant 'p10' sets rollout.router_flip_prob=0.2, rollout.router_noise_std=0, against the dose-naming rule"),
    ({"p0": {"rollout.router_flip_prob": 0.1}}, "variant 'p0' sets rollout.router_flip_prob=0.1"),
    ({"p0": {}, "s0.25": {"rollout.router_flip_prob": 0.25}}, "variant 's0.25' sets rollout.router_flip_prob=0.25"),
    ({"p0": {}, "s0": {}}, "variant 's0' sets rollout.router_flip_prob=0, rollout.router_noise_std=0, against"),
    ({"zero": {}, "p10": {"rollout.router_flip_prob": 0.1}},
     "variants ['p10'] set the routing-drift dial but none is the zero dose p0; add `p0: {}`"),
    ({"mb1": {}, "mb0": {"train.num_minibatches": 0}}, "variant 'mb0': a staleness dose is mb<N> with N = "
                                                       "train.num_minibatches >= 1"),
])
def test_a_variant_named_against_the_rule_is_one_line(tmp_path, capsys, variants, msg):
    with pytest.raises(ValueError, match="^ablation spec: " + __import__("re").escape(msg)):
        check_variant_names(variants)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, variants)))
    assert main(["--config", str(path), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and msg in err


def test_the_template_for_ones_own_model_validates(capsys, tmp_path):
    """configs/ablation_phase_template.yaml: named by the rule, every arm's config valid (the dial moved onto the
    transformers engine from a vLLM base config)."""
    spec = load_spec("ablation_phase_template")
    check_variant_names(spec.variants, spec.overrides)
    assert {"p0", "s1"} <= set(spec.variants) and spec.overrides["rollout.engine"] == "hf"
    assert main(["--config", "configs/ablation_phase_template.yaml", "--out", str(tmp_path / "p"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "30 runs (10 arms x 3 seeds), 30 to run, 0 with an invalid config" in out

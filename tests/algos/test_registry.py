"""The algorithm registry (moe_gspo/algos/registry.py): one `AlgoSpec` per algorithm, registered once;
unknown names and bad plug-ins are one ValueError naming algo.name and the fix; a spec's defaults reach
the config and `policy_loss` without any name check."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest
import torch

from moe_gspo.algos import ALGOS, policy_loss
from moe_gspo.algos import registry
from moe_gspo.algos.loss_common import PolicyTerms, grad_carrier
from moe_gspo.algos.registry import AlgoOption, AlgoSpec, algo_names, get_algo, register_algo
from moe_gspo.config_load import load_config


@pytest.fixture(autouse=True)
def _private_registry(monkeypatch):
    """Each test registers into a copy: the process-wide registry stays the built-ins."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_PLUGINS", dict(registry._PLUGINS))


def _pg_terms(inp, *, clip_low, clip_high, **_):
    objective_BT = torch.where(inp.mask, inp.adv_BT * grad_carrier(inp), 0.0)
    return PolicyTerms(objective_BT=objective_BT, metrics={"toy/marker": torch.tensor(7.0, dtype=torch.float64)})


def _toy(**kw) -> AlgoSpec:
    base = dict(name="toy_pg", doc="plain policy gradient", terms=_pg_terms, level="token", clip="ratio",
                default_clip=(0.1, 0.15), default_agg="token-mean")
    return AlgoSpec(**{**base, **kw})


TOY_FILE = """
import torch
from moe_gspo.algos.loss_common import PolicyTerms, grad_carrier
from moe_gspo.algos.registry import AlgoSpec

def terms(inp, *, clip_low, clip_high, **_):
    return PolicyTerms(objective_BT=torch.where(inp.mask, inp.adv_BT * grad_carrier(inp), 0.0), metrics={})

SPEC = AlgoSpec(name="{name}", doc="a file's loss", terms=terms, level="token", clip="ratio",
                default_clip=(0.05, 0.06), default_agg="seq-mean-token-sum")
NOT_A_SPEC = 3
"""


def _write(tmp_path, name="file_pg", body=TOY_FILE, fname="my_loss.py"):
    path = tmp_path / fname
    path.write_text(textwrap.dedent(body).replace("{name}", name))
    return path


def test_the_builtins_are_registered_in_order():
    assert ALGOS == algo_names() and ALGOS[:6] == ("gspo", "gspo_token", "grpo", "gmpo", "cispo", "sapo")
    for name in ALGOS:
        spec = get_algo(name)
        assert spec.name == name and spec.doc and "\n" not in spec.doc
        assert (spec.default_clip is None) == (spec.clip == "none")
    assert [n for n in ALGOS[:6] if get_algo(n).sequence_level] == ["gspo", "gspo_token", "gmpo"]


def test_a_duplicate_name_is_refused_and_the_same_spec_twice_is_not():
    with pytest.raises(ValueError, match=r"an algorithm named 'gspo' is registered already .*another AlgoSpec.name"):
        register_algo(_toy(name="gspo"))
    spec = register_algo(_toy())
    assert register_algo(spec) is spec and get_algo("toy_pg") is spec  # the same object again: fine
    with pytest.raises(ValueError, match="'toy_pg' is registered already"):
        register_algo(_toy(doc="another one"))
    assert algo_names()[-1] == "toy_pg"


def test_an_unknown_name_lists_the_choices_and_the_plugin_form():
    with pytest.raises(ValueError) as e:
        get_algo("ppo")
    msg = str(e.value)
    assert msg.startswith("algo.name='ppo' is not one of [")
    assert all(f"'{n}'" in msg for n in ALGOS) and "package.module:Spec or path/to/file.py:Spec" in msg
    with pytest.raises(ValueError, match=r"^algo.name='ppo' is not one of \['gspo', "):
        load_config(None, ["algo.name=ppo"])


def test_spec_defaults_reach_the_config_and_the_loss():
    register_algo(_toy())
    cfg = load_config(None, ["algo.name=toy_pg"]).algo
    assert cfg.spec() is get_algo("toy_pg") and cfg.clip_range() == (0.1, 0.15)
    opts = cfg.loss_options()
    assert (opts["clip_low"], opts["clip_high"], opts["loss_agg_mode"]) == (0.1, 0.15, "token-mean")
    assert opts["options"] == {}
    # a token-level spec takes every mode; an override of its clip is checked by its clip meaning
    assert load_config(None, ["algo.name=toy_pg", "algo.loss_agg_mode=seq-mean-token-mean"]).algo.loss_options()[
        "loss_agg_mode"] == "seq-mean-token-mean"
    with pytest.raises(ValueError, match=r"algo.clip_low=1.5 must be in \(0, 1\)"):
        load_config(None, ["algo.name=toy_pg", "algo.clip_low=1.5"])
    with pytest.raises(ValueError, match=r"algo.options.tau_pos=2 is not an option of algo.name=toy_pg \(its options: "
                                         r"none\); it is an option of algo.name=sapo; drop it"):
        load_config(None, ["algo.name=toy_pg", "algo.options.tau_pos=2"])
    # the loss runs the spec's terms, by name or by the spec itself
    logp = torch.zeros(2, 3, requires_grad=True)
    args = (logp, logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    loss, m = policy_loss("toy_pg", *args, **opts)
    assert float(m["toy/marker"]) == 7.0 and float(loss.detach()) == 0.0
    loss2, _ = policy_loss(get_algo("toy_pg"), *args, **opts)
    assert float(loss2.detach()) == float(loss.detach())


def test_a_sequence_level_spec_refuses_other_modes_at_config_time():
    register_algo(_toy(name="toy_seq", level="sequence", default_agg="seq-mean-token-mean"))
    with pytest.raises(ValueError, match=r"does not apply to toy_seq: a sequence-level method .*token-level method "
                                         r"\(grpo, cispo, sapo\)"):
        load_config(None, ["algo.name=toy_seq", "algo.loss_agg_mode=token-mean"])


@pytest.mark.parametrize("kw, match", [
    (dict(name="9lives"), "name must be letters"),
    (dict(name="a-b"), "name must be letters"),
    (dict(doc=""), "doc must be one non-empty line"),
    (dict(terms=3), "terms must be a function"),
    (dict(level="batch"), "level must be"),
    (dict(clip="soft"), "clip must be one of"),
    (dict(clip="none"), "default_clip must be None exactly when clip='none'"),
    (dict(default_clip=None), "default_clip must be None exactly when clip='none'"),
    (dict(default_clip=(1.5, 0.1)), "is not a valid"),
    (dict(default_agg="mean"), "default_agg must be one of"),
    (dict(level="sequence"), "a sequence-level method aggregates with 'seq-mean-token-mean' only"),
    (dict(options={"temperature": 1.0}), "options must be a tuple of AlgoOption"),
    (dict(options=(AlgoOption(name="t", default=1.0, doc="a"), AlgoOption(name="t", default=2.0, doc="b"))),
     "option names must differ"),
])
def test_a_malformed_spec_is_refused_when_built(kw, match):
    with pytest.raises(ValueError, match=match):
        _toy(**kw)


def test_specs_are_frozen_kw_only_dataclasses():
    spec = get_algo("sapo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.options[0] = None  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.options[0].default = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        AlgoSpec("x", "doc", _pg_terms, "token", "ratio")  # type: ignore[misc]


def test_a_file_plugin_is_loaded_once_and_registered(tmp_path, monkeypatch):
    path = _write(tmp_path)
    cfg = load_config(None, [f"algo.name={path}:SPEC"]).algo
    spec = cfg.spec()
    assert spec.name == "file_pg" and get_algo("file_pg") is spec and "file_pg" in algo_names()
    assert cfg.loss_options()["loss_agg_mode"] == "seq-mean-token-sum" and cfg.clip_range() == (0.05, 0.06)
    # another spelling of the same file: the same module, the same spec (no duplicate)
    monkeypatch.chdir(tmp_path)
    assert get_algo("my_loss.py:SPEC") is spec and get_algo(f"{path}:SPEC") is spec


def test_a_module_plugin(tmp_path, monkeypatch):
    pkg = tmp_path / "toypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _write(pkg, name="module_pg", fname="losses.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_config(None, ["algo.name=toypkg.losses:SPEC"]).algo.spec()
    assert spec.name == "module_pg" and get_algo("module_pg") is spec


def test_bad_plugins_are_one_error_naming_algo_name(tmp_path):
    good = _write(tmp_path)
    clash = _write(tmp_path, name="gspo", fname="clash.py")
    broken = _write(tmp_path, body="x = 1\nraise RuntimeError('boom')\n", fname="broken.py")
    cases = [
        (f"{tmp_path}/nope.py:SPEC", r"file '.*nope.py' does not exist; give a path to a .py file"),
        (f"{good}:MISSING", r"'.*my_loss.py' has no 'MISSING'; its AlgoSpecs: SPEC \(build one: AlgoSpec\(name=\.\.\."),
        (f"{good}:NOT_A_SPEC", r"'.*my_loss.py' has 'NOT_A_SPEC', a int, not an AlgoSpec; its AlgoSpecs: SPEC"),
        ("no_such_pkg_h1.mod:SPEC", r"cannot import 'no_such_pkg_h1.mod': ModuleNotFoundError"),
        (f"{broken}:SPEC", r"cannot import .*RuntimeError: boom \(at .*broken.py:2\)"),
        (f"{clash}:SPEC", r"an algorithm named 'gspo' is registered already"),
    ]
    for ref, match in cases:
        with pytest.raises(ValueError, match=r"^algo.name=" + re.escape(repr(ref)) + ": " + match):
            load_config(None, [f"algo.name={ref}"])
    with pytest.raises(ValueError, match=r"^algo.name='.*my_loss.py:': give package.module:Spec or path/to/file.py:Spec"):
        get_algo(f"{good}:")  # (on the command line YAML would read `x.py:` as a mapping: a type error)
    assert "gspo" in algo_names() and get_algo("gspo").terms.__module__ == "moe_gspo.algos.ppo_clip"


OPTION_FILE = """
import torch
from moe_gspo.algos.loss_common import PolicyTerms, grad_carrier
from moe_gspo.algos.registry import AlgoOption, AlgoSpec

def terms(inp, *, scale, signed, steps, **_):
    value = float(scale) * (1.0 if signed else -1.0) * steps
    objective_BT = torch.where(inp.mask, value * inp.adv_BT * grad_carrier(inp), 0.0)
    return PolicyTerms(objective_BT=objective_BT, metrics={"opt_pg/value": torch.tensor(value, dtype=torch.float64)})

SPEC = AlgoSpec(name="opt_pg", doc="a loss with options of its own", terms=terms, level="token", clip="none",
                default_agg="token-mean",
                options=(AlgoOption(name="scale", default=0.5, gt=0.0, le=2.0, doc="a weight"),
                         AlgoOption(name="signed", type=bool, default=True, doc="keep the sign"),
                         AlgoOption(name="steps", type=int, default=1, ge=1, doc="a count")))
"""


def test_a_plugin_declares_options_that_the_config_checks_and_the_loss_receives(tmp_path):
    path = _write(tmp_path, body=OPTION_FILE, fname="opt_loss.py")
    ref = f"algo.name={path}:SPEC"
    cfg = load_config(None, [ref, "algo.options.scale=2", "algo.options.steps=3"]).algo
    assert cfg.options == {"scale": 2.0, "steps": 3}  # as given, each as its type (YAML's 2 is the float 2.0)
    assert cfg.algo_options() == {"scale": 2.0, "signed": True, "steps": 3}  # the default fills in the rest
    logp = torch.zeros(2, 3, requires_grad=True)
    args = (logp, logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    _, m = policy_loss(cfg.spec(), *args, **cfg.loss_options())
    assert float(m["opt_pg/value"]) == 6.0  # the terms function got every option
    _, m = policy_loss(cfg.spec(), *args, **{**cfg.loss_options(), "options": {"signed": False}})
    assert float(m["opt_pg/value"]) == -0.5
    for override, match in [
        ("algo.options.scale=3", r"algo.options.scale=3.0 must be > 0 and <= 2 \(a weight\)"),
        ("algo.options.scale=0", r"algo.options.scale=0.0 must be > 0 and <= 2"),
        ("algo.options.signed=1", r"algo.options.signed=1 must be true or false \(keep the sign\)"),
        ("algo.options.steps=1.5", r"algo.options.steps=1.5 must be an integer \(a count\)"),
        ("algo.options.steps=0", r"algo.options.steps=0 must be >= 1"),
        ("algo.options.other=1", r"algo.options.other=1 is not an option of algo.name=.*opt_loss.py:SPEC \(its options: "
                                 r"scale, signed, steps\); drop it"),
    ]:
        with pytest.raises(ValueError, match="^" + match):
            load_config(None, [ref, override])


@pytest.mark.parametrize("kw, match", [
    (dict(name="clip_low"), "name must be a Python identifier other than clip_low, clip_high"),
    (dict(name="a b"), "name must be a Python identifier"),
    (dict(name="lambda"), "name must be a Python identifier"),
    (dict(doc="two\nlines"), "doc must be one non-empty line"),
    (dict(type=str, default="x"), "type must be float, int or bool"),
    (dict(default=0.0, gt=0.0), r"the default does not pass its own check: t=0.0 must be > 0"),
    (dict(type=bool, default=True, gt=0.0), "a bool option has no bounds"),
    (dict(lt=float("inf")), "lt must be a finite number"),
])
def test_a_malformed_option_is_refused_when_built(kw, match):
    with pytest.raises(ValueError, match=match):
        AlgoOption(**{**dict(name="t", default=1.0, doc="an option"), **kw})


def test_help_lists_the_options_of_the_chosen_algorithm(capsys):
    from moe_gspo.run.cli import parse_train_args

    with pytest.raises(SystemExit):
        parse_train_args(["--help", "--algo", "sapo", "algo.options.tau_neg=2"])
    out = capsys.readouterr().out
    assert "sapo: a soft sigmoid gate" in out and "options tau_pos 1, tau_neg 1.05]" in out  # the list of algorithms
    assert ("algo.options.tau_pos = 1.0 (sapo's option): gate temperature for tokens with A > 0, the paper's 1.0 "
            "(float, > 0; default 1)") in out
    assert "algo.options.tau_neg = 2.0 (sapo's option)" in out
    with pytest.raises(SystemExit):
        parse_train_args(["--help", "--algo", "grpo"])
    assert "algo.options.tau_pos = " not in capsys.readouterr().out  # another algorithm's options are not listed


def test_the_run_namespaces_a_plugin_may_not_take_cover_every_documented_metric():
    """Issue 59: a plug-in's metrics are logged as `<AlgoSpec.name>/...`; a plug-in named after a namespace of the
    run's own rows (`reward`, `loss`, ...) is refused, so the tuple must hold the first part of every key the table
    of docs/metrics.md, "What a step logs", lists (its first column)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text(encoding="utf-8")
    section = page.split("## What a step logs", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    firsts = {k.split("/")[0] for cell in cells for k in re.findall(r"`([a-z_0-9]+(?:/[a-z_0-9*]+)?)`", cell)}
    assert len(firsts) > 20 and firsts <= set(registry.RUN_NAMESPACES), sorted(firsts - set(registry.RUN_NAMESPACES))

"""Issue 49, defects 6 and 7: a loss that is always NaN stops the run after `train.max_consecutive_skips`
skipped updates with one line naming the loss and what was not finite (it "trained" and exited 0), and a loss
plug-in that raises or returns no objective is one line naming `algo.name` (it was a raw traceback, exit 1), as
a reward plug-in's failures are."""

from __future__ import annotations

import json
import textwrap

import pytest

from faults._tiny import errors, rows, train
from moe_gspo.algos import registry

PLUGIN = """
    import torch

    from moe_gspo.algos.loss_common import PolicyTerms, grad_carrier
    from moe_gspo.algos.registry import AlgoSpec


    def nan_terms(inp, **_):
        return PolicyTerms(objective_BT=inp.lr * float("nan"), metrics={})


    def boom_terms(inp, **_):
        raise RuntimeError("boom")


    def empty_terms(inp, **_):
        return PolicyTerms(metrics={})


    def detached_terms(inp, **_):
        return PolicyTerms(objective_BT=(inp.adv_BT * inp.lr).detach(), metrics={})


    def spec(name, terms):
        return AlgoSpec(name=name, doc="a test's loss", terms=terms, level="token", clip="ratio",
                        default_clip=(0.2, 0.2), default_agg="token-mean")


    NAN = spec("nan_pg", nan_terms)
    BOOM = spec("boom_pg", boom_terms)
    EMPTY = spec("empty_pg", empty_terms)
    DETACHED = spec("detached_pg", detached_terms)
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plug-in file; the registry is restored afterwards (its specs register in this process)."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "_PLUGINS", dict(registry._PLUGINS))
    f = tmp_path / "my_losses.py"
    f.write_text(textwrap.dedent(PLUGIN))
    return f


def test_a_loss_that_is_always_nan_stops_the_run_with_one_line(plugin, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir, f"algo.name={plugin}:NAN", "train.steps=6") == 2
    err = capsys.readouterr().err
    assert errors(err) == [
        f"error: train.max_consecutive_skips=8: the last 8 optimizer steps were all skipped by the NaN/Inf guard, so "
        f"the weights did not change; the loss algo.name={plugin}:NAN was not finite (loss/policy=nan, loss/total=nan, "
        "grad/norm=nan). Fix the loss (or what makes it NaN/Inf: lower train.lr, set train.grad_clip > 0), or raise "
        "train.max_consecutive_skips (0 = never stop)"], err[-3000:]
    # 2 mini-batches a step: the 8th skip is in step 3, which logs no row; nothing claims the run finished
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2] and not (run_dir / "done.json").exists()
    assert [r["train/skipped_steps"] for r in rows(run_dir)] == [2.0, 4.0, 6.0]


def test_zero_never_stops(plugin, tmp_path):
    run_dir = tmp_path / "run"
    assert train(run_dir, f"algo.name={plugin}:NAN", "train.steps=1", "train.max_consecutive_skips=0") == 0
    assert json.loads((run_dir / "done.json").read_text())["step"] == 1


@pytest.mark.parametrize("spec, msg", [
    ("BOOM", "its terms function boom_terms raised RuntimeError: boom (at {file}:{line})"),
    ("EMPTY", "its terms function empty_terms returned no objective (PolicyTerms.objective_B and objective_BT are "
              "both None); give one: per sequence [B] or per token [B, T]"),
    ("DETACHED", "its terms function detached_terms returned an objective without a gradient"),
])
def test_a_failing_loss_plugin_is_one_line_naming_algo_name(plugin, tmp_path, capsys, spec, msg):
    run_dir = tmp_path / "run"
    assert train(run_dir, f"algo.name={plugin}:{spec}", "train.steps=2") == 2
    err = capsys.readouterr().err
    lines = errors(err)
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = plugin.read_text().splitlines().index('    raise RuntimeError("boom")') + 1
    assert lines[0].startswith(f"error: algo.name='{plugin}:{spec}': " + msg.format(file=plugin, line=line)), lines

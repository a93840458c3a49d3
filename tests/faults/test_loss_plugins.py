"""Issue 49, defects 6 and 7: a loss that is always NaN stops the run after `train.max_consecutive_skips`
skipped updates with one line naming the loss and what was not finite (it "trained" and exited 0), and a loss
plug-in that raises or returns no objective is one line naming `algo.name` (it was a raw traceback, exit 1), as
a reward plug-in's failures are.

Issue 59, items 3 and 4: a plug-in's metrics live under its own name (`<AlgoSpec.name>/...`): a metric named
`step` or `reward/mean` wrote `step: 100.0` and a fake reward into every row, and `--resume` then took every row
for damaged and retrained from the initial policy; a string metric was "could not convert string to float". A
run whose every optimizer step was skipped exited 0 when it had fewer than 8 of them; a plug-in's `sys.exit(0)`
exited 0 with no done.json; a plug-in's KeyboardInterrupt read "interrupted by SIGINT"."""

from __future__ import annotations

import textwrap

import pytest
import torch
import yaml

from faults._tiny import errors, rows, train, warnings_of
from moe_gspo.algos import policy_loss, registry

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


    def pg(inp):
        return torch.where(inp.mask, inp.adv_BT * grad_carrier(inp), 0.0)


    def step_terms(inp, **_):  # metrics named like the row's own keys
        return PolicyTerms(objective_BT=pg(inp), metrics={"step": 100, "reward/mean": 0.99, "loss/policy": 5.0,
                                                          "step_pg/own": torch.tensor(2.0)})


    def string_terms(inp, **_):
        return PolicyTerms(objective_BT=pg(inp), metrics={"note": "hello"})


    def exit_terms(inp, **_):
        import sys
        sys.exit(0)


    def interrupt_terms(inp, **_):
        raise KeyboardInterrupt


    NAN = spec("nan_pg", nan_terms)
    STEP = spec("step_pg", step_terms)
    STRING = spec("string_pg", string_terms)
    EXIT = spec("exit_pg", exit_terms)
    INTERRUPT = spec("interrupt_pg", interrupt_terms)
    RESERVED = spec("reward", pg)
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


def _nothing_trained(plugin, skipped: int) -> str:
    return (f"error: nothing was trained: all {skipped} optimizer steps of this run were skipped by the NaN/Inf guard "
            "(train/skipped_steps), so the weights are the initial ones and the run is not marked done (no done.json); "
            f"the loss algo.name={plugin}:NAN was never finite. Fix the loss (or what makes it NaN/Inf: lower "
            "train.lr, set train.grad_clip > 0), then rerun with --overwrite")


def test_a_three_step_nan_run_is_not_success(plugin, tmp_path, capsys):
    """Issue 59: 3 steps x 2 mini-batches = 6 skips, fewer than train.max_consecutive_skips=8: it exited 0."""
    run_dir = tmp_path / "run"
    assert train(run_dir, f"algo.name={plugin}:NAN", "train.steps=3") == 2
    err = capsys.readouterr().err
    assert errors(err) == [_nothing_trained(plugin, 6)] and "Traceback" not in err, err[-3000:]
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2] and not (run_dir / "done.json").exists()


def test_zero_never_stops_the_loop_but_nothing_trained_is_still_an_error(plugin, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir, f"algo.name={plugin}:NAN", "train.steps=1", "train.max_consecutive_skips=0") == 2
    assert errors(capsys.readouterr().err) == [_nothing_trained(plugin, 2)]
    assert [r["step"] for r in rows(run_dir)] == [0] and not (run_dir / "done.json").exists()


def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 3, generator=g, dtype=torch.float64)).requires_grad_()
    return logp, logp.detach() - 0.01, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool)


def test_plugin_metrics_are_namespaced_under_the_spec_name(plugin):
    spec = registry.get_algo(f"{plugin}:STEP")
    _, m = policy_loss(spec, *_loss_inputs(), clip_low=0.2, clip_high=0.2)
    assert {k: float(v) for k, v in m.items() if k.startswith("step_pg/")} == {
        "step_pg/step": 100.0, "step_pg/reward/mean": 0.99, "step_pg/loss/policy": 5.0, "step_pg/own": 2.0}
    assert "step" not in m and "reward/mean" not in m and float(m["loss/policy"]) != 5.0  # its own loss/policy


def test_a_string_plugin_metric_is_one_line_naming_algo_name(plugin):
    spec = registry.get_algo(f"{plugin}:STRING")
    with pytest.raises(ValueError) as e:
        policy_loss(spec, *_loss_inputs(), clip_low=0.2, clip_high=0.2)
    assert str(e.value) == (f"algo.name='{plugin}:STRING': its terms function string_terms returned metric 'note' as "
                            "'hello'; a metric must be one real number (a 0-dim tensor or a Python int / float)")


def test_a_plugin_named_after_a_namespace_of_the_run_is_refused(plugin):
    with pytest.raises(ValueError) as e:
        registry.get_algo(f"{plugin}:RESERVED")
    assert str(e.value).startswith(f"algo.name='{plugin}:RESERVED': its AlgoSpec.name 'reward' is a namespace of the "
                                   "run's own metrics"), str(e.value)


def test_plugin_metrics_named_step_and_reward_keep_the_rows_and_resume_uses_the_checkpoint(plugin, tmp_path, capsys):
    """The issue's trial: metrics {"step": 100, "reward/mean": 0.99}. The rows keep their own `step` and
    `reward/mean`, so `--resume` (here with a changed dial, allowed by --allow-config-change) continues from
    the newest checkpoint instead of taking every row for damaged; the run keeps both configs."""
    run_dir = tmp_path / "run"
    assert train(run_dir, f"algo.name={plugin}:STEP", "train.steps=2") == 0
    first = rows(run_dir)
    assert [r["step"] for r in first] == [0, 1]
    assert all(r["reward/mean"] != 0.99 and r["step_pg/step"] == 100 and r["step_pg/reward/mean"] == 0.99
               and r["loss/policy"] != 5.0 for r in first), first
    capsys.readouterr()
    assert train(run_dir, f"algo.name={plugin}:STEP", "train.steps=3", "rollout.router_flip_prob=0.1", "--resume",
                 "--allow-config-change") == 0
    out, err = capsys.readouterr()
    assert "resuming at step 2 from" in out and not warnings_of(err), (out + err)[-3000:]  # no damaged row
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2] and rows(run_dir)[:2] == first
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["router_flip_prob"] == 0.0  # the first
    resumed = (run_dir / "config.resume-1.yaml").read_text()
    assert resumed.startswith("# segment 2, resumed at step 2 under this config; it differs from config.yaml in: ")
    assert "rollout.router_flip_prob" in resumed.splitlines()[0] and "train.steps" in resumed.splitlines()[0]
    assert yaml.safe_load(resumed)["rollout"]["router_flip_prob"] == 0.1
    assert sorted(p.name for p in run_dir.glob("config*")) == ["config.resume-1.yaml", "config.yaml"]


@pytest.mark.parametrize("spec, start", [
    ("EXIT", "error: the run stopped before it finished: code inside it raised SystemExit(0) (sys.exit() or exit() "
             "(at {file}:{line}); a plug-in's, algo.name or task.reward?), so no done.json was written; remove that "
             "call (raise an exception to stop with an error), then "),
    ("INTERRUPT", "error: KeyboardInterrupt raised at {file}:{line} without a signal (no SIGINT or SIGTERM reached "
                  "this process): code of the run raised it (a plug-in's, algo.name or task.reward?), so the run "
                  "stopped; "),
])
def test_a_plugin_that_exits_or_raises_keyboard_interrupt_is_not_success_nor_a_signal(plugin, tmp_path, capsys,
                                                                                      spec, start):
    run_dir = tmp_path / "run"
    assert train(run_dir, f"algo.name={plugin}:{spec}", "train.steps=1") == 2
    err = capsys.readouterr().err
    source = plugin.read_text().splitlines()
    line = source.index("    sys.exit(0)" if spec == "EXIT" else "    raise KeyboardInterrupt") + 1
    lines = errors(err)
    assert len(lines) == 1 and lines[0].startswith(start.format(file=plugin, line=line)), err[-3000:]
    assert "interrupted by" not in err and "Traceback" not in err and not (run_dir / "done.json").exists()


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

"""The before/after race (`trl_peer_bench --ours-rev REV`): the statistics of three sides (`race_stats`), the
checkout of another commit the main job runs from (`race_common.rev_checkout`), and the CLI's refusals."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

from benchmarks import trl_peer_bench as bench
from benchmarks.race_common import resolve_rev, rev_checkout, subprocess_env
from benchmarks.race_stats import bootstrap_median_ci, compare_seeds, seed_ratios, seed_table


def _side(t, *, reached=True, steps=100):
    return {"reached": reached, "time_s": t if reached else None, "step": steps - 1 if reached else None,
            "time_run_s": t, "steps_run": steps, "s_per_step": t / steps}


def test_three_sides_give_each_ratio_of_medians_with_a_ci_paired_by_seed():
    """Two seeds. TRL 2 s both, before (ours_rev) 4 s and 2 s, after (ours) 1 s and 3 s. A paired resample is
    seeds {0,0} (p 1/4), {1,1} (p 1/4) or one of each (p 1/2, each median the mean of the two):
    ours/trl 0.5 | 1.5 | 1.0; ours_rev/trl 2.0 | 1.0 | 1.5; ours/ours_rev 0.25 | 1.5 | 2/3,
    so the 95% percentile CIs are the extremes of each."""
    per_seed = [{"seed": 0, "trl": _side(2.0), "ours_rev": _side(4.0), "ours": _side(1.0)},
                {"seed": 1, "trl": _side(2.0), "ours_rev": _side(2.0), "ours": _side(3.0, reached=False)}]
    out = compare_seeds(per_seed)
    r = out["ratios"]
    assert list(r) == ["ours/trl", "ours_rev/trl", "ours/ours_rev"]
    assert r["ours/trl"]["median_ratio"] == pytest.approx(1.0) and r["ours/trl"]["ci"] == pytest.approx([0.5, 1.5])
    assert r["ours_rev/trl"]["median_ratio"] == pytest.approx(1.5) and r["ours_rev/trl"]["ci"] == pytest.approx([1.0, 2.0])
    assert r["ours/ours_rev"]["median_ratio"] == pytest.approx(2.0 / 3.0)
    assert r["ours/ours_rev"]["ci"] == pytest.approx([0.25, 1.5])
    assert all(x["num_seeds"] == 2 for x in r.values())
    # ours missed at seed 1 (3 s is a lower bound) and that bounds its median of two: inexact, the others exact
    assert not r["ours/trl"]["exact"] and r["ours_rev/trl"]["exact"] and not r["ours/ours_rev"]["exact"]
    assert out["ours_rev"]["median_time_ci_s"] == [2.0, 4.0] and out["ours_rev"]["median_steps"] == 100
    # the two-sided race's keys still carry ours / TRL
    assert out["ratio_median_time"] == pytest.approx(1.0) and out["ratio_median_time_ci"] == pytest.approx([0.5, 1.5])
    assert seed_ratios(per_seed[0]) == pytest.approx({"ours/trl": 0.5, "ours_rev/trl": 2.0, "ours/ours_rev": 0.25})


def test_the_two_sided_race_draws_the_same_bootstrap_as_before():
    """Without a third side the resamples (and so the CIs) are those the two-sided bench always drew: the
    sides' medians, then the ratio, from one generator, in that order."""
    import numpy as np

    per_seed = [{"trl": _side(t), "ours": _side(o)} for t, o in [(50, 30), (70, 41), (40, 35), (90, 52), (60, 33)]]
    got = bootstrap_median_ci(per_seed, reps=500)
    rng = np.random.default_rng(0)
    trl, ours = np.array([50, 70, 40, 90, 60.0]), np.array([30, 41, 35, 52, 33.0])
    want_trl = np.percentile(np.median(trl[rng.integers(0, 5, (500, 5))], axis=1), [2.5, 97.5])
    want_ours = np.percentile(np.median(ours[rng.integers(0, 5, (500, 5))], axis=1), [2.5, 97.5])
    idx = rng.integers(0, 5, (500, 5))
    want_ratio = np.percentile(np.median(ours[idx], axis=1) / np.median(trl[idx], axis=1), [2.5, 97.5])
    assert got["trl"] == pytest.approx(list(want_trl)) and got["ours"] == pytest.approx(list(want_ours))
    assert got["ratio"] == pytest.approx(list(want_ratio)) and got["num_seeds"] == 5
    assert list(got["pairs"]) == ["ours/trl", "ours_rev/trl", "ours/ours_rev"]
    assert got["pairs"]["ours/ours_rev"]["num_seeds"] == 0 and "ours_rev" not in got


def test_seed_table_marks_a_miss_and_ends_with_the_medians():
    per_seed = [{"seed": 3, "trl": _side(60.0), "ours": _side(30.0, reached=False, steps=250)},
                {"seed": 4, "trl": _side(40.0), "ours": _side(30.0)}]
    summary = compare_seeds(per_seed)
    lines = seed_table(per_seed, summary, {"trl": "TRL", "ours": "ours"})
    assert lines[0].split() == ["seed", "TRL", "ours", "ours/trl"]
    assert lines[1].split() == ["3", "60.0", "(100)", "30.0*", "(250)", "0.50"]
    assert lines[2].split() == ["4", "40.0", "(100)", "30.0", "(100)", "0.75"]
    assert lines[3].startswith("median") and "50.0 [40.0, 60.0]" in lines[3] and "0.60 [" in lines[3]
    assert len({len(line) for line in lines}) == 1  # aligned columns


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_rev_checkout_runs_that_commits_package_and_is_removed_after(tmp_path):
    repo = tmp_path / "repo"
    (repo / "moe_gspo").mkdir(parents=True)
    _git(repo, "init", "-q")
    for version in ("before", "after"):
        (repo / "moe_gspo" / "__init__.py").write_text(f"WHICH = {version!r}\n")
        _git(repo, "add", "-A")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", version)
    first = _git(repo, "rev-parse", "HEAD~1")
    assert resolve_rev("HEAD~1", repo) == first and resolve_rev("no-such-rev", repo) is None
    parent = tmp_path / "trees"
    parent.mkdir()
    with rev_checkout("HEAD~1", parent, repo) as tree:
        assert tree.parent == parent and (tree / "moe_gspo" / "__init__.py").read_text() == "WHICH = 'before'\n"
        # the main job's subprocess (cwd the checkout, its env) imports that commit's package, not this
        # checkout's moe_gspo (also on PYTHONPATH when the tests run)
        got = subprocess.run([sys.executable, "-c", "import moe_gspo; print(moe_gspo.WHICH, moe_gspo.__file__)"],
                             cwd=tree, env=subprocess_env(tree), capture_output=True, text=True, check=True).stdout
        which, path = got.split()
        assert which == "before" and os.path.realpath(path).startswith(os.path.realpath(tree))
        assert len(_git(repo, "worktree", "list").splitlines()) == 2
    assert not tree.exists() and len(_git(repo, "worktree", "list").splitlines()) == 1
    with pytest.raises(RuntimeError, match="boom"):  # removed however the block ends
        with rev_checkout(first, parent, repo) as tree:
            raise RuntimeError("boom")
    assert not tree.exists() and len(_git(repo, "worktree", "list").splitlines()) == 1
    with pytest.raises(ValueError, match="'nope' is not a commit"):
        with rev_checkout("nope", parent, repo):
            pass


@pytest.mark.parametrize("argv, msg", [
    (["--ours-rev", "no-such-rev-xyz"], "--ours-rev no-such-rev-xyz: not a commit of"),
    (["--only", "ours_rev"], "--only ours_rev: give the commit with --ours-rev REV"),
    (["--ours-rev", "HEAD", "--config", "configs/no_such_config.yaml"], "not in commit HEAD"),
    (["--only", "nobody"], "invalid choice: 'nobody'"),
])
def test_the_before_after_options_refuse_bad_input_with_exit_2(monkeypatch, capsys, tmp_path, argv, msg):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if TRL were installed
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "x")
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_side_that_cannot_start_ends_the_sides_already_launched(tmp_path):
    """Three sides launch before the turns begin; when a later one fails to start (its log directory missing,
    a bad command), those already running are ended, not left behind."""
    from benchmarks import interleave

    if not interleave.supported():
        pytest.skip("needs Linux /proc process trees")
    started = []

    def sleeper():
        side = bench._side("sleeper", "sleep", [sys.executable, "-c", "import time; time.sleep(60)"],
                           tmp_path / "sleep.log", tmp_path / "records.jsonl", max_steps=1, target=1.0, window=1,
                           stop_at_target=True, first_step_s=lambda r: 0.0, record_to_point=lambda r: (0, 0, 0),
                           record_to_phases=lambda r: {})
        started.append(side.job.proc)
        return side

    def broken():
        raise FileNotFoundError("no such directory")

    with pytest.raises(FileNotFoundError):
        bench.race([sleeper, broken], interleave=True)
    assert len(started) == 1 and started[0].poll() is not None  # ended, not sleeping on

"""moe_gspo.run.arm_runner: arms several at a time (order of results, real overlap, the bound), and
stopping every running subprocess when the matrix is interrupted."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from moe_gspo.ablate import Arm, load_spec, parse_spec, run_ablation
from moe_gspo.run.arm_runner import SubprocessArmRunner, run_concurrently
from tests.test_ablate import FakeRunner, _spec_dict, _write_spec


def test_run_concurrently_keeps_order_and_bound():
    running, peak, lock = [0], [0], threading.Lock()

    def fn(x):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05 * (5 - x))  # later items finish first
        with lock:
            running[0] -= 1
        return x * 10

    assert run_concurrently(fn, range(5), parallel=2) == [0, 10, 20, 30, 40]
    assert peak[0] == 2
    peak[0] = 0
    assert run_concurrently(fn, range(3), parallel=1) == [0, 10, 20] and peak[0] == 1


def test_parallel_arms_overlap_and_keep_the_arm_order(tmp_path):
    spec = load_spec(_write_spec(tmp_path, parallel_arms=2, nproc=1))
    assert spec.parallel_arms == 2
    barrier = threading.Barrier(2, timeout=10)  # two arms must be inside the runner at the same time
    fake = FakeRunner()

    def runner(arm, cmd, log):
        if arm.name in ("gspo-none-s0", "gspo-none-s1"):
            barrier.wait()
        return fake(arm, cmd, log)

    results = run_ablation(spec, runner, progress=False, compare=False)
    assert [r.arm.name for r in results] == ["gspo-none-s0", "gspo-none-s1", "grpo-none-s0", "grpo-none-s1",
                                            "grpo-r2-s0", "grpo-r2-s1"]
    assert all(r.status == "finished" for r in results)


@pytest.mark.parametrize("bad", [0, -1, True, "2"])
def test_parallel_arms_must_be_a_positive_int(tmp_path, bad):
    with pytest.raises(ValueError, match="'parallel_arms' must be a positive int"):
        parse_spec(_spec_dict(tmp_path, parallel_arms=bad))


def test_stop_all_ends_every_running_command(tmp_path):
    runner = SubprocessArmRunner(env={"MOE_GSPO_TEST_MARK": "x"})
    codes = {}

    def run(i):
        arm = Arm("grpo", "none", i, tmp_path)
        codes[i] = runner(arm, [sys.executable, "-c", "import os, time; print(os.environ['MOE_GSPO_TEST_MARK'], "
                                "flush=True); time.sleep(60)"], tmp_path / f"log{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.time() + 20
    while time.time() < deadline and not all((tmp_path / f"log{i}").exists() and "x\n" in
                                             (tmp_path / f"log{i}").read_text() for i in range(2)):
        time.sleep(0.05)
    start = time.time()
    runner.stop_all()
    for t in threads:
        t.join(timeout=20)
    assert time.time() - start < 15 and codes == {0: -15, 1: -15}  # SIGTERM, long before the sleep ends
    with pytest.raises(KeyboardInterrupt):  # no new command after stop_all
        runner(Arm("grpo", "none", 3, tmp_path), [sys.executable, "-c", "pass"], tmp_path / "log3")


def test_arms_run_seed_by_seed(tmp_path):
    spec = load_spec(_write_spec(tmp_path))
    fake = FakeRunner()
    results = run_ablation(spec, fake, progress=False, compare=False)
    assert [name for name, _ in fake.calls] == ["gspo-none-s0", "grpo-none-s0", "grpo-r2-s0",
                                                "gspo-none-s1", "grpo-none-s1", "grpo-r2-s1"]
    assert [r.arm.name for r in results] == ["gspo-none-s0", "gspo-none-s1", "grpo-none-s0", "grpo-none-s1",
                                            "grpo-r2-s0", "grpo-r2-s1"]


def test_arms_ended_by_an_interrupt_are_not_reported_as_failures(tmp_path, capsys):
    spec = load_spec(_write_spec(tmp_path, parallel_arms=2, nproc=1))

    class Stopping:
        stopping = True

        def __call__(self, arm, cmd, log):
            return -15

    run_ablation(spec, Stopping(), progress=False, compare=False)
    assert "FAILED" not in capsys.readouterr().err
    run_ablation(spec, lambda arm, cmd, log: 3, progress=False, compare=False)
    assert capsys.readouterr().err.count("FAILED") == 6


def test_reward_threshold_reaches_the_comparison(tmp_path, monkeypatch):
    import analysis.compare

    seen = {}
    monkeypatch.setattr(analysis.compare, "build_comparison",
                        lambda runs, out, **kw: seen.update(kw) or (_ for _ in ()).throw(
                            analysis.compare.ReportInputError("stop here")))
    spec = load_spec(_write_spec(tmp_path, reward_threshold=0.5))
    run_ablation(spec, FakeRunner(), progress=False, compare=True)
    assert seen == {"reward_threshold": 0.5}
    with pytest.raises(ValueError, match="'reward_threshold' must be a number"):
        parse_spec(_spec_dict(tmp_path, reward_threshold="high"))

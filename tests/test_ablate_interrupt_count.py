"""Issue 43.13: an interrupted ablation says how many runs really finished (this run and before it)
and which were cut short. Issue 49.13: a run that finished at the moment of the interrupt (its done.json
written, its runner not yet returned) is one of this invocation's, not "before it"."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from moe_gspo import ablate

ROOT = Path(__file__).resolve().parents[1]


def _spec(tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "abl"
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"base_config": str(ROOT / "configs/tiny_cpu.yaml"), "algos": ["gspo", "grpo"],
                                "routing_replay": ["none"], "seeds": [0, 1], "parallel_arms": 1,
                                "out_dir": str(out)}))  # one run at a time: the counts below assume it
    (out / "grpo-none-s1").mkdir(parents=True)
    (out / "grpo-none-s1" / "done.json").write_text("{}")  # finished by an earlier invocation
    return spec, out


def _ctrl_c() -> None:
    """A real SIGINT to this process (a KeyboardInterrupt raised by code is not an interruption:
    `moe_gspo.run.errors.raised_without_signal`); the handler raises during the sleep."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    raise AssertionError("SIGINT did not interrupt")


def _interrupted_line(capsys) -> str:
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("interrupted")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_interruption_line_counts_finished_runs_and_names_the_cut_one(tmp_path, capsys):
    spec, _ = _spec(tmp_path)

    def runner(arm, command, log_path):
        if arm.name == "grpo-none-s0":
            _ctrl_c()  # Ctrl-C while this arm runs
        (arm.run_dir / "done.json").write_text("{}")
        return 0

    assert ablate.main(["--config", str(spec)], arm_runner=runner) == 130
    assert _interrupted_line(capsys).startswith(
        "interrupted by SIGINT; 2 of 4 runs finished (1 in this run, 1 before it); interrupted: grpo-none-s0. Rerun")


def test_a_run_finished_as_the_interrupt_came_counts_as_this_invocations(tmp_path, capsys):
    """Was: "3 of 4 arms finished (1 in this run, 2 before it)": grpo-none-s0 had written done.json when
    Ctrl-C came, so the run directories counted it, but its runner never returned to log it as this run's."""
    spec, _ = _spec(tmp_path)

    def runner(arm, command, log_path):
        (arm.run_dir / "done.json").write_text("{}")
        if arm.name == "grpo-none-s0":
            _ctrl_c()  # the run wrote done.json; Ctrl-C before its runner returned
        return 0

    assert ablate.main(["--config", str(spec)], arm_runner=runner) == 130
    line = _interrupted_line(capsys)
    assert line.startswith("interrupted by SIGINT; 3 of 4 runs finished (2 in this run, 1 before it). Rerun"), line

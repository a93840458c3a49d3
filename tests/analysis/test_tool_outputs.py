"""Issue 59 item 7: `analysis.report`, `compare`, `phase`, `staleness` (and `claims`, checked before any compute) on
an output path that cannot be written (an existing regular file where a directory is expected or a path under one, a
read-only directory, a read-only or full filesystem during the write) print one `error:` line naming the flag and
exit 2, with nothing half-written left (`analysis.outputs`). Root ignores permission bits, so a read-only filesystem
is simulated: `os.access` refusing writes (the check before any compute) or `os.replace` raising EROFS / ENOSPC (the
write itself)."""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import pytest

from analysis.claims import main as claims_main
from analysis.compare import main as compare_main
from analysis.phase import main as phase_main
from analysis.report import main as report_main
from analysis.staleness import main as staleness_main


def _run_dir(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": 0.1 * i}) + "\n" for i in range(6)))
    (d / "config.yaml").write_text("algo:\n  name: grpo\n")
    return d


def _saved(path: Path, doses: list[str]) -> Path:
    lines = []
    for dose in doses:
        x = 0.2 if dose == "p20" else 0.0
        for seed in range(3):
            rows = [{"step": t, "reward/mean": 0.5 + 0.01 * t + 0.001 * seed - x, "reward/frac_zero_std": 0.2,
                     "actor/entropy": 1.0, "routing/layer_disagree": [x, x], "mismatch/k3_kl": 1e-4,
                     "update/expert_change_frac": 0.1} for t in range(20)]
            lines.append(json.dumps({"run": f"grpo-none-{dose}-s{seed}", "records": rows}) + "\n")
    path.write_bytes(gzip.compress("".join(lines).encode()))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    return {"run": _run_dir(d / "grpo-none-s0"), "phase": _saved(d / "phase.jsonl.gz", ["p0", "p20"]),
            "staleness": _saved(d / "staleness.jsonl.gz", ["mb1", "mb4"])}


def _call(tool: str, inputs, out: Path) -> int:
    """Run `tool` writing to `out` (a directory for report / compare, the page file for phase / staleness)."""
    if tool == "report":
        return report_main([str(inputs["run"]), "--out", str(out)])
    if tool == "compare":
        return compare_main([str(out), str(inputs["run"]), "--bootstrap-reps", "50"])
    if tool == "claims":  # (checked before its input is read)
        return claims_main([str(inputs["phase"]), "--out", str(out), "--bootstrap-reps", "100"])
    main = phase_main if tool == "phase" else staleness_main
    return main([str(inputs[tool]), "--out", str(out), "--bootstrap-reps", "100"])


TOOLS = ["report", "compare", "phase", "staleness"]
FLAG = {"report": "--out", "compare": "OUT_DIR", "phase": "--out", "staleness": "--out", "claims": "--out"}


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.mark.parametrize("tool", TOOLS + ["claims"])
def test_an_existing_file_as_out_is_one_line(tool, inputs, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    out = blocker if tool in ("report", "compare") else blocker / "page.md"  # a directory expected / a path under one
    assert _call(tool, inputs, out) == 2
    line = _one_error_line(capsys)
    assert f"{FLAG[tool]}=" in line and str(blocker) in line and "is a file, not a directory" in line, line
    assert blocker.read_text() == "not a directory\n" and _files(tmp_path) == ["taken"]


@pytest.mark.parametrize("tool", ["phase", "staleness"])
def test_a_directory_as_the_page_file_is_one_line(tool, inputs, tmp_path, capsys):
    assert _call(tool, inputs, tmp_path) == 2
    line = _one_error_line(capsys)
    assert f"--out={str(tmp_path)!r} is a directory; give a file path such as {str(tmp_path / 'page.md')!r}" in line


@pytest.mark.parametrize("tool", TOOLS + ["claims"])
def test_a_read_only_out_is_refused_before_any_compute(tool, inputs, tmp_path, capsys, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if mode & os.W_OK else real(p, mode, **k))
    out = tmp_path / "out" / ("" if tool in ("report", "compare") else "page.md")
    assert _call(tool, inputs, out) == 2
    line = _one_error_line(capsys)
    assert f"{FLAG[tool]}=" in line and "not writable" in line, line
    assert _files(tmp_path) == []


@pytest.mark.parametrize("errno_, says", [(errno.EROFS, "Read-only file system"),
                                          (errno.ENOSPC, "disk full while writing")], ids=["erofs", "enospc"])
@pytest.mark.parametrize("tool", TOOLS)
def test_a_write_that_fails_is_one_line_and_leaves_nothing(tool, errno_, says, inputs, tmp_path, capsys,
                                                           monkeypatch):
    def refuse(src, dst, **k):
        raise OSError(errno_, os.strerror(errno_), str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    out = tmp_path / "out"
    assert _call(tool, inputs, out if tool in ("report", "compare") else out / "page.md") == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {FLAG[tool]}") and says in line and str(out) in line, line
    assert [p for p in _files(tmp_path) if not Path(tmp_path / p).is_dir()] == []  # no temp file, nothing half-written


@pytest.mark.parametrize("tool", ["phase", "staleness"])
def test_save_metrics_and_figures_are_checked_too(tool, inputs, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("x")
    main = phase_main if tool == "phase" else staleness_main
    assert main([str(inputs[tool]), "--figures", str(blocker), "--bootstrap-reps", "100"]) == 2
    assert "--figures=" in _one_error_line(capsys)
    assert main([str(inputs[tool]), "--save-metrics", str(blocker / "m.jsonl.gz"), "--bootstrap-reps", "100"]) == 2
    assert "--save-metrics=" in _one_error_line(capsys)
    assert _files(tmp_path) == ["taken"]


@pytest.mark.parametrize("tool", TOOLS)
def test_the_inputs_make_a_page(tool, inputs, tmp_path, capsys):
    """The inputs above are good: the failures are the output's."""
    out = tmp_path / "out"
    assert _call(tool, inputs, out if tool in ("report", "compare") else out / "page.md") == 0
    assert (out / ("report.md" if tool in ("report", "compare") else "page.md")).is_file()

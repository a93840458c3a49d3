"""Issue 43: one meaning per metric name. The probe's JSON names the learner/rollout ratio statistics
`mismatch_ratio/*`, as metrics.jsonl does (`ratio/*` there is the new/old policy ratio inside the update); probe
files written before that called them `ratio/*`, and the report still reads them."""

from __future__ import annotations

import json

from analysis.load import PROBE_LABELS, probe_headline, probe_value
from analysis.probe_figures import fig_probe_variance
from analysis.report import build_report
from synth_run import synthetic_probe


def _old_names(probe: dict) -> dict:
    return {k.replace("mismatch_ratio/", "ratio/"): v for k, v in probe.items()}


def test_probe_labels_use_the_metrics_names():
    assert not any(k.startswith("ratio/") for k in PROBE_LABELS)
    assert "mismatch_ratio/token_var_share_flipped" in PROBE_LABELS


def test_an_older_probe_file_reads_the_same(tmp_path):
    new = synthetic_probe()
    old = _old_names(new)
    assert "ratio/token_var" in old and "mismatch_ratio/token_var" not in old
    assert probe_value(old, "mismatch_ratio/token_var") == probe_value(new, "mismatch_ratio/token_var") == 2e-3
    assert probe_value(old, "ratio/token_var") == 2e-3  # the old name itself is read as written
    assert probe_headline(old) == probe_headline(new)
    heights = lambda p: sorted(b.get_height() for b in fig_probe_variance(p).axes[0].patches)  # noqa: E731
    assert heights(old) == heights(new)
    mds = []
    for name, probe in (("old", old), ("new", new)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(probe))
        md = build_report(path, tmp_path / name).markdown.read_text()
        mds.append(md.split("## Probe: headline numbers", 1)[1].split("\n## ", 1)[0])
    assert mds[0] == mds[1]

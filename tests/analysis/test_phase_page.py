"""Experiment 3's, 3S's, 3F's, 4's, 6's and 6R's results on docs/paper_claims.md are what `python -m analysis.phase` and `python -m
analysis.staleness` make of the committed metrics, exactly (issue 47's done-when: the page's figures and tables
regenerate from committed metrics with one command).

The page quotes tables of reports/phase/phase.md between `<!-- analysis.phase:begin -->` and
`<!-- analysis.phase:end -->` (of reports/phase_staleness/staleness.md between `analysis.staleness` markers, of
reports/phase_fine/phase.md between `<!-- analysis.phase:begin fine -->` and the end marker); all must come, byte
for byte, from the saved metrics:

    python -m analysis.phase reports/phase/metrics.jsonl.gz --out reports/phase/phase.md --figures reports/phase
    python -m analysis.staleness reports/phase_staleness/metrics.jsonl.gz --out reports/phase_staleness/staleness.md \
        --figures reports/phase_staleness
    python -m analysis.phase reports/phase_fine/metrics.jsonl.gz --tests 1,7 --out reports/phase_fine/phase.md \
        --figures reports/phase_fine
    python -m analysis.phase reports/phase_middle/metrics.jsonl.gz --tests 8,11,12 --out reports/phase_middle/phase.md \
        --figures reports/phase_middle    (experiment 4, between `<!-- analysis.phase:begin middle -->` and the end)
    python -m analysis.staleness reports/training_exp6/metrics.jsonl.gz --controls --exploratory \
        --out reports/training_exp6/staleness.md --figures reports/training_exp6
        (experiment 6, between `<!-- analysis.staleness:begin exp6 -->` and the end)
    python -m analysis.staleness_confirm reports/training_exp6r/metrics.jsonl.gz --out reports/training_exp6r/confirm.md \
        --figures reports/training_exp6r    (experiment 6R, between `<!-- analysis.staleness_confirm:begin exp6r -->`
        and the end; its verdict line is on the page too)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis import phase, staleness, staleness_confirm
from test_claims_page import _quoted_tables

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "paper_claims.md"
# (the page's marker tool and marker name, its module's main, the report folder, the tables' file, the tables the
# page must quote, the command's own flags)
PAGES = [("phase", "", phase.main, ROOT / "reports" / "phase", "phase.md", 3, []),
         ("staleness", "", staleness.main, ROOT / "reports" / "phase_staleness", "staleness.md", 2, []),
         ("phase", "fine", phase.main, ROOT / "reports" / "phase_fine", "phase.md", 2, ["--tests", "1,7"]),
         ("phase", "middle", phase.main, ROOT / "reports" / "phase_middle", "phase.md", 2, ["--tests", "8,11,12"]),
         ("staleness", "exp6", staleness.main, ROOT / "reports" / "training_exp6", "staleness.md", 4,
          ["--controls", "--exploratory"]),
         ("staleness_confirm", "exp6r", staleness_confirm.main, ROOT / "reports" / "training_exp6r", "confirm.md", 3,
          [])]
BY_TOOL = pytest.mark.parametrize("tool, name, main, folder, tables, num_quoted, flags", PAGES,
                                  ids=[p[3].name for p in PAGES])


@BY_TOOL
def test_the_page_quotes_the_committed_tables(tool, name, main, folder, tables, num_quoted, flags):
    generated = (folder / tables).read_text()  # regenerated from the saved metrics by the test below
    quoted = _quoted_tables(PAGE.read_text(), name=name, tool=tool)
    assert len(quoted) >= num_quoted, f"the page quotes {num_quoted} or more tables of analysis.{tool}"
    for block in quoted:
        assert block in generated, f"a table on the page is not what analysis.{tool} makes:\n{block[:300]}"


@BY_TOOL
def test_the_tables_and_the_figures_regenerate_from_the_saved_metrics(tmp_path, tool, name, main, folder, tables,
                                                                      num_quoted, flags):
    """The committed tables, made again byte for byte; the committed diagram, drawn again with the same command: the same image up to font rendering (a
    different matplotlib/FreeType may move a glyph's anti-aliasing; compared pixel by pixel, not byte by byte)."""
    import matplotlib.image as mpimg
    import numpy as np

    assert main([str(folder / "metrics.jsonl.gz"), *flags, "--out", str(tmp_path / tables),
                 "--figures", str(tmp_path)]) == 0
    assert (tmp_path / tables).read_text() == (folder / tables).read_text()
    committed = sorted(p.name for p in folder.glob("*.png"))
    assert committed and sorted(p.name for p in tmp_path.glob("*.png")) == committed
    for name in committed:
        a, b = mpimg.imread(folder / name), mpimg.imread(tmp_path / name)
        assert a.shape == b.shape
        differs = np.abs(a - b).max(axis=-1) > 0.1
        assert differs.mean() < 0.01, f"{name}: {differs.mean():.1%} of the pixels differ"


def test_the_page_states_experiment_6rs_verdict_as_its_analysis_prints_it():
    """The pre-registered rules' verdict line (analysis.staleness_confirm's page, under "### Verdict") is quoted on
    the claims page word for word: the page cannot claim more (or less) than the rules gave."""
    lines = (ROOT / "reports" / "training_exp6r" / "confirm.md").read_text().splitlines()
    verdict = lines[lines.index("### Verdict (the pre-registered rules)") + 2]
    assert verdict.startswith("**") and verdict in PAGE.read_text()

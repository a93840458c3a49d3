"""Experiment 3's results on docs/paper_claims.md are what `python -m analysis.phase` makes of the committed
metrics, exactly (issue 47's done-when: the page's figures and tables regenerate from committed metrics with one
command).

The page quotes tables of reports/phase/phase.md between `<!-- analysis.phase:begin -->` and
`<!-- analysis.phase:end -->`; both must come, byte for byte, from reports/phase/metrics.jsonl.gz:

    python -m analysis.phase reports/phase/metrics.jsonl.gz --out reports/phase/phase.md --figures reports/phase
"""

from __future__ import annotations

from pathlib import Path

from analysis.phase import main
from test_claims_page import _quoted_tables

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "reports" / "phase" / "metrics.jsonl.gz"
PAGE = ROOT / "docs" / "paper_claims.md"
TABLES = ROOT / "reports" / "phase" / "phase.md"


def test_the_page_quotes_the_committed_tables():
    generated = TABLES.read_text()  # regenerated from the saved metrics by the test below
    quoted = _quoted_tables(PAGE.read_text(), tool="phase")
    assert len(quoted) >= 3, "the page quotes the arms, critical-mismatch and test tables"
    for block in quoted:
        assert block in generated, f"a table on the page is not what analysis.phase makes:\n{block[:300]}"


def test_the_tables_and_the_diagram_regenerate_from_the_saved_metrics(tmp_path):
    """The committed tables, made again byte for byte; the committed diagram, drawn again with the same command: the same image up to font rendering (a
    different matplotlib/FreeType may move a glyph's anti-aliasing; compared pixel by pixel, not byte by byte)."""
    import matplotlib.image as mpimg
    import numpy as np

    assert main([str(SAVED), "--out", str(tmp_path / "phase.md"), "--figures", str(tmp_path)]) == 0
    assert (tmp_path / "phase.md").read_text() == TABLES.read_text()
    committed = sorted(p.name for p in (ROOT / "reports" / "phase").glob("*.png"))
    assert committed and sorted(p.name for p in tmp_path.glob("*.png")) == committed
    for name in committed:
        a, b = mpimg.imread(ROOT / "reports" / "phase" / name), mpimg.imread(tmp_path / name)
        assert a.shape == b.shape
        differs = np.abs(a - b).max(axis=-1) > 0.1
        assert differs.mean() < 0.01, f"{name}: {differs.mean():.1%} of the pixels differ"

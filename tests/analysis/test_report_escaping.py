"""Issue 43.9: run names and free text are escaped in report.md (a run directory named
`<img src=x onerror=alert(7)>` appeared raw) and report.html."""

from __future__ import annotations

from analysis.report import Page, Table, render_html, render_markdown
from analysis.figure_kit import SkippedFigure

EVIL = "<img src=x onerror=alert(7)>"


def _page() -> Page:
    return Page(title=f"Expert-drift report: {EVIL}", intro=[f"Run directory: /runs/{EVIL}", "a*b* _c_ [l](u) `x`"],
                tables=[Table(EVIL, ["arm", "value"], [[EVIL + "|x", "1"]])],
                figures=[SkippedFigure("f", EVIL, f"no data in {EVIL}")], notes=[f"{EVIL}: line 3 skipped"],
                details=[(EVIL, "run_name: ```\n")])


def test_markdown_has_no_raw_html_or_markup_from_names():
    md = render_markdown(_page())
    assert "<img" not in md and "&lt;img src=x onerror=alert(7)>" in md
    assert "# Expert-drift report: &lt;img" in md
    assert r"a\*b\* \_c\_ [l\](u) \`x\`" in md  # Markdown punctuation shown as text
    assert r"&lt;img src=x onerror=alert(7)>\|x" in md  # a cell's pipe does not split the table
    fence_lines = [l for l in md.splitlines() if set(l) == {"`"}]
    assert fence_lines and all(len(l) >= 4 for l in fence_lines)  # the config's ``` does not close the block


def test_html_has_no_raw_html_from_names():
    assert "<img src=x" not in render_html(_page())

"""docs/paper_claims.md's tables are what `python -m analysis.claims` makes of the committed metrics, exactly.

The page quotes tables of reports/unstable/claims.md between the markers `<!-- analysis.claims:begin -->` and
`<!-- analysis.claims:end -->`; both must be regenerated, byte for byte, from reports/unstable/metrics.jsonl.gz
(the issue's done-when: `python -m analysis.claims <saved metrics>` regenerates the page's tables).
"""

from __future__ import annotations

from pathlib import Path

from analysis.claims import claims_page
from analysis.claims_runs import load_arms

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "reports" / "unstable" / "metrics.jsonl.gz"
PAGE = ROOT / "docs" / "paper_claims.md"
TABLES = ROOT / "reports" / "unstable" / "claims.md"


def _quoted_tables(text: str, name: str = "", tool: str = "claims") -> list[str]:
    """The Markdown tables the page quotes between `<!-- analysis.<tool>:begin[ name] -->` and its end marker."""
    begin = f"<!-- analysis.{tool}:begin" + (f" {name}" if name else "") + " -->"
    end = f"<!-- analysis.{tool}:end -->"
    blocks, inside, cur = [], False, []
    for line in text.splitlines():
        if line.strip() == begin:
            inside = True
        elif line.strip() == end:
            inside = False
        elif inside and line.startswith("|"):
            cur.append(line)
            continue
        if cur:
            blocks.append("\n".join(cur))
            cur = []
    return blocks


def test_the_page_and_its_tables_regenerate_from_the_saved_metrics():
    generated = claims_page(load_arms(SAVED))
    assert TABLES.read_text().rstrip("\n") == generated.rstrip("\n")
    quoted = _quoted_tables(PAGE.read_text())
    assert len(quoted) >= 3, "the page quotes the drift, failure and test tables"
    for block in quoted:
        assert block in generated, f"a table on the page is not what analysis.claims makes:\n{block[:300]}"


def test_experiment_2s_tables_regenerate_from_its_saved_metrics():
    root = ROOT / "reports" / "unstable_lr2e3"
    generated = claims_page(load_arms(root / "metrics.jsonl.gz"))
    assert (root / "claims.md").read_text().rstrip("\n") == generated.rstrip("\n")
    quoted = _quoted_tables(PAGE.read_text(), "lr2e3")
    assert len(quoted) >= 3
    for block in quoted:
        assert block in generated, f"a table on the page is not what analysis.claims makes:\n{block[:300]}"

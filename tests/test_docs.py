"""The README stays a one-page quickstart and the docs hold together: links resolve, the modules the
README runs exist, the config fields it names exist, CI can read its install and test commands."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from moe_gspo.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 260

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, spaces and
    hyphens kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    return [a or b for a, b in _LINK.findall(_prose(page.read_text()))]


def test_readme_is_one_page():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; keep it a quickstart (≤ {MAX_README_LINES}), move the rest to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading '#{anchor}' in {dest.relative_to(ROOT)})")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README) if t.partition("#")[0]}
    unlinked = [p.relative_to(ROOT) for p in PAGES[1:] if p.resolve() not in linked]
    assert unlinked == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_modules_exist(page):
    """Every `python -m X` (and `torchrun ... -m X`, `moe_gspo.launch ... -m X`) names an importable module."""
    text = page.read_text()
    modules = set(re.findall(r"python3? -m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text))
    modules |= set(re.findall(r"(?:torchrun|moe_gspo\.launch) [^`\n]*?-m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text))
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert missing == [], f"{page.relative_to(ROOT)} names modules that do not exist: {missing}"
    if page == README:
        assert {"moe_gspo.launch", "moe_gspo.train", "analysis.report", "analysis.compare"} <= modules


def _config_fields() -> dict[str, set[str]]:
    cfg = Config()
    return {f.name: {g.name for g in dataclasses.fields(getattr(cfg, f.name))} for f in dataclasses.fields(Config)}


def test_readme_config_fields_exist():
    """Every `section.key` the README names in code is a field of the config."""
    fields = _config_fields()
    readme = README.read_text()
    code = re.findall(r"`([^`\n]+)`", _prose(readme)) + re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.S | re.M)
    text = "\n".join(code)
    named = set(re.findall(r"(?<![\w./-])(" + "|".join(fields) + r")\.([a-z_][a-z_0-9]*)\b(?![./\w])", text))
    files = {"jsonl", "json", "yaml", "md", "py", "log", "html"}  # eval.jsonl, train.log: file names
    unknown = sorted(f"{s}.{k}" for s, k in named if k not in fields[s] and k not in files)
    assert named and unknown == []


@pytest.mark.parametrize("marker", ["install", "test"])
def test_ci_reads_the_readme_commands(marker):
    """`.ci/run` runs the first line after `<!-- install -->` / `<!-- test -->` that does not start
    with a backtick: the command inside the code block right after the marker."""
    lines = README.read_text().splitlines()
    i = lines.index(f"<!-- {marker} -->")
    assert lines[i + 1].startswith("```") and lines[i + 3].startswith("```")
    assert lines[i + 2].strip() and not lines[i + 2].startswith("`")

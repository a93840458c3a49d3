"""Docs against the code, claims of every page (issue 60): the run counts a page states for a shipped ablation spec
are the spec's own expansion, and the messages a page quotes are in the code. (The pages' links, modules and
names: tests/test_docs.py.)"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from test_docs import PAGES, ROOT, _prose

SPEC_FILES = sorted(p for d in ("configs", "benchmarks") for p in (ROOT / d).rglob("*.yaml"))
COUNTED = [*PAGES, *sorted((ROOT / "configs").glob("ablation_*.yaml"))]
"""Where a stated run count is checked: every page and the shipped specs' own comments."""


@functools.lru_cache(maxsize=None)
def _spec_runs(path: Path) -> int | None:
    """The number of runs of the ablation spec at `path`, expanded with the project's own code (None: not a spec)."""
    import yaml

    from moe_gspo.run.ablation_arms import expand_arms
    from moe_gspo.run.ablation_spec import load_spec

    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or "algos" not in raw:
        return None
    return len(expand_arms(load_spec(path), warn=False))


def _spec_named(name: str) -> Path | None:
    """The shipped file a page names (`configs/ablation_phase.yaml`, `ablation_phase.yaml`, a benchmark's spec)."""
    for path in SPEC_FILES:
        if str(path.relative_to(ROOT)) == name or path.name == name:
            return path
    return None


def run_count_problems(page: Path) -> list[str]:
    """Each run count `page` states for a shipped spec that its expansion contradicts: a spec's file named, then
    "N runs" (or "K of N runs") later in the same sentence, before any other file (a rate, "73.1 runs/hour", is not a
    count); or a count in words ("several hundred runs") where a number belongs."""
    problems = []
    for para in re.split(r"\n\s*\n", page.read_text(encoding="utf-8")):
        text = " ".join(para.replace("`", "").split())
        for m in re.finditer(r"([\w./-]+\.yaml)\b((?:(?!\.yaml|\. |\.$).){0,160}?)"
                             r"\b(?:(\d+) of )?(?<![\d.])(\d+|several hundred|hundreds of|dozens of|a few) runs\b", text):
            spec = _spec_named(m.group(1))
            if spec is None or (want := _spec_runs(spec)) is None:
                continue
            said = m.group(4)
            if not said.isdigit():
                problems.append(f"{m.group(1)}: '{said} runs': it expands to {want} runs; state the number")
            elif int(said) != want:
                problems.append(f"{m.group(1)}: '{said} runs': it expands to {want} runs")
    return problems


@pytest.mark.parametrize("page", COUNTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_run_counts_stated_for_a_shipped_spec_are_its_own(page):
    """Issue 60: docs/cluster.md called configs/ablation_phase.yaml "several hundred runs" (169) and
    ablation_unstable.yaml "130 runs" (100). Each count a page states for a shipped spec is the spec's expansion."""
    assert run_count_problems(page) == []


def test_the_run_count_check_sees_a_wrong_count(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`configs/ablation_phase.yaml` is 169 runs. `configs/ablation_unstable.yaml`, 130 runs, is shipped.\n\n"
                    "The phase matrix (`configs/ablation_phase.yaml`) is several hundred runs of the tiny\nmodels.\n\n"
                    "```bash\npython -m moe_gspo.ablate --config configs/ablation_tiny.yaml   # 12 runs\n"
                    "python -m moe_gspo.ablate --config configs/ablation_phase_fine.yaml   # 18 of 24 runs\n```\n\n"
                    "`configs/ablation_phase.yaml` ran at 73.1 runs/hour.\n")  # a rate, not a count
    assert run_count_problems(page) == [
        "configs/ablation_unstable.yaml: '130 runs': it expands to 100 runs",
        "configs/ablation_phase.yaml: 'several hundred runs': it expands to 169 runs; state the number",
        "configs/ablation_phase_fine.yaml: '24 runs': it expands to 25 runs",
    ]


MESSAGE_BEFORE = re.compile(r"\b(prints?|says?|messages?|refused? with|warns?|one line|exits? with)\b[^.`]{0,25}$",
                            re.I)
"""Words that introduce a quoted message: "prints `...`", "one line, `...`"."""
PLACEHOLDER = re.compile(r"(?:\b[A-Z][A-Z_0-9]*\b|\S*/\S*|\b\w+(?:\.\w+)+\b|\b\d+(?:\.\d+)?\b|…|\.\.\.|;)")
"""What a quoted message fills in at run time (N, RUN_DIR, a path, a module, a number) or a place a message's
literal may be cut (`;`)."""


@functools.lru_cache(maxsize=1)
def _string_constants() -> str:
    """Every string literal of the code (f-strings' literal parts too), whitespace collapsed, one a line."""
    import ast

    out = []
    for d in ("moe_gspo", "analysis", "benchmarks"):
        for path in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append(" ".join(node.value.split()))
    return "\n".join(out)


def quoted_message_problems(page: Path) -> list[str]:
    """Each message `page` quotes (a code span after "prints", "says", "one line", ...) whose literal text is in no
    string of the code: the message split at what is filled in at run time, each piece of two words or six
    characters looked up."""
    problems = []
    code = _string_constants()
    for para in re.split(r"\n\s*\n", _prose(page.read_text(encoding="utf-8"))):
        para, prev = " ".join(para.split()), 0
        for m in re.finditer(r"`([^`]+)`", para):
            before, prev, span = para[prev:m.start()], m.end(), m.group(1)
            if not MESSAGE_BEFORE.search(before[-45:]) or " " not in span or re.match(
                    r"(python|torchrun|pip|bash|cd|--)\b", span):
                continue
            pieces = [p.strip() for p in PLACEHOLDER.split(span)]
            missing = [p for p in pieces if (len(p) >= 6 or len(p.split()) >= 2) and p not in code]
            if missing:
                problems.append(f"`{span}`: not in the code: {missing}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_messages_exist_in_the_code(page):
    """Issue 60: a message a page quotes is one the code prints (its literal parts, in a string of the code)."""
    assert quoted_message_problems(page) == []


def test_the_message_check_sees_a_reworded_message(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("A resumed run prints `resuming at step N from RUN_DIR`; a finished one prints `RUN_DIR is "
                    "complete at step N, nothing to do`; the launcher prints one line (`[moe_gspo.launch] "
                    "moe_gspo.train failed with exit code 2 (first on rank 0); the error is printed above`).\n")
    assert quoted_message_problems(page) == ["`RUN_DIR is complete at step N, nothing to do`: not in the code: "
                                             "['is complete at step', ', nothing to do']"]

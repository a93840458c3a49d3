"""The metric keys docs/metrics.md documents, for the tests that hold runs' rows against the page
(`tests/test_docs.py`, `tests/test_train.py`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

METRICS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def documented_metric_keys() -> set[str]:
    """The metric names of the section "What a step logs" of docs/metrics.md (up to the next section):
    every backticked `name` or `prefix/name`, and `prefix/*` for a family given by its suffixes."""
    page = METRICS_PAGE.read_text(encoding="utf-8")
    section = page.split("## What a step logs", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([a-z_0-9]+(?:/[a-z_0-9*]+)?)`", section))


def undocumented_metric_keys(keys: Iterable[str]) -> list[str]:
    """The keys of `keys` that docs/metrics.md documents neither by name nor as `prefix/*`, sorted."""
    documented = documented_metric_keys()
    return sorted({k for k in keys if k not in documented and k.split("/")[0] + "/*" not in documented})

"""One expert-id dtype rule (`moe_gspo.routing.trace.ids_dtype`): what it says, that the learner's recorded
routes, the router hooks and the memory plan follow it, and that no other module writes the rule again."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from moe_gspo.learner.old_pass import device_ids_dtype
from moe_gspo.plan.host_routes import id_bytes, learner_id_bytes
from moe_gspo.routing.trace import ids_dtype

PACKAGE = Path(__file__).resolve().parents[2] / "moe_gspo"


def test_the_rule_and_its_users():
    for E, kept, gathered in ((8, np.uint8, np.uint8), (256, np.uint8, np.uint8), (257, np.uint16, np.int32),
                              (65536, np.uint16, np.int32)):
        assert ids_dtype(E) == kept and ids_dtype(E, collective=True) == gathered
        assert id_bytes(E) == np.dtype(kept).itemsize and learner_id_bytes(E) == np.dtype(gathered).itemsize
        assert device_ids_dtype(E) == getattr(torch, np.dtype(gathered).name)


def test_no_module_writes_the_rule_again():
    """The 256-expert threshold of the id dtype lives in `routing/trace.py` only (engines' transient int16
    buffers while generating are not the kept dtype)."""
    pattern = re.compile(r"<=\s*256\s+else|np\.uint8 if|torch\.uint8 if")
    offenders = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py") if p.name != "trace.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, f"expert-id dtype written outside moe_gspo.routing.trace.ids_dtype: {offenders}"

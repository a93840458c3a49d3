"""Fixtures of the learner tests: one EP=1 process group per test module that asks for `dist`."""

from __future__ import annotations

import pytest

from moe_gspo.mcore.parallel import destroy_distributed, init_distributed


@pytest.fixture(scope="module")
def dist():
    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    yield info
    destroy_distributed()

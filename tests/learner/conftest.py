"""Fixtures of the learner tests: one EP=1 process group per test module that asks for `dist`, and the tiny
transformers / Megatron pair with the same weights (`pair`, eval mode, no routing replay)."""

from __future__ import annotations

import pytest

from _learner_common import tiny_pair
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed


@pytest.fixture(scope="module")
def dist():
    info = init_distributed(ep_size=1, num_experts=8, seed=0)
    yield info
    destroy_distributed()


@pytest.fixture(scope="module")
def pair(dist):
    cfg, hf, model = tiny_pair(enable_routing_replay=False)
    model.eval()
    return cfg, hf, model

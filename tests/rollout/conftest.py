"""Fixtures of the rollout tests: the tiny model (seed 0) and an fp32 transformers engine on it, one per module."""

from __future__ import annotations

import pytest

from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def engine32(model):
    return HFEngine(model, dtype="float32", device="cpu")

"""Process-grid validation (pure; the EP=2 launch itself is in test_ep2.py)."""

from __future__ import annotations

import pytest

from moe_gspo.mcore.parallel import validate_parallel_sizes


def test_valid_grids_pass():
    for world, ep, experts in ((1, 1, 8), (2, 2, 8), (4, 2, 8), (8, 8, 128)):
        validate_parallel_sizes(world_size=world, ep_size=ep, num_experts=experts)


@pytest.mark.parametrize(("world", "ep", "experts", "match"), [
    (3, 3, 8, "num_experts=8 is not divisible by parallel.expert_parallel_size=3"),
    (3, 2, 8, "world size 3 is not divisible by parallel.expert_parallel_size=2"),
    (1, 0, 8, "expert_parallel_size must be >= 1"),
])
def test_bad_grids_name_the_field(world, ep, experts, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_sizes(world_size=world, ep_size=ep, num_experts=experts)

"""Which prompts each rollout engine samples (`moe_gspo.run.steps.rollout_share`)."""

import pytest
import torch

from moe_gspo.mcore.parallel import ParallelInfo
from moe_gspo.run.steps import rollout_share


def _info(rank: int, world: int) -> ParallelInfo:
    return ParallelInfo(rank=rank, world_size=world, local_rank=rank, ep_size=2, ep_rank=rank % 2, dp_size=world,
                        dp_rank=rank, device=torch.device("cpu"), backend="gloo")


def test_one_engine_per_rank_without_tensor_parallelism():
    assert [rollout_share(_info(r, 4)) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]


@pytest.mark.parametrize("tp,want", [(2, [(0, 2), (0, 2), (1, 2), (1, 2)]), (4, [(0, 1)] * 4)])
def test_tensor_parallel_ranks_of_one_engine_share_prompts(tp, want):
    assert [rollout_share(_info(r, 4), tp) for r in range(4)] == want

"""Issue 43.5: every rank scores the whole global batch, so rewards that differ between ranks (a
non-deterministic task.reward) stop the run on every rank with the same one line, instead of training
on rank 0's view. Two real gloo processes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_gspo.rollout.base import RolloutSample
from moe_gspo.tasks import Prompt


def _worker(rank: int, init_file: str, out_dir: str, differ: bool) -> None:
    from moe_gspo.run.steps import check_rewards_agree

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        prompts = [Prompt(text="1+1=", answer="2", where="data.jsonl:1"), Prompt(text="2+2=", answer="4", where="data.jsonl:2")]
        samples = [RolloutSample.__new__(RolloutSample) for _ in range(4)]
        for i, s in enumerate(samples):
            s.prompt_index = i // 2
        rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
        if differ and rank == 1:
            rewards[2] = 0.25
        try:
            check_rewards_agree(rewards, prompts, samples)
            msg = "ok"
        except ValueError as e:
            msg = str(e)
        Path(out_dir, f"rank{rank}.txt").write_text(msg)
    finally:
        dist.destroy_process_group()


def _run(differ: bool) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(os.path.join(d, "init"), d, differ), nprocs=2, join=True,
                           start_method="fork")  # fork: no re-import of torch per process
        return [Path(d, f"rank{r}.txt").read_text() for r in range(2)]


@pytest.mark.slow
def test_rewards_that_differ_between_ranks_stop_every_rank_naming_the_prompt():
    a, b = _run(differ=True)
    assert a == b, (a, b)
    assert "differs between ranks" in a and "data.jsonl:2" in a and "rank 0: 0.5" in a and "rank 1: 0.25" in a
    assert _run(differ=False) == ["ok", "ok"]


def test_a_world_of_one_is_not_checked():
    from moe_gspo.run.steps import check_rewards_agree

    check_rewards_agree(torch.tensor([1.0]), [], [])

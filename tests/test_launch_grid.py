"""Issue 43.13: the launcher checks parallel.expert_parallel_size against the world size (and the
model's experts) before any worker starts."""

from __future__ import annotations

import pytest
import torch.distributed.run as torchrun

from moe_gspo import launch


@pytest.mark.parametrize("launch_args, train_args, msg", [
    (["--nproc-per-node", "2"], ["parallel.expert_parallel_size=4"],
     "error: world size 2 is not divisible by parallel.expert_parallel_size=4"),
    (["--nproc-per-node", "3"], ["parallel.expert_parallel_size=3"],
     "error: model num_experts=8 is not divisible by parallel.expert_parallel_size=3"),
])
def test_an_ep_size_the_launch_cannot_hold_is_one_line_before_any_worker(monkeypatch, capsys, launch_args,
                                                                           train_args, msg):
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    code = launch.main(["--standalone", *launch_args, "-m", "moe_gspo.train", *train_args])
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, started, len(err)) == (2, [], 1) and err[0].startswith(msg), err


def test_a_world_size_not_fixed_here_is_left_to_the_workers(monkeypatch):
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    assert launch.main(["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        "127.0.0.1:29999", "-m", "moe_gspo.train", "parallel.expert_parallel_size=4"]) == 0
    assert launch.main(["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train",
                        "parallel.expert_parallel_size=2"]) == 0
    assert len(started) == 2

"""moe_gspo.learner.lr_schedule: hand-computed rates, transformers' WSD schedule in the decay (what the
TRL race hands TRL), the config checks, and the optimizer actually stepping with the rate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks.trl_worker import trl_lr_schedule
from moe_gspo.config import TrainConfig
from moe_gspo.config_load import load_config
from moe_gspo.learner.lr_schedule import lr_at

ROOT = Path(__file__).resolve().parents[2]


def test_constant_warmup_and_decays_by_hand():
    assert [lr_at(s, lr=1.0, num_steps=10) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]
    assert [lr_at(s, lr=1.0, num_steps=10, warmup_steps=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # linear over the last 4 of 10 steps (start 6): p = 0, 1/4, 2/4, 3/4
    lin = [lr_at(s, lr=2.0, num_steps=10, decay="linear", decay_steps=4) for s in range(5, 10)]
    assert lin == pytest.approx([2.0, 2.0, 1.5, 1.0, 0.5])
    floor = [lr_at(s, lr=2.0, num_steps=10, decay="linear", decay_steps=4, min_lr_ratio=0.5) for s in (6, 8, 9)]
    assert floor == pytest.approx([2.0, 1.5, 1.25])  # 1 + 1 * (1 - p)
    cos = [lr_at(s, lr=1.0, num_steps=10, decay="cosine", decay_steps=4) for s in (6, 7, 8)]
    assert cos == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5])
    # decay_steps=0: every step after the warm-up (2 warm-up steps, then p = (s - 2) / 8)
    assert lr_at(6, lr=1.0, num_steps=10, warmup_steps=2, decay="linear") == pytest.approx(0.5)


@pytest.mark.parametrize("decay", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_decay_equals_transformers_wsd_at_each_rl_steps_first_optimizer_step(decay, warmup):
    from transformers.optimization import get_scheduler

    tr = TrainConfig(steps=20, lr=1e-3, lr_warmup_steps=warmup, lr_decay=decay, lr_decay_steps=8, min_lr_ratio=0.1,
                     num_minibatches=4)
    kw = trl_lr_schedule(tr, max_steps=tr.steps)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=tr.lr)
    sched = get_scheduler(kw["lr_scheduler_type"], opt, num_warmup_steps=kw["warmup_steps"],
                          num_training_steps=tr.steps * tr.num_minibatches, scheduler_specific_kwargs=kw["lr_scheduler_kwargs"])
    theirs = []
    for _ in range(tr.steps * tr.num_minibatches):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [lr_at(s, lr=tr.lr, num_steps=tr.steps, warmup_steps=warmup, decay=decay, decay_steps=8, min_lr_ratio=0.1)
            for s in range(tr.steps)]
    assert ours[warmup:] == pytest.approx(theirs[warmup * 4::4], rel=1e-12)
    assert ours[-1] > 0.1 * tr.lr and ours[12] == tr.lr and ours[11] == tr.lr  # decay starts at step 20 - 8


def test_the_decay_fraction_follows_train_steps():
    def steps(**kw):
        return TrainConfig(lr_decay="linear", **kw).resolved_lr_decay_steps()

    assert steps(steps=400, lr_decay_fraction=0.25) == 100 and steps(steps=20, lr_decay_fraction=0.25) == 5
    assert steps(steps=1, lr_decay_fraction=0.25) == 1  # at least one step, which keeps the full rate
    assert lr_at(0, **TrainConfig(steps=1, lr=0.5, lr_decay="linear", lr_decay_fraction=0.25).lr_schedule()) == 0.5
    assert steps(steps=10, lr_warmup_steps=8) == 2  # fraction 1.0: every step after the warm-up
    assert steps(steps=400, lr_decay_steps=30, lr_decay_fraction=0.25) == 30  # explicit steps win
    assert TrainConfig(steps=400).resolved_lr_decay_steps() == 0


@pytest.mark.parametrize("override, field", [
    (["train.lr_decay_fraction=0"], "train.lr_decay_fraction=0"),
    (["train.lr_decay=linear", "train.lr_decay_steps=500"], "train.lr_warmup_steps=0 + train.lr_decay_steps=500"),
    (["train.lr_decay=cosine", "train.min_lr_ratio=1.5"], "train.min_lr_ratio=1.5"),
    (["train.lr_warmup_steps=-1"], "train.lr_warmup_steps=-1"),
    (["train.lr_decay=step"], "train.lr_decay"),
])
def test_bad_schedules_name_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace("+", r"\+")):
        load_config(ROOT / "configs/tiny_cpu.yaml", overrides=override)


def test_turning_the_decay_off_on_the_command_line_is_not_an_error():
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", overrides=["train.lr_decay=none"])  # yaml sets the fraction
    assert cfg.train.resolved_lr_decay_steps() == 0
    with pytest.warns(UserWarning, match="train.lr_decay_steps=10 / train.min_lr_ratio=0.0 have no effect"):
        load_config(ROOT / "configs/tiny_cpu.yaml", overrides=["train.lr_decay=none", "train.lr_decay_steps=10"])


def test_the_optimizer_steps_with_the_rate_it_is_given():
    from moe_gspo.learner.optim import LearnerOptimizer

    class FakeDDP:  # the CPU path's contract: main_grad buffers, a global norm, scale, zero
        def __init__(self, module):
            self.module = module

    w = torch.nn.Linear(2, 2, bias=False)
    w.weight.data.fill_(1.0)
    w.weight.main_grad = torch.ones_like(w.weight)
    opt = LearnerOptimizer(FakeDDP(w), lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=0.0,
                           use_megatron=False)
    opt.set_lr(0.25)
    opt.step()  # Adam's first step moves each weight by lr (bias-corrected m / sqrt(v) = 1)
    assert torch.allclose(w.weight.data, torch.full((2, 2), 0.75), atol=1e-6) and opt.lr == 0.25

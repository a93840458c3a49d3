"""moe_gspo.mcore.model.TrainModeSwitch: the same `training` flags as `nn.Module.train`, without its recursion."""

import torch
from torch import nn

from moe_gspo.mcore.model import TrainModeSwitch


def _tree():
    shared = nn.Linear(2, 2)
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(shared, nn.Dropout(0.5), nn.ModuleList([shared, nn.ReLU()])))


def _flags(m):
    return [x.training for x in m.modules()]


def test_switch_sets_the_flags_nn_module_train_sets():
    a, b = _tree(), _tree()
    switch = TrainModeSwitch(b)
    assert switch.plain and len(switch.modules) == len(list(b.modules()))
    for mode in (False, True, False):
        a.train(mode)
        switch(mode)
        assert _flags(b) == _flags(a) == [mode] * len(_flags(a))
    # eval mode reaches the dropout: its output is its input, as after nn.Module.eval()
    x = torch.ones(4, 2)
    assert torch.equal(b[1][1](x), x)


def test_a_class_with_its_own_train_switches_through_it():
    calls = []

    class Own(nn.Linear):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    m = nn.Sequential(nn.Linear(2, 2), Own(2, 2))
    switch = TrainModeSwitch(m)
    assert not switch.plain
    switch(False)
    assert calls == [False] and _flags(m) == [False, False, False]

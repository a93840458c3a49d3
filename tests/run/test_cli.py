"""The train command line under torchrun: a config warning is printed by rank 0 only."""

import warnings

import pytest

from moe_gspo.run import cli


@pytest.mark.parametrize("rank,num_warnings", [("0", 1), ("1", 0)])
def test_config_warnings_once_under_torchrun(monkeypatch, rank, num_warnings):
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, cfg = cli.parse_train_args(["--algo", "gspo", "algo.clip_low=0.2", "algo.clip_high=0.2"])
    assert cfg.algo.clip_low == 0.2  # the config still loads on every rank
    assert sum("token-level range" in str(w.message) for w in caught) == num_warnings

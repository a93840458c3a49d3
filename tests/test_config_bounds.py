"""Issue 43.12: train.lr, train.num_minibatches and train.keep_checkpoints at 0 or below are refused,
naming the field. Issue 49: the config-time clip rule (a ratio clip's algo.clip_low in (0, 1)), which only
`policy_loss`'s own copy of it was tested for."""

from __future__ import annotations

import pytest

from moe_gspo.config import Config
from moe_gspo.config_checks import validate


@pytest.mark.parametrize("field", ["lr", "num_minibatches", "keep_checkpoints"])
@pytest.mark.parametrize("value", [0, -1])
def test_nonpositive_train_fields_are_refused(field, value):
    cfg = Config()
    setattr(cfg.train, field, value)
    with pytest.raises(ValueError, match=rf"^train.{field}={value} must be > 0$"):
        validate(cfg)


@pytest.mark.parametrize("algo", ["gspo", "grpo", "gspo_token"])
@pytest.mark.parametrize("clip_low", ["0", "1", "1.5", "-0.1"])
def test_a_ratio_clip_low_outside_0_1_is_refused_at_config_time(algo, clip_low):
    from moe_gspo.config_load import load_config

    with pytest.raises(ValueError, match=rf"^algo.clip_low={float(clip_low)} must be in \(0, 1\)$"):
        load_config(None, [f"algo.name={algo}", f"algo.clip_low={clip_low}"])


def test_clip_low_inside_0_1_and_a_log_bound_above_1_pass():
    from moe_gspo.config_load import load_config

    assert load_config(None, ["algo.name=grpo", "algo.clip_low=0.999"]).algo.clip_low == 0.999
    assert load_config(None, ["algo.name=gmpo", "algo.clip_low=1.5"]).algo.clip_low == 1.5  # e^-1.5: a log bound

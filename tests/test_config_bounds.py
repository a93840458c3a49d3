"""Issue 43.12: train.lr, train.num_minibatches and train.keep_checkpoints at 0 or below are refused,
naming the field."""

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

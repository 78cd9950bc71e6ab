"""Learning-rate schedule shapes."""

import pytest

from tidal.config.common import SchedulerConfig
from tidal.trainer.optim import lr_factor


def test_warmup_is_linear_to_peak():
    config = SchedulerConfig(type="constant", warmup_steps=4)
    assert [lr_factor(s, 10, config) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_decays_from_peak_to_min_ratio():
    config = SchedulerConfig(type="cosine", warmup_steps=0, min_lr_ratio=0.1)
    assert lr_factor(0, 100, config) == pytest.approx(1.0)
    assert lr_factor(50, 100, config) == pytest.approx(0.55)
    assert lr_factor(100, 100, config) == pytest.approx(0.1)


def test_linear_decay_after_warmup():
    config = SchedulerConfig(type="linear", warmup_steps=10)
    assert lr_factor(10, 110, config) == pytest.approx(1.0)
    assert lr_factor(60, 110, config) == pytest.approx(0.5)
    assert lr_factor(110, 110, config) == pytest.approx(0.0)

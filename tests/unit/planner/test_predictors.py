"""The load predictors: constant, and the statsmodels fits on a step and a trend."""

from __future__ import annotations

import pytest

from dynamo.errors import UserError
from dynamo.planner.predictors import make_predictor


def test_constant_is_the_last_value():
    p = make_predictor("constant")
    assert p.predict() == 0.0
    for v in (1.0, 5.0, float("nan")):
        p.add(v)
    assert p.predict() == 5.0


@pytest.mark.parametrize("name", ["arima", "kalman"])
def test_fits_follow_a_step(name):
    p = make_predictor(name)
    for v in [10.0, 11.0, 9.0, 10.5, 9.5] * 4 + [40.0, 41.0, 39.0, 40.5, 39.5, 40.0]:
        p.add(v)
    assert 30.0 < p.predict() < 50.0


def test_arima_extrapolates_a_trend():
    p = make_predictor("arima")
    for i in range(30):
        p.add(10.0 + 2.0 * i + (0.3 if i % 2 else -0.3))
    assert p.predict() > 10.0 + 2.0 * 29 - 1.0


@pytest.mark.parametrize("name", ["arima", "kalman"])
def test_short_or_flat_series_answer_the_last_value(name):
    p = make_predictor(name)
    p.add(3.0)
    p.add(4.0)
    assert p.predict() == 4.0
    for _ in range(10):
        p.add(7.0)
    assert p.predict() == 7.0


def test_unknown_predictor_is_a_user_error():
    with pytest.raises(UserError, match="--load-predictor"):
        make_predictor("prophet")

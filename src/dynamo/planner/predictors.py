"""Load predictors: the next adjustment interval's value of one observed series (request rate, mean input
length, mean output length), from the values of the intervals before it.

* ``constant``: the last value (Dynamo's default: the next interval looks like this one).
* ``arima``: an ARIMA(1,1,1) fitted by statsmodels on the recent window, one step ahead.
* ``kalman``: a local-level model (a random walk observed with noise) fitted by statsmodels'
  ``UnobservedComponents``, whose one-step forecast is the Kalman filter's smoothed level: it follows a
  step in a few intervals without chasing every noisy one.

statsmodels is imported when a fitting predictor is first used, so ``constant`` runs without it (it is the
``planner`` extra).  Fitting blocks for milliseconds to tens of milliseconds, so the planner calls
:meth:`Predictor.predict` off its event loop.  Until a fit has enough points, and whenever a fit fails
(a flat series makes ARIMA's likelihood degenerate), the predictors answer the last value: a predictor
never stops the planner.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from typing import Protocol

from dynamo.errors import UserError

log = logging.getLogger(__name__)

PREDICTORS = ("constant", "arima", "kalman")
WINDOW = 100  # intervals a fitting predictor looks back over
MIN_FIT_POINTS = 5  # below this a fit says little: answer the last value


class Predictor(Protocol):
    """One series' predictor: fed each interval's value, asked for the next one."""

    def add(self, value: float) -> None: ...

    def predict(self) -> float: ...


class ConstantPredictor:
    def __init__(self) -> None:
        self.last = 0.0

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.last = value

    def predict(self) -> float:
        return self.last


class _FittingPredictor:
    """The window of values and the fall-backs the statsmodels predictors share."""

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=WINDOW)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(value)

    def predict(self) -> float:
        if not self.values:
            return 0.0
        last = self.values[-1]
        if len(self.values) < MIN_FIT_POINTS or max(self.values) == min(self.values):
            return last
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence chatter on short series
                value = self._forecast(list(self.values))
        except ImportError:
            raise
        except Exception as e:  # noqa: BLE001 - any numerical failure of a fit: keep planning on the last value
            log.debug("%s fit failed (%s); using the last value", type(self).__name__, e)
            return last
        return max(0.0, value) if math.isfinite(value) else last

    def _forecast(self, values: list[float]) -> float:
        raise NotImplementedError


class ArimaPredictor(_FittingPredictor):
    def _forecast(self, values: list[float]) -> float:
        from statsmodels.tsa.arima.model import ARIMA

        fit = ARIMA(values, order=(1, 1, 1)).fit()
        return float(fit.forecast(1)[0])


class KalmanPredictor(_FittingPredictor):
    def _forecast(self, values: list[float]) -> float:
        from statsmodels.tsa.statespace.structural import UnobservedComponents

        fit = UnobservedComponents(values, level="local level").fit(disp=False)
        return float(fit.forecast(1)[0])


def make_predictor(name: str) -> Predictor:
    """The predictor called ``name``; a fitting one checks now that statsmodels is installed."""
    if name == "constant":
        return ConstantPredictor()
    if name not in PREDICTORS:
        raise UserError(f"--load-predictor must be one of {', '.join(PREDICTORS)}, not {name!r}")
    try:
        import statsmodels  # noqa: F401
    except ImportError:
        raise UserError(f"--load-predictor {name} needs statsmodels: pip install 'dynamo-run-py[planner]'") from None
    return ArimaPredictor() if name == "arima" else KalmanPredictor()

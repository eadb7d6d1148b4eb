"""The one definition of a percentile for every benchmark and load-test report.

numpy's default: linear interpolation between the two nearest ranks, so p50 is
the median (the mean of the middle two of an even count) and p99 of a small
sample lies between its two largest values rather than being one of them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def percentiles(values: Sequence[float], percents: Sequence[float]) -> list[float]:
    """The ``percents`` (0 to 100) percentiles of ``values``, by linear interpolation."""
    if len(values) == 0:
        raise ValueError("a percentile of no values is undefined")
    return [float(value) for value in np.percentile(values, percents)]


def percentile(values: Sequence[float], percent: float) -> float:
    """The ``percent`` (0 to 100) percentile of ``values``; ``percentile(values, 50)`` is the median."""
    return percentiles(values, [percent])[0]

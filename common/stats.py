"""Summary statistics shared by the worker, the tools and the tests (one rule for each)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


def percentile(values: Iterable[float], q: float, empty: float = math.nan) -> float:
    """The q-th percentile (0-100) of ``values`` by nearest rank (numpy's "nearest": the
    value at index round((n - 1) * q / 100)), so it is always one of the values.

    ``empty`` is the answer for no values: nan by default (a report then shows "nan", not
    a made-up figure); a caller for whom nothing measured means nothing spent (the worker's
    headroom) asks 0.0.
    """
    data = np.fromiter(values, dtype=np.float64)
    if data.size == 0:
        return float(empty)
    return float(np.percentile(data, q, method="nearest"))

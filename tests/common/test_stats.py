"""The one percentile rule the worker, the tools and the tests share."""

from __future__ import annotations

import math

from omnifabric.common.stats import percentile
from omnifabric.tools import fleet_bench


def test_percentile_is_one_of_the_values_by_nearest_rank():
    values = [float(n) for n in range(1, 101)]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 51.0  # index round(49.5) = 50 (half to even)
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(iter([5.0, 7.0]), 90) == 7.0  # any iterable, read once


def test_no_values_give_the_callers_choice():
    assert math.isnan(percentile([], 50))
    assert percentile([], 95, empty=0.0) == 0.0
    assert fleet_bench.percentile([], 99) == 0.0  # its JSON report has no NaN

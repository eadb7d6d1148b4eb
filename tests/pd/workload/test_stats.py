import statistics

import pytest

from pd.workload.stats import percentile, percentiles


def test_percentiles_interpolate_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == statistics.median(values) == 2.5
    assert percentiles(values, [0, 90, 100]) == pytest.approx([1.0, 3.7, 4.0])
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # not the nearest rank, 100


def test_percentile_of_no_values_is_an_error():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)

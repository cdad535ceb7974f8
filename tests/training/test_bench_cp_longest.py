"""benchmarks/bench_cp_longest.py: the pure helpers that turn measured points into the longest sequence."""

from __future__ import annotations

import pytest

from benchmarks.bench_cp_longest import estimate_step_s, linear_fit, longest_fitting


def test_linear_fit_and_longest() -> None:
    xs = [4096.0, 8192.0, 16384.0]
    intercept, slope = linear_fit(xs, [100.0 + 3.0 * x for x in xs])
    assert intercept == pytest.approx(100.0) and slope == pytest.approx(3.0)
    # 100 + 3 s <= 1000 -> s <= 300, a multiple of 8: 296
    assert longest_fitting(100.0, 3.0, 1000.0, 8) == 296
    assert longest_fitting(2000.0, 3.0, 1000.0, 8) == 0  # the fixed part alone is over the budget
    with pytest.raises(ValueError, match="two distinct"):
        linear_fit([1.0, 1.0], [2.0, 3.0])


def test_estimate_scales_with_square_of_length() -> None:
    assert estimate_step_s([], 8192) is None
    done = [{"seq_length": 4096, "step_s": 1.0}, {"seq_length": 8192, "step_s": 5.0}]
    assert estimate_step_s(done, 16384) == pytest.approx(20.0)  # from the longest point: 5 x 2^2

"""The unbiased pass@k estimator against values worked out by hand and against exact binomials."""

from fractions import Fraction
from math import comb

import pytest

from codegeex_train.evaluation import estimate_pass_at_k, parse_ks, pass_at_k


@pytest.mark.parametrize("n,c,k,expected", [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (5, 2, 1, 0.4),  # c / n
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),  # n - c = 3 < 4: every 4 samples include a correct one
    (10, 0, 10, 0.0),
    (10, 10, 1, 1.0),
    (10, 1, 5, 0.5),  # 1 - C(9,5)/C(10,5) = 1 - 126/252
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
])
def test_hand_computed_values(n, c, k, expected):
    assert estimate_pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(200, 37, 1), (200, 37, 10), (200, 37, 100), (1000, 3, 100), (1000, 999, 1),
                                   (1000, 0, 100), (100, 50, 100)])
def test_matches_exact_binomials_where_floats_of_them_overflow(n, c, k):
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert estimate_pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_at_1_is_the_fraction_correct():
    for n in (1, 7, 100):
        for c in range(n + 1):
            assert estimate_pass_at_k(n, c, 1) == pytest.approx(c / n)


@pytest.mark.parametrize("n,c,k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError):
        estimate_pass_at_k(n, c, k)


def test_mean_over_tasks_and_only_the_k_every_task_allows():
    counts = [(5, 2), (5, 0), (10, 10)]  # the smallest n is 5: k = 10 and 100 are left out
    scores = pass_at_k(counts, [1, 10, 2, 100])
    assert list(scores) == [1, 2]
    assert scores[1] == pytest.approx((0.4 + 0.0 + 1.0) / 3)
    assert scores[2] == pytest.approx((0.7 + 0.0 + 1.0) / 3)


def test_parse_ks():
    assert parse_ks("1,10,100") == [1, 10, 100]
    assert parse_ks("10, 1,1") == [1, 10]
    for bad in ("", "0", "one", "1,-2"):
        with pytest.raises(ValueError):
            parse_ks(bad)

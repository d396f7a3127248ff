"""``--min-coverage`` decides on the exact covered fraction; the printed share is never more than it is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tracedump.compare.judge.coverage import CoverageCount, below_minimum, line, warnings


def _coverage(compared: int, reference: int) -> dict:
    """``CoverageCount.finish`` of ``compared`` measured pairs over ``reference`` tensors of B."""
    count = CoverageCount()
    count.add_step("", [f"t{i}" for i in range(reference)], lambda name: True)
    results = []
    for i in range(compared):
        count.read_by[i] = (("", f"t{i}"),)
        results.append(SimpleNamespace(index=i, error=0.0, metrics=None))
    return count.finish(results)


def _enforced(coverage: dict, min_coverage: float) -> int:
    """The exit code ``--min-coverage`` gives a diff that would pass (0), as the outcome decides it."""
    return 2 if below_minimum(coverage, min_coverage) is not None else 0


@pytest.mark.parametrize(
    ("compared", "reference", "minimum", "code"),
    [
        (20000, 20001, 1.0, 2),  # 0.99995 rounds to 1.0: must still be below 1
        (2, 3, 0.6667, 2),  # 0.66667 rounds to 0.6667
        (2, 3, 0.6666, 0),
        (3, 10, 0.3, 0),  # the decimal as typed: exactly 0.3 is not below 0.3
        (20001, 20001, 1.0, 0),
    ],
)
def test_min_coverage_compares_the_exact_fraction(
    compared: int, reference: int, minimum: float, code: int
) -> None:
    assert _enforced(_coverage(compared, reference), minimum) == code


def test_the_printed_share_is_rounded_down() -> None:
    assert line(_coverage(199, 200)).endswith("(99 %)")
    assert line(_coverage(20000, 20001)).endswith("(99 %)")
    assert line(_coverage(200, 200)).endswith("(100 %)")
    assert line(_coverage(1, 1000)).endswith("(0.1 %)")
    assert line(_coverage(1, 301)).endswith("(0.33 %)")
    assert line(_coverage(0, 3)).endswith("(0 %)")


def test_low_is_decided_on_the_exact_fraction() -> None:
    low = _coverage(9999, 20000)  # 0.49995 rounds to 0.5
    assert low["low"] is True and "(49 %)" in warnings(low)[0]
    assert _coverage(1, 2)["low"] is False

"""The one range type behind ``STEPS`` and ``diff --pass`` (tracedump/util/ranges.py): what it
accepts, what it refuses and says, and what each user of it gets."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tracedump
from tracedump.compare.options import parse_passes
from tracedump.errors import UsageError
from tracedump.util.ranges import IndexRanges


@pytest.mark.parametrize(
    ("text", "ranges"),
    [
        ("3", ((3, 3),)),
        ("0,3,10-20", ((0, 0), (3, 3), (10, 20))),
        (" 0, 3 ,10 - 20 ", ((0, 0), (3, 3), (10, 20))),  # spaces around items and the dash
        ("5-7,0,6,2", ((5, 7), (0, 0), (6, 6), (2, 2))),  # kept as written: the manifest shows it
        ("4-4", ((4, 4),)),
        ("0-999999999999999999", ((0, 999999999999999999),)),  # 18 digits: never expanded
        ("1,,2,", ((1, 1), (2, 2))),  # empty items are skipped
        ("", ()),
        (",", ()),
        (None, ()),
    ],
)
def test_parse_accepts_indices_and_inclusive_ranges(text: str | None, ranges: tuple) -> None:
    assert IndexRanges.parse(text).ranges == ranges


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x", "bad item 'x': expected N or LO-HI with non-negative integers, e.g. '0,3,10-20'"),
        ("-1", "bad item '-1'"),
        ("3-", "bad item '3-'"),  # no open end
        ("-3", "bad item '-3'"),
        ("1.5", "bad item '1.5'"),
        ("٣", "bad item '٣'"),  # ASCII digits only
        ("1-2-3", "bad item '1-2-3'"),
        ("1234567890123456789", "bad item '1234567890123456789'"),  # 19 digits
        ("0,5-3", "bad range '5-3': the end is before the start"),
    ],
)
def test_parse_refuses_what_is_not_an_index_or_range_and_says_which_item(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        IndexRanges.parse(text)
    assert message in str(caught.value)


def test_membership_text_count_and_indices() -> None:
    selection = IndexRanges.parse("0,3,10-20")
    assert 0 in selection and 15 in selection and 20 in selection
    assert 1 not in selection and 21 not in selection
    assert "3" not in selection and None not in selection  # only ints are indices
    assert str(selection) == "0,3,10-20"
    assert selection.count() == 13
    assert list(selection.indices()) == [0, 3, *range(10, 21)]


def test_no_ranges_restrict_nothing() -> None:
    everything = IndexRanges()
    assert 0 in everything and 10**12 in everything
    assert str(everything) == "" and everything.count() == 0


def test_merged_sorts_and_joins_overlapping_and_adjacent_ranges() -> None:
    assert IndexRanges.parse("5-7,0,6,2").merged() == IndexRanges(((0, 0), (2, 2), (5, 7)))
    assert IndexRanges.parse("1,2,3-4,9").merged() == IndexRanges(((1, 4), (9, 9)))
    assert IndexRanges.parse("10-20,0-99").merged() == IndexRanges(((0, 99),))
    assert IndexRanges().merged() == IndexRanges()


def test_a_huge_range_is_counted_not_expanded() -> None:
    huge = IndexRanges.parse("0-99999999999")
    assert huge.count() == 10**11
    assert huge.as_json() == "0-99999999999"  # too many to list: the text
    assert huge.pick([3, 10**11, 10**12]) == [3]
    assert IndexRanges.parse(",".join(["0-999999999999999999"] * 10)).count() == 10**19  # past a machine word


def test_pick_missing_and_as_json() -> None:
    selection = IndexRanges.parse("0,2,5-9").merged()
    assert selection.pick([9, 0, 1, 2, 3]) == [9, 0, 2]
    assert selection.missing([0, 2, 5, 6, 7, 8, 9]) == ""
    assert selection.missing([0, 6, 8]) == "2,5,7,9"
    assert selection.missing([]) == "0,2,5-9"
    assert IndexRanges.parse(",".join(str(2 * i) for i in range(12))).missing([]) == (
        "0,2,4,6,8,10,12,14,16,18,..."  # at most ten shown
    )
    assert selection.as_json() == [0, 2, 5, 6, 7, 8, 9]
    assert selection.as_json(listed=3) == "0,2,5-9"


# ------------------------------------------------------------------------------ the two users


def test_diff_pass_gets_merged_ranges_and_usage_errors() -> None:
    assert parse_passes(None) is None
    assert parse_passes("5-7,0,6,2") == IndexRanges(((0, 0), (2, 2), (5, 7)))
    with pytest.raises(UsageError, match=r"--pass 'x': bad item 'x': expected N or LO-HI"):
        parse_passes("x")
    with pytest.raises(UsageError, match=r"--pass '3-1': bad range '3-1': the end is before the start"):
        parse_passes("3-1")
    with pytest.raises(
        UsageError, match=r"--pass ',': expected a pass index such as 3, or a list such as 0,2,5-7"
    ):
        parse_passes(",")


def test_steps_gets_the_same_type_kept_as_written() -> None:
    config = tracedump.DumpConfig(steps="5-7,0")
    assert config.steps == IndexRanges(((5, 7), (0, 0)))
    assert config.model_dump(mode="json")["steps"] == "5-7,0"
    with pytest.raises(ValueError, match="bad item 'x'"):
        tracedump.DumpConfig(steps="x")


def test_the_comparator_s_options_do_not_import_the_settings() -> None:
    code = (
        "import sys, tracedump.compare.options as o\n"
        "o.parse_passes('0,2')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('tracedump.config', 'pydantic'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"

"""comm/env.py: HPCGRAD_* whole numbers, one parser and one wording for every bad value."""

import pytest

from hpcgrad.comm.env import whole_number


def test_unset_or_empty_gives_the_default_and_a_number_is_read():
    assert whole_number("X", 0, "n", default=7, environ={}) == 7
    assert whole_number("X", 0, "n", default=7, environ={"X": "  "}) == 7
    assert whole_number("X", 0, "n", default=7, environ={"X": " 12 "}) == 12


@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_a_bad_value_names_the_variable_what_it_means_and_what_came(raw):
    with pytest.raises(ValueError, match=f"X must be a count >= 0, got '{raw}'"):
        whole_number("X", 0, "a count >= 0", environ={"X": raw})

"""schemas/wire_fields.py: a list of numbers reads the same on its fast path (plain finite floats)
and on the item-by-item path, and bad lists fail with the same words on either."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from schemas.errors import InvalidRequestError
from schemas.wire_fields import as_floats


@pytest.mark.parametrize("state", [[0.5] * 8, (0.5, -1e308, 1e308), [1, 2.5], [np.float64(0.25)], [], [3]])
def test_number_lists_read_the_same_on_the_fast_path_and_the_item_by_item_path(state: list[Any]) -> None:
    got = as_floats(state, "state")
    assert got == tuple(float(x) for x in state) and all(type(x) is float for x in got)


@pytest.mark.parametrize(("state", "words"), [
    ([0.5, float("nan")], "finite"), ([float("inf"), float("-inf")], "finite"), ([0.5, True], "got bool"),
    ([0.5, "1"], "got str"), ([0.5] * 3, "must have 7 values"),
])
def test_bad_number_lists_fail_with_the_same_words_whatever_the_path(state: list[Any], words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        as_floats(state, "joint_positions", count=7 if words.startswith("must have") else None)

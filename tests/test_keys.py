"""Key names: one rule for every name that goes into a key, checked in broker.redis.keys."""

from __future__ import annotations

import pytest

from broker.redis.keys import MAX_NAME_LENGTH, CellKeys, check_stream_name, key_part_problem
from schemas.errors import InvalidRequestError


@pytest.mark.parametrize("part", ["", "a{b", "a}b", "a:b", "a b", "a\nb"])
def test_a_part_that_would_change_the_hash_tag_or_key_shape_is_refused(part: str) -> None:
    assert key_part_problem(part) == "no braces, colons or spaces"
    with pytest.raises(ValueError, match="invalid key part"):
        CellKeys(prefix=part or "")
    with pytest.raises(InvalidRequestError, match="invalid results stream name"):
        check_stream_name(part)


def test_stream_names_are_bounded_and_cell_keys_share_one_hash_tag() -> None:
    check_stream_name("r" * MAX_NAME_LENGTH)
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_NAME_LENGTH} characters"):
        check_stream_name("r" * (MAX_NAME_LENGTH + 1))
    keys = CellKeys("rf", "7")
    assert {keys.session("s"), keys.inbox("w"), keys.dead, keys.reply("c")} == {
        "rf:{7}:session:s", "rf:{7}:inbox:w", "rf:{7}:dead", "rf:{7}:reply:c"}

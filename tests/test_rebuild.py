"""Step-record digests: records written by earlier releases (blake2b-16, no ``digest_kind``) keep
their digest whatever the codec's framing, so a new owner checks its replay of them; new records
use xxh3-128 and say so."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.codec import decode
from schemas.errors import ContextLost
from schemas.messages import Mode
from workers.digests import BLAKE2B_16, DIGEST_KIND, XXH3_128, output_digest, record_digest_kind
from workers.rebuild import step_record

# output_digest of OUTPUT as the previous release (blake2b-16 over plain msgpack, no frame) computed it.
PREVIOUS_RELEASE_DIGEST = "e7d66c89e031c1859ecb94c770a7e66d"


def _output() -> dict[str, object]:
    return {"video_latent": np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4), "token_ids": [5, 6, 7],
            "meta": {"steps": 3, "name": "w", "state": np.arange(3, dtype=np.int16)}, "logprobs": [-0.5, -1.25]}


def test_a_legacy_digest_of_an_output_is_the_previous_releases() -> None:
    assert output_digest(_output(), BLAKE2B_16).hex() == PREVIOUS_RELEASE_DIGEST


@pytest.mark.parametrize("kind", [XXH3_128, BLAKE2B_16])
def test_digest_sees_a_change_in_a_nested_array(kind: str) -> None:
    changed = _output()
    changed["meta"] = {"steps": 3, "name": "w", "state": np.array([0, 1, 3], dtype=np.int16)}
    assert output_digest(changed, kind) != output_digest(_output(), kind)
    assert len(output_digest(_output(), kind)) == 16


def test_new_records_name_their_digest_and_old_ones_read_as_blake2b() -> None:
    record = decode(step_record(b"payload", _output(), version=0, context_length=1, mode=Mode.WORLD_MODEL_ENV))
    assert record["digest_kind"] == DIGEST_KIND == XXH3_128
    assert record["digest"] == output_digest(_output(), XXH3_128) != output_digest(_output(), BLAKE2B_16)
    del record["digest_kind"]
    assert record_digest_kind(record) == BLAKE2B_16


def test_a_digest_of_an_unknown_kind_is_a_lost_context_not_a_crash() -> None:
    with pytest.raises(ContextLost, match="unknown kind 'sha3-512'"):
        output_digest(_output(), "sha3-512")

"""Step-record digests must not change with the codec's framing: a new owner checks its replay of
records written by workers of the previous release against their digests."""

from __future__ import annotations

import numpy as np

from workers.rebuild import output_digest

# output_digest of OUTPUT as the previous release (plain msgpack codec, no frame) computed it.
PREVIOUS_RELEASE_DIGEST = "e7d66c89e031c1859ecb94c770a7e66d"


def _output() -> dict[str, object]:
    return {"video_latent": np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4), "token_ids": [5, 6, 7],
            "meta": {"steps": 3, "name": "w", "state": np.arange(3, dtype=np.int16)}, "logprobs": [-0.5, -1.25]}


def test_digest_of_an_output_is_the_previous_releases() -> None:
    assert output_digest(_output()).hex() == PREVIOUS_RELEASE_DIGEST


def test_digest_sees_a_change_in_a_nested_array() -> None:
    changed = _output()
    changed["meta"] = {"steps": 3, "name": "w", "state": np.array([0, 1, 3], dtype=np.int16)}
    assert output_digest(changed) != output_digest(_output())

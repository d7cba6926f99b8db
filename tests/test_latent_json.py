"""The vLLM-Omni JSON latent: one encoder and one decoder, with the codec's limits."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.latent_json import ENCODING, decode_latent_json, encode_latent_json
from schemas.limits import Limits


def test_round_trip_keeps_dtype_shape_and_bytes() -> None:
    latent = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    body = encode_latent_json(latent)
    assert body["encoding"] == ENCODING and body["shape"] == [1, 2, 3, 4] and body["dtype"] == "float32"
    assert body["video_latent"] == base64.b64encode(latent.tobytes()).decode()
    out = decode_latent_json(body)
    assert out.dtype == np.float32 and out.tobytes() == latent.tobytes()


def test_big_endian_and_strided_arrays_travel_little_endian() -> None:
    latent = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]
    out = decode_latent_json(encode_latent_json(latent))
    assert np.array_equal(out, latent) and out.dtype == np.dtype("<f4")


def _body(**overrides: Any) -> dict[str, Any]:
    return {**encode_latent_json(np.zeros((2, 3), np.float32)), **overrides}


@pytest.mark.parametrize("body", [
    _body(encoding="string"), _body(encoding=None), _body(video_latent=3), _body(dtype="float99"),
    _body(dtype="object"), _body(shape=[2, -3]), _body(shape=[2, True]), _body(shape=[2, 4]),
    _body(video_latent="not base64!"), {"encoding": ENCODING},
])
def test_malformed_bodies_are_invalid_requests(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        decode_latent_json(body)


def test_limits_are_checked_before_decoding() -> None:
    with pytest.raises(PayloadTooLargeError):
        decode_latent_json(_body(shape=[1 << 30]), Limits(max_array_elements=1 << 20))
    with pytest.raises(PayloadTooLargeError):
        decode_latent_json(_body(), Limits(max_payload_bytes=8))
    with pytest.raises(InvalidRequestError):
        decode_latent_json(_body(shape=[1] * 9 + [6]), Limits())

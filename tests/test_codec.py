from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from schemas.codec import BFloat16Array, decode, encode
from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import Limits


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"])
def test_ndarray_round_trip(dtype: str) -> None:
    arr = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    out = decode(encode({"a": arr}))["a"]
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr)


def test_decode_does_not_copy_the_array_bytes() -> None:
    arr = np.random.default_rng(0).standard_normal((1, 16, 2, 44, 80)).astype(np.float32)
    out = decode(encode(arr))
    assert not out.flags.writeable  # a view on the received buffer, not a copy
    base = out
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, bytes)
    assert out.tobytes() == arr.tobytes()


def test_non_contiguous_and_big_endian_arrays_arrive_equal() -> None:
    arr = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    out = decode(encode(arr))
    assert np.array_equal(out, arr)
    assert out.dtype == np.dtype("<i4")


def test_zero_dim_and_empty_arrays() -> None:
    assert decode(encode(np.float32(2.5))) == 2.5
    assert decode(encode(np.array(3, dtype=np.int64))) == np.array(3)
    empty = decode(encode(np.zeros((0, 3), dtype=np.uint8)))
    assert empty.shape == (0, 3)


def test_bfloat16_tensor_keeps_its_bit_pattern() -> None:
    t = torch.randn(3, 5).to(torch.bfloat16)
    out = decode(encode({"x": t}))["x"]
    assert isinstance(out, BFloat16Array)
    assert torch.equal(out.to_torch(), t)
    assert np.array_equal(out.to_float32(), t.float().numpy())


def test_float_tensor_becomes_ndarray() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = decode(encode(t))
    assert isinstance(out, np.ndarray) and np.array_equal(out, t.numpy())


def test_unsupported_object_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequestError):
        encode({"x": object()})


@pytest.mark.parametrize("data", [b"\xc1", b"\x92\x01", b"\xdd\xff\xff\xff\xff", b"\xa5ab"])
def test_garbage_is_an_invalid_request(data: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        decode(data)


def test_dtype_allow_list() -> None:
    limits = Limits(dtypes=frozenset({"float32"}))
    with pytest.raises(InvalidRequestError, match="not allowed"):
        decode(encode(np.zeros(3, dtype=np.int64)), limits)
    raw = msgpack.packb(msgpack.ExtType(1, b"\x06object\x01" + (1).to_bytes(8, "little") + b"x" * 8))
    with pytest.raises(InvalidRequestError):
        decode(raw)


def test_element_and_byte_limits() -> None:
    with pytest.raises(PayloadTooLargeError):
        decode(encode(np.zeros(100, dtype=np.uint8)), Limits(max_array_elements=10))
    with pytest.raises(PayloadTooLargeError):
        decode(encode(b"x" * 1000), Limits(max_payload_bytes=100))


def test_truncated_array_is_rejected() -> None:
    blob = encode(np.zeros((4, 4), dtype=np.float32))
    ext = msgpack.unpackb(blob, ext_hook=lambda code, data: (code, data))
    bad = msgpack.packb(msgpack.ExtType(ext[0], ext[1][:-3]))
    with pytest.raises(InvalidRequestError, match="byte length"):
        decode(bad)


def test_unknown_ext_type_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="ext type"):
        decode(msgpack.packb(msgpack.ExtType(42, b"abc")))


def test_non_string_map_keys_are_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        decode(msgpack.packb({1: 2}))

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from schemas.codec import (
    ALIGN,
    ARRAY_REF_EXT,
    FRAME_MAGIC,
    FRAME_VERSION,
    NDARRAY_EXT,
    BFloat16Array,
    decode,
    encode,
    encode_plain,
)
from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_DTYPES, Limits

ENCODERS = pytest.mark.parametrize("enc", [encode, encode_plain], ids=["frame", "plain"])
NUMPY_DTYPES = sorted(DEFAULT_DTYPES - {"bfloat16"})
SHAPES = [(), (0,), (3,), (0, 3), (2, 3, 4), (1, 1, 1, 1, 1, 1, 1, 2)]
PREFIX = struct.Struct("<BBHI")


def _array(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.int64) % 7).astype(dtype).reshape(shape)


def _head_len(frame: bytes) -> int:
    return int(PREFIX.unpack_from(frame)[3])


def _refs(frame: bytes) -> list[tuple[int, bytes]]:
    """The ext records of a frame's head, in order."""
    found: list[tuple[int, bytes]] = []
    msgpack.unpackb(frame[PREFIX.size : PREFIX.size + _head_len(frame)],
                    ext_hook=lambda code, data: found.append((code, data)))
    return found


@ENCODERS
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape_round_trips(enc: Callable[..., bytes], dtype: str, shape: tuple[int, ...]) -> None:
    arr = _array(dtype, shape)
    out = decode(enc({"a": arr}))["a"]
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype and out.shape == arr.shape  # a 0-d array stays 0-d
    assert np.array_equal(out, arr)
    assert not out.flags.writeable


def test_frame_starts_with_its_magic_byte_and_version() -> None:
    frame = encode({"x": 1})
    assert frame[0] == FRAME_MAGIC == 0xC1 and frame[1] == FRAME_VERSION == 2
    assert frame[2:4] == b"\0\0"
    assert len(frame) % ALIGN == 0
    assert msgpack.unpackb(frame[PREFIX.size : PREFIX.size + _head_len(frame)]) == {"x": 1}
    assert encode_plain({"x": 1}) == msgpack.packb({"x": 1})  # plain is plain msgpack


def test_decode_does_not_copy_the_array_bytes() -> None:
    arr = np.random.default_rng(0).standard_normal((1, 16, 2, 44, 80)).astype(np.float32)
    frame = encode({"video_latent": arr, "other": np.arange(3, dtype=np.int8)})
    out = decode(frame)["video_latent"]
    assert np.shares_memory(out, np.frombuffer(frame, dtype=np.uint8))  # a view on the received buffer
    assert not out.flags.writeable and out.flags.aligned
    assert np.array_equal(out, arr)


def test_arrays_decoded_from_a_writable_buffer_are_read_only_too() -> None:
    buffer = bytearray(encode(np.arange(6, dtype=np.float32)))
    out = decode(buffer)
    assert np.shares_memory(out, np.frombuffer(buffer, dtype=np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        out[0] = 1.0
    assert np.array_equal(decode(memoryview(buffer)), np.arange(6, dtype=np.float32))


def test_arrays_in_a_frame_are_aligned_and_in_order() -> None:
    parts = [np.arange(3, dtype=np.uint8), np.arange(5, dtype=np.float64), np.zeros(0, np.int32),
             np.arange(2, dtype=np.float16)]
    frame = encode({"parts": parts, "after": "tail"})
    offsets = [struct.unpack("<Q", data[-8:])[0] for code, data in _refs(frame) if code == ARRAY_REF_EXT]
    assert offsets == [0, 16, 64, 64]
    out = decode(frame)
    assert [p.tolist() for p in out["parts"]] == [p.tolist() for p in parts] and out["after"] == "tail"
    assert all(p.ctypes.data % p.dtype.itemsize == 0 for p in out["parts"] if p.size)


@ENCODERS
def test_non_contiguous_and_big_endian_arrays_arrive_equal(enc: Callable[..., bytes]) -> None:
    arr = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    out = decode(enc(arr))
    assert np.array_equal(out, arr)
    assert out.dtype == np.dtype("<i4")
    big = np.arange(6, dtype=">f8").reshape(2, 3).T  # big-endian and Fortran-ordered
    assert np.array_equal(decode(enc(big)), big)


@ENCODERS
def test_scalars_become_python_values(enc: Callable[..., bytes]) -> None:
    assert decode(enc(np.float32(2.5))) == 2.5
    assert decode(enc({"n": np.int64(7), "s": {3, 1}})) == {"n": 7, "s": [1, 3]}


@ENCODERS
def test_bfloat16_tensor_keeps_its_bit_pattern(enc: Callable[..., bytes]) -> None:
    t = torch.randn(3, 5).to(torch.bfloat16)
    out = decode(enc({"x": t}))["x"]
    assert isinstance(out, BFloat16Array)
    assert torch.equal(out.to_torch(), t)
    assert np.array_equal(out.to_float32(), t.float().numpy())
    again = decode(enc(BFloat16Array(out.bits.astype(">u2")[:, ::2])))  # big-endian, strided bits
    assert isinstance(again, BFloat16Array) and np.array_equal(again.bits, out.bits[:, ::2])


def test_float_tensor_becomes_ndarray() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = decode(encode(t))
    assert isinstance(out, np.ndarray) and np.array_equal(out, t.numpy())


@pytest.mark.parametrize("value", [object(), np.array([object()]), np.zeros(2, dtype="U3"),
                                   np.zeros(2, dtype=[("a", "<i4")]), np.zeros(2, dtype="datetime64[s]")],
                         ids=["object", "object-array", "str-array", "structured", "datetime"])
@ENCODERS
def test_unsupported_object_is_an_invalid_request(enc: Callable[..., bytes], value: Any) -> None:
    with pytest.raises(InvalidRequestError, match="cannot encode"):
        enc({"x": value})


@ENCODERS
def test_encoder_refuses_what_the_decoder_would(enc: Callable[..., bytes]) -> None:
    with pytest.raises(PayloadTooLargeError, match="elements"):
        enc(np.zeros(100, dtype=np.uint8), Limits(max_array_elements=10))
    with pytest.raises(InvalidRequestError, match="not allowed"):
        enc(np.zeros(3, dtype=np.uint64), Limits())
    with pytest.raises(InvalidRequestError, match="dimensions"):
        enc(np.zeros((1,) * 9), Limits())


def test_frame_encoder_refuses_an_oversized_payload() -> None:
    with pytest.raises(PayloadTooLargeError, match="payload is"):
        encode(np.zeros(1000, dtype=np.uint8), Limits(max_payload_bytes=512))


@pytest.mark.parametrize("data", [b"\x92\x01", b"\xdd\xff\xff\xff\xff", b"\xa5ab", b"", b"\xc1", b"\xc1\x02\0\0"])
def test_garbage_is_an_invalid_request(data: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        decode(data)


@pytest.mark.parametrize("version", [0, 1, 3, 255])
def test_unknown_frame_version_is_refused(version: int) -> None:
    frame = bytearray(encode({"x": np.arange(4)}))
    frame[1] = version
    with pytest.raises(InvalidRequestError, match=f"unsupported frame version {version}"):
        decode(bytes(frame))


def test_reserved_field_must_be_zero() -> None:
    frame = bytearray(encode({"x": 1}))
    frame[3] = 1
    with pytest.raises(InvalidRequestError, match="reserved"):
        decode(bytes(frame))


def test_truncated_frames_are_refused_at_every_length() -> None:
    frame = encode({"x": np.arange(20, dtype=np.float32), "y": "z"})
    for cut in range(len(frame)):
        with pytest.raises(InvalidRequestError):
            decode(frame[:cut])


def _frame_with_ref(header: bytes, body: bytes, *, code: int = ARRAY_REF_EXT, pad_byte: int = 0) -> bytes:
    head = msgpack.packb({"a": msgpack.ExtType(code, header)})
    pad = -(-(PREFIX.size + len(head)) // ALIGN) * ALIGN - PREFIX.size - len(head)
    return PREFIX.pack(FRAME_MAGIC, FRAME_VERSION, 0, len(head)) + head + bytes([pad_byte]) * pad + body


def test_trailing_bytes_and_bad_padding_are_refused() -> None:
    frame = encode({"x": np.arange(3, dtype=np.uint8), "y": np.arange(2, dtype=np.float64)})
    with pytest.raises(InvalidRequestError, match="after its last array"):
        decode(frame + b"\0" * 8)
    body = -(-(PREFIX.size + _head_len(frame)) // ALIGN) * ALIGN
    bad = bytearray(frame)
    bad[body + 3] = 1  # between the 3 uint8 bytes and the float64s at offset 8
    with pytest.raises(InvalidRequestError, match="padding between arrays"):
        decode(bytes(bad))
    header = _ref(b"uint8", (1,), 0)
    assert _frame_with_ref(header, b"x") != _frame_with_ref(header, b"x", pad_byte=1)  # there is a pad
    assert decode(_frame_with_ref(header, b"x"))["a"].tolist() == [ord("x")]
    with pytest.raises(InvalidRequestError, match="padding after the frame's head"):
        decode(_frame_with_ref(header, b"x", pad_byte=1))


def _ref(tag: bytes, shape: tuple[int, ...], offset: int) -> bytes:
    return bytes([len(tag)]) + tag + bytes([len(shape)]) + struct.pack(f"<{len(shape)}QQ", *shape, offset)


@pytest.mark.parametrize(("header", "match"), [
    (_ref(b"float32", (4,), 8), "offset 8; expected 0"),
    (_ref(b"float32", (5,), 0), "runs past"),
    (_ref(b"float32", (2**40, 2**40), 0), "elements"),  # refused from the header, nothing allocated
    (_ref(b"float32", (2**64 - 1,), 0), "elements"),
    (_ref(b"float32", (1,) * 9, 0), "dimensions"),
    (_ref(b"object", (2,), 0), "not allowed"),
    (_ref(b"float32", (4,), 0) + b"\0", "malformed array reference"),
    (_ref(b"float32", (4,), 0)[:-3], "malformed"),
    (b"\x07float3", "malformed ndarray header"),
    (b"\x02\xff\xfe\x01" + struct.pack("<QQ", 4, 0), "not ascii"),
    (b"\x07float32\x02" + struct.pack("<Q", 4), "shape is cut short"),
    (b"", "malformed ndarray header"),
    (bytes([1]) + b"f" + bytes([200]), "dimensions"),  # ndim checked before the shape is read
])
def test_bad_array_references_are_refused(header: bytes, match: str) -> None:
    with pytest.raises((InvalidRequestError, PayloadTooLargeError), match=match):
        decode(_frame_with_ref(header, np.arange(4, dtype=np.float32).tobytes()))


def test_ext_types_do_not_cross_versions() -> None:
    inline = msgpack.packb(msgpack.ExtType(NDARRAY_EXT, b"\x05uint8\x01" + struct.pack("<Q", 1) + b"x"))
    assert decode(inline).tolist() == [ord("x")]
    with pytest.raises(InvalidRequestError, match="ext type 1 in a frame"):
        decode(_frame_with_ref(b"\x05uint8\x01" + struct.pack("<Q", 1) + b"x", b"", code=NDARRAY_EXT))
    with pytest.raises(InvalidRequestError, match="ext type 2"):
        decode(msgpack.packb(msgpack.ExtType(ARRAY_REF_EXT, _ref(b"uint8", (1,), 0))))


def test_plain_msgpack_of_the_previous_release_still_decodes() -> None:
    # Version 1, byte for byte as the previous release's encode wrote it.
    old = (b"\x82\xa1a\xc7\x21\x01\x07float32\x02" + struct.pack("<2Q", 1, 2)
           + np.array([1.5, -2.0], dtype="<f4").tobytes() + b"\xa1n\x07")
    out = decode(old)
    assert out["n"] == 7 and out["a"].shape == (1, 2) and out["a"].tolist() == [[1.5, -2.0]]
    assert encode_plain({"a": np.array([[1.5, -2.0]], dtype=np.float32), "n": 7}) == old


def test_dtype_allow_list() -> None:
    limits = Limits(dtypes=frozenset({"float32"}))
    for enc in (encode, encode_plain):
        with pytest.raises(InvalidRequestError, match="not allowed"):
            decode(enc(np.zeros(3, dtype=np.int64)), limits)
    raw = msgpack.packb(msgpack.ExtType(1, b"\x06object\x01" + (1).to_bytes(8, "little") + b"x" * 8))
    with pytest.raises(InvalidRequestError):
        decode(raw)


@ENCODERS
def test_element_and_byte_limits(enc: Callable[..., bytes]) -> None:
    with pytest.raises(PayloadTooLargeError):
        decode(enc(np.zeros(100, dtype=np.uint8)), Limits(max_array_elements=10))
    with pytest.raises(PayloadTooLargeError):
        decode(enc(b"x" * 1000), Limits(max_payload_bytes=100))
    with pytest.raises(InvalidRequestError, match="dimensions"):
        decode(enc(np.zeros((1, 1, 1))), Limits(max_array_ndim=2))


def test_truncated_inline_array_is_rejected() -> None:
    blob = encode_plain(np.zeros((4, 4), dtype=np.float32))
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


def test_a_non_contiguous_buffer_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="contiguous"):
        decode(memoryview(encode({"x": 1}) * 2)[::2])


def test_a_header_seen_before_is_still_checked_against_the_limits_of_each_decode() -> None:
    """Decode keeps parsed array headers (schemas.codec._REFS): a header first read under roomy
    limits must still be refused under strict ones, each with the message a first read gives."""
    frame = encode({"a": np.zeros((2, 3, 4), dtype=np.float32)})
    assert decode(frame)["a"].shape == (2, 3, 4)  # now parsed and kept
    strict = [(Limits(max_array_elements=10), PayloadTooLargeError, "24 elements"),
              (Limits(max_array_ndim=2), InvalidRequestError, "3 dimensions"),
              (Limits(dtypes=frozenset({"int8"})), InvalidRequestError, "not allowed")]
    for limits, error, match in strict:
        with pytest.raises(error, match=match):
            decode(frame, limits)
    assert decode(frame)["a"].shape == (2, 3, 4)


def test_arrays_of_one_shape_keep_their_own_dtype_and_place_in_a_frame() -> None:
    """Encode keeps the reference it packed per (dtype, shape, offset): two same-shaped arrays of
    one message, and a bfloat16 where a uint16 of the same bits was, must not share one."""
    bits = np.arange(6, dtype=np.uint16).reshape(2, 3)
    for _ in range(2):  # the second round uses what the first kept
        plain, bf16 = decode(encode({"x": bits})), decode(encode({"x": BFloat16Array(bits)}))
        assert plain["x"].dtype == np.uint16 and plain["x"].tolist() == bits.tolist()
        assert isinstance(bf16["x"], BFloat16Array) and bf16["x"].bits.tolist() == bits.tolist()
        pair = encode({"a": bits, "b": bits + 1})
        assert [data[-8:] for _, data in _refs(pair)] == [struct.pack("<Q", 0), struct.pack("<Q", 16)]
        assert decode(pair)["b"].tolist() == (bits + 1).tolist()


def test_the_kept_array_headers_are_bounded() -> None:
    from schemas import codec

    for n in range(2 * codec._CACHE_BOUND + 5):  # many distinct shapes, as a hostile sender might
        decode(encode(np.zeros((1, n), dtype=np.uint8)))
    assert len(codec._REFS) <= codec._CACHE_BOUND and len(codec._REF_EXTS) <= codec._CACHE_BOUND


@pytest.mark.parametrize("value", [0, -1, 2**63, -(2**63), 2**64 - 1, 1.5, float("inf"), "h\u00e9llo", "", b"\x00\xff",
                                   True, False, None])
def test_a_plain_scalar_is_msgpacks_own_encoding(value: object) -> None:
    assert encode_plain(value) == msgpack.packb(value, use_bin_type=True)
    assert decode(encode_plain(value)) == value


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_an_int_past_64_bits_is_refused_in_the_encoders_words_alone_or_inside(value: int) -> None:
    for obj in (value, [value]):
        with pytest.raises(InvalidRequestError, match="cannot encode int on the wire"):
            encode_plain(obj)

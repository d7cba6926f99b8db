"""The fleet's wire codec: msgpack with numpy arrays carried beside it, never inside it. No pickle.

``encode`` writes a **frame** (version 2); ``decode`` reads a frame or plain msgpack (version 1).

Frame, version 2 (little-endian throughout)::

    u8 0xC1 | u8 version=2 | u16 reserved=0 | u32 head_len | head | zero pad to 16 | body

``0xC1`` is the one byte msgpack never uses, so no plain msgpack message starts with it and the
decoder tells the two apart by the first byte. A frame version is never 0: ``0xC1 0x00`` starts a
stored-result reference instead (broker/redis/blobs.py), which is never decoded as a frame. ``head``
is msgpack of the message with every array replaced by ext type 2, a reference: ``u8 len(dtype) |
dtype ascii | u8 ndim | ndim x u64 shape | u64 offset``. ``body`` holds the arrays' raw
little-endian bytes in the order their references appear in the head, each at the next multiple of
16 from the body's start (zero padding between), so that a decoded array is aligned when the
received buffer is (a bytes object's data is); the frame ends where the last array ends (without
arrays, after the head's padding). Encoding copies each array once (into the frame); decoding copies
it not at all: an array is a read-only view into the received buffer, and keeps the whole buffer
alive while it lives (copy a small array out of a large message to keep it long). A consumer that
changes an array in place copies it first.

Plain msgpack, version 1 (``encode_plain``): ext type 1 holds the header above without the offset
followed by the array's bytes, inside the msgpack. msgpack hands ext data to the hook as new
bytes, so this costs one more copy per array each way. ``decode`` keeps reading it: what a worker
or trainer of the previous release wrote (replies, step records, snapshots in Redis) stays
readable through a rolling upgrade. It stays the interoperable form too: the gateway's
``application/msgpack`` replies are plain msgpack, and step-record digests hash it (a digest must
not change with the framing).

Every decode checks, before it allocates or copies anything for an array: the payload's size,
the frame's version and lengths, each array's dtype (allow-list), number of dimensions and
elements (``schemas.limits``) and that ``shape product x itemsize`` is exactly the bytes it
claims. torch tensors are converted on the CPU; bfloat16 keeps its 16-bit pattern under the dtype
tag ``bfloat16`` and decodes to :class:`BFloat16Array`.
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_LIMITS, Limits

FRAME_MAGIC = 0xC1  # msgpack's "never used" byte: no plain msgpack message starts with it
FRAME_VERSION = 2
NDARRAY_EXT = 1  # version 1: the array's bytes inside the msgpack
ARRAY_REF_EXT = 2  # version 2: a reference to the array's bytes in the frame's body
# Array bytes start at multiples of 16 in the frame: a bytes object's data is 16-aligned, so they
# land 16-aligned, like numpy's own buffers, and encode's copy runs at memcpy speed (8-aligned
# destinations measured 10-20% slower for a 450 KB latent).
ALIGN = 16
_PREFIX = struct.Struct("<BBHI")  # magic, version, reserved, head length
_U64 = struct.Struct("<Q")
_ZEROS = bytes(ALIGN)
_ENCODABLE_KINDS = frozenset("biufc")  # fixed-size numbers; the decoder's allow-list decides further
# Per-call costs matter here: a latent's encode + decode is one copy of ~20 us, so every µs of
# Python is measured (bench/transport.py). Hence the tables below: ``dtype.name`` alone costs
# several µs (numpy computes it in Python), and a precompiled Struct per ndim spares a format.
_MAX_NDIM = 255  # what the u8 ndim carries
_SHAPE = tuple(struct.Struct(f"<{n}Q") for n in range(_MAX_NDIM + 1))
_NDIM_SHAPE = tuple(struct.Struct(f"<B{n}Q") for n in range(65))  # numpy's ndim is at most 64
_NDIM_SHAPE_OFFSET = tuple(struct.Struct(f"<B{n}QQ") for n in range(65))
_KNOWN = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "float32", "float64", "complex64", "complex128")
_TAG_OF: dict[np.dtype[Any], bytes] = {np.dtype(n).newbyteorder("<"): bytes([len(n)]) + n.encode() for n in _KNOWN}
_DTYPE_OF: dict[str, np.dtype[Any]] = {n: np.dtype(n).newbyteorder("<") for n in _KNOWN} | {"bfloat16": np.dtype("<u2")}
_BFLOAT16_TAG = b"\x08bfloat16"
# A fleet sends the same few array shapes step after step, so an array reference's ext (encode) and
# a received reference's parsed header (decode) are kept: a repeat costs a dict lookup instead of
# its packing or parsing, ~1 µs of a 450 KB latent's encode + decode (bench/transport.py). Limits
# are still checked on every decode. Bounded: past the bound a cache starts afresh.
_CACHE_BOUND = 1024
_Ref = tuple[str, np.dtype[Any], tuple[int, ...], int, int, int]  # tag, dtype, shape, elements, bytes, offset
_REF_EXTS: dict[tuple[bytes, tuple[int, ...], int], msgpack.ExtType] = {}
_REFS: dict[bytes, _Ref] = {}


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_BOUND:
        cache.clear()
    cache[key] = value


@dataclass(frozen=True)
class BFloat16Array:
    """bfloat16 data as its raw uint16 bit pattern (numpy has no bfloat16)."""

    bits: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    def to_float32(self) -> np.ndarray:
        """Exact widening: a bfloat16 is the high half of a float32."""
        return (self.bits.astype(np.uint32) << 16).view(np.float32)

    def to_torch(self) -> Any:
        import torch  # lazy: the trainer client installs without torch

        return torch.from_numpy(self.bits.view(np.int16).copy()).view(torch.bfloat16)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BFloat16Array) and np.array_equal(self.bits, other.bits)

    def __hash__(self) -> int:  # pragma: no cover - arrays are not hashed in practice
        return hash(self.bits.tobytes())


# --------------------------------------------------------------------------- encoding


def _torch_to_wire(tensor: Any) -> np.ndarray | BFloat16Array:
    torch = sys.modules["torch"]  # a tensor exists, so torch is imported already
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return BFloat16Array(tensor.view(torch.int16).numpy().view(np.uint16))
    return np.asarray(tensor.numpy())


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _wire_array(arr: np.ndarray) -> np.ndarray:
    """C-contiguous and little-endian: a copy only for inputs that are neither."""
    if arr.dtype.byteorder == ">":
        return arr.astype(arr.dtype.newbyteorder("<"), order="C")
    # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _tag_of(dtype: np.dtype[Any]) -> bytes:
    """``u8 len | name`` of an encodable dtype outside ``_TAG_OF`` (little-endian or byte-order free)."""
    if dtype.kind not in _ENCODABLE_KINDS or dtype.fields is not None:
        raise TypeError(f"cannot encode an array of dtype {dtype} on the wire")
    return bytes([len(dtype.name)]) + dtype.name.encode("ascii")


class _Encoder:
    """msgpack's ``default`` hook. With limits it checks each array's header as the decoder will,
    before its bytes are copied, so a sender refuses an oversized array without shipping it.
    ``framed``: arrays become references and the arrays themselves are collected in ``parts``
    (version 2); otherwise their bytes go inside the msgpack (version 1)."""

    __slots__ = ("end", "framed", "limits", "parts")

    def __init__(self, limits: Limits | None, *, framed: bool) -> None:
        self.limits = limits
        self.framed = framed
        self.parts: list[bytes | memoryview] = []
        self.end = 0  # body bytes so far

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.byteorder == ">" or not obj.flags.c_contiguous:
                obj = _wire_array(obj)
            return self._array(_TAG_OF.get(obj.dtype) or _tag_of(obj.dtype), obj)
        if isinstance(obj, BFloat16Array):
            return self._array(_BFLOAT16_TAG, _wire_array(obj.bits.astype("<u2", copy=False)))
        if _is_torch_tensor(obj):
            return self(_torch_to_wire(obj))
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj)
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")

    def _array(self, tag: bytes, arr: np.ndarray) -> msgpack.ExtType:
        if self.limits is not None:
            check_array_header(tag[1:].decode("ascii"), arr.ndim, arr.shape, self.limits)
        if not self.framed:
            # One copy, into the ext payload; a join takes the array's buffer as it is.
            shape = _NDIM_SHAPE[arr.ndim].pack(arr.ndim, *arr.shape)
            return msgpack.ExtType(NDARRAY_EXT, b"".join([tag, shape, arr.data]))
        offset = -(-self.end // ALIGN) * ALIGN
        if offset > self.end:
            self.parts.append(_ZEROS[: offset - self.end])
        self.parts.append(arr.data)  # not copied yet: the frame's join is its one copy
        self.end = offset + arr.nbytes
        key = (tag, arr.shape, offset)
        ext = _REF_EXTS.get(key)
        if ext is None:
            ext = msgpack.ExtType(ARRAY_REF_EXT, tag + _NDIM_SHAPE_OFFSET[arr.ndim].pack(arr.ndim, *arr.shape, offset))
            _remember(_REF_EXTS, key, ext)
        return ext


def _packb(obj: Any, encoder: _Encoder) -> bytes:
    try:
        return msgpack.packb(obj, default=encoder, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequestError(f"cannot encode payload: {exc}") from exc


def encode(obj: Any, limits: Limits | None = None) -> bytes:
    """Encode as a version-2 frame; raises InvalidRequestError for unsupported objects. With
    ``limits``, what the decoder would refuse under them (an array's dtype, dimensions, elements;
    the payload's bytes) is refused here, before the array bytes are copied."""
    encoder = _Encoder(limits, framed=True)
    head = _packb(obj, encoder)
    start = -(-(_PREFIX.size + len(head)) // ALIGN) * ALIGN
    size = start + encoder.end
    if limits is not None and size > limits.max_payload_bytes:
        raise PayloadTooLargeError(f"payload is {size} bytes; limit is {limits.max_payload_bytes}")
    if len(head) >= 1 << 32:
        raise InvalidRequestError(f"cannot encode payload: its msgpack head is {len(head)} bytes")
    prefix = _PREFIX.pack(FRAME_MAGIC, FRAME_VERSION, 0, len(head))
    return b"".join([prefix, head, _ZEROS[: start - _PREFIX.size - len(head)], *encoder.parts])


def encode_plain(obj: Any, limits: Limits | None = None) -> bytes:
    """Encode as plain msgpack (version 1): for readers that know msgpack and not the frame."""
    if type(obj) in _SCALARS:  # nothing in it for the encoder (arrays) to see: no encoder to make
        try:
            return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
        except OverflowError:  # an int past 64 bits: refused below, in the encoder's words
            pass
    return _packb(obj, _Encoder(limits, framed=False))


_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


# --------------------------------------------------------------------------- decoding


def check_array_header(tag: str, ndim: int, shape: tuple[int, ...], limits: Limits) -> None:
    """An array's dtype and shape against the limits, before its bytes are touched."""
    if tag not in limits.dtypes:
        raise InvalidRequestError(f"dtype {tag!r} is not allowed on the wire")
    if ndim > limits.max_array_ndim:
        raise InvalidRequestError(f"ndarray has {ndim} dimensions; limit is {limits.max_array_ndim}")
    elements = math.prod(shape)
    if elements > limits.max_array_elements:
        raise PayloadTooLargeError(
            f"ndarray has {elements} elements; limit is {limits.max_array_elements}"
        )


def _read_header(data: bytes, limits: Limits) -> tuple[str, np.dtype[Any], tuple[int, ...], int]:
    """``u8 len(dtype) | dtype | u8 ndim | ndim x u64 shape``, checked against the limits; returns
    the dtype tag, the little-endian dtype, the shape and where the header ends."""
    size = len(data)
    if size < 2 or size < 2 + data[0]:
        raise InvalidRequestError("malformed ndarray header")
    tag_len = data[0]
    ndim = data[1 + tag_len]
    if ndim > limits.max_array_ndim:  # before the shape is read
        raise InvalidRequestError(f"ndarray has {ndim} dimensions; limit is {limits.max_array_ndim}")
    end = 2 + tag_len + 8 * ndim
    if size < end:
        raise InvalidRequestError("malformed ndarray header: the shape is cut short")
    try:
        tag = data[1 : 1 + tag_len].decode("ascii")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError("malformed ndarray header: the dtype is not ascii") from exc
    shape = _SHAPE[ndim].unpack_from(data, 2 + tag_len)
    check_array_header(tag, ndim, shape, limits)
    dtype = _DTYPE_OF.get(tag)
    return tag, dtype if dtype is not None else np.dtype(tag).newbyteorder("<"), shape, end


class _InlineArrays:
    """Version 1's ext hook: the array's bytes follow its header inside the ext data."""

    __slots__ = ("limits",)

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def __call__(self, code: int, data: bytes) -> Any:
        if code != NDARRAY_EXT:
            raise InvalidRequestError(f"unknown msgpack ext type {code}")
        tag, dtype, shape, end = _read_header(data, self.limits)
        if len(data) - end != math.prod(shape) * dtype.itemsize:
            raise InvalidRequestError(f"ndarray byte length {len(data) - end} does not match "
                                      f"shape {list(shape)} of {tag}")
        arr = np.ndarray(shape, dtype, data, end)  # read-only: ``data`` is bytes
        return BFloat16Array(arr) if tag == "bfloat16" else arr


class _FrameArrays:
    """Version 2's ext hook: references into the frame's body, which must follow one another."""

    __slots__ = ("end", "frame", "limits", "size", "start")

    def __init__(self, frame: bytes | memoryview, start: int, limits: Limits) -> None:
        self.frame = frame  # read-only, so every array on it is
        self.start = start  # where the body starts in the frame
        self.size = len(frame) - start  # the body's bytes
        self.limits = limits
        self.end = 0  # body bytes claimed so far

    def __call__(self, code: int, data: bytes) -> Any:
        if code != ARRAY_REF_EXT:
            raise InvalidRequestError(f"unknown msgpack ext type {code} in a frame")
        ref = _REFS.get(data)
        if ref is None:
            ref = _parse_ref(data, self.limits)
            _remember(_REFS, data, ref)
        tag, dtype, shape, elements, nbytes, offset = ref
        limits = self.limits  # a cached header was parsed under some limits: check these
        if tag not in limits.dtypes or len(shape) > limits.max_array_ndim or elements > limits.max_array_elements:
            check_array_header(tag, len(shape), shape, limits)  # raises, naming the limit
        if offset != -(-self.end // ALIGN) * ALIGN:
            raise InvalidRequestError(f"array at body offset {offset}; expected {-(-self.end // ALIGN) * ALIGN}")
        stop = offset + nbytes
        if stop > self.size:
            raise InvalidRequestError(f"array of {nbytes} bytes at body offset {offset} runs past "
                                      f"the frame's {self.size} body bytes")
        pad = self.frame[self.start + self.end : self.start + offset] if offset != self.end else b""
        if pad != _ZEROS[: len(pad)]:
            raise InvalidRequestError("non-zero padding between arrays")
        self.end = stop
        arr = np.ndarray(shape, dtype, self.frame, self.start + offset)
        return BFloat16Array(arr) if tag == "bfloat16" else arr


def _parse_ref(data: bytes, limits: Limits) -> _Ref:
    """An array reference's header and offset, checked against ``limits``."""
    tag, dtype, shape, end = _read_header(data, limits)
    if len(data) != end + _U64.size:
        raise InvalidRequestError("malformed array reference")
    (offset,) = _U64.unpack_from(data, end)
    elements = math.prod(shape)
    return tag, dtype, shape, elements, elements * dtype.itemsize, offset


_Buffer = bytes | bytearray | memoryview


def _unpackb(data: _Buffer, limits: Limits, ext_hook: Any) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=ext_hook,
            max_bin_len=limits.max_payload_bytes,
            max_str_len=limits.max_payload_bytes,
            max_ext_len=limits.max_payload_bytes,
            max_array_len=limits.max_container_len,
            max_map_len=limits.max_container_len,
        )
    except (InvalidRequestError, PayloadTooLargeError):
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise InvalidRequestError(f"malformed msgpack payload: {type(exc).__name__}: {exc}") from exc


def _decode_frame(view: bytes | memoryview, limits: Limits) -> Any:
    if len(view) < _PREFIX.size:
        raise InvalidRequestError(f"truncated frame: {len(view)} bytes")
    _, version, reserved, head_len = _PREFIX.unpack_from(view)
    if version != FRAME_VERSION:
        raise InvalidRequestError(f"unsupported frame version {version}; this decoder reads {FRAME_VERSION}")
    if reserved:
        raise InvalidRequestError(f"frame reserved field is {reserved}, not 0")
    head_end = _PREFIX.size + head_len
    start = -(-head_end // ALIGN) * ALIGN
    if start > len(view):
        raise InvalidRequestError(f"truncated frame: head of {head_len} bytes, frame of {len(view)}")
    if start != head_end and view[head_end:start] != _ZEROS[: start - head_end]:
        raise InvalidRequestError("non-zero padding after the frame's head")
    arrays = _FrameArrays(view, start, limits)
    obj = _unpackb(memoryview(view)[_PREFIX.size : head_end], limits, arrays)
    if arrays.end != arrays.size:
        raise InvalidRequestError(f"frame has {arrays.size - arrays.end} bytes after its last array")
    return obj


def _as_buffer(data: _Buffer) -> bytes | memoryview:
    """``data`` itself when it is bytes, else a read-only byte view of it (so that no decoded
    array can write into the caller's buffer)."""
    if type(data) is bytes:
        return data
    try:
        return memoryview(data).cast("B").toreadonly()
    except TypeError as exc:
        raise InvalidRequestError(f"cannot decode {type(data).__name__}: not a contiguous buffer") from exc


def decode(data: _Buffer, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode a frame or plain msgpack under limits; any failure is InvalidRequestError (or
    PayloadTooLargeError). Arrays are read-only; a frame's are views into ``data``."""
    buffer = _as_buffer(data)
    if len(buffer) > limits.max_payload_bytes:
        raise PayloadTooLargeError(f"payload is {len(buffer)} bytes; limit is {limits.max_payload_bytes}")
    if len(buffer) and buffer[0] == FRAME_MAGIC:
        return _decode_frame(buffer, limits)
    return _unpackb(buffer, limits, _InlineArrays(limits))

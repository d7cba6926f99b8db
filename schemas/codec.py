"""msgpack codec with an ndarray extension type. No pickle, ever.

An array travels as ext type 1 whose data is a small header followed by the raw little-endian
bytes: ``u8 len(dtype) | dtype ascii | u8 ndim | ndim x u64 shape | raw``. Decoding wraps the
received buffer with ``np.frombuffer`` (no copy; the array is read-only). torch tensors are
converted on the CPU; bfloat16 keeps its 16-bit pattern under the dtype tag ``bfloat16`` and
decodes to :class:`BFloat16Array`.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_LIMITS, Limits

NDARRAY_EXT = 1
_U8 = struct.Struct("<B")


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


def _torch_to_wire(tensor: Any) -> np.ndarray | BFloat16Array:
    torch = sys.modules["torch"]  # a tensor exists, so torch is imported already
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return BFloat16Array(tensor.view(torch.int16).numpy().view(np.uint16))
    return np.asarray(tensor.numpy())


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _pack_array(dtype_tag: str, arr: np.ndarray) -> msgpack.ExtType:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    tag = dtype_tag.encode("ascii")
    header = _U8.pack(len(tag)) + tag + _U8.pack(arr.ndim) + struct.pack(f"<{arr.ndim}Q", *arr.shape)
    # One copy (into the ext payload), not two: concatenate the array's own buffer.
    raw = arr.reshape(-1).view(np.uint8).data if arr.size else b""
    return msgpack.ExtType(NDARRAY_EXT, header + raw)


class _Encoder:
    """msgpack's ``default`` hook; with limits it checks each array's header as the decoder will,
    before its bytes are copied, so a sender refuses an oversized array without shipping it."""

    def __init__(self, limits: Limits | None) -> None:
        self.limits = limits

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._array(obj.dtype.name, obj)
        if isinstance(obj, BFloat16Array):
            return self._array("bfloat16", obj.bits.astype("<u2", copy=False))
        if _is_torch_tensor(obj):
            return self(_torch_to_wire(obj))
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj)
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")

    def _array(self, dtype_tag: str, arr: np.ndarray) -> msgpack.ExtType:
        if self.limits is not None:
            check_array_header(dtype_tag, arr.ndim, tuple(arr.shape), self.limits)
        return _pack_array(dtype_tag, arr)


def encode(obj: Any, limits: Limits | None = None) -> bytes:
    """Encode to msgpack bytes; raises InvalidRequestError for unsupported objects. With
    ``limits``, an array the decoder would refuse (dtype, dimensions, elements) is refused here."""
    try:
        return msgpack.packb(obj, default=_Encoder(limits), use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequestError(f"cannot encode payload: {exc}") from exc


class _ArrayDecoder:
    """ext_hook bound to one set of limits."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def __call__(self, code: int, data: bytes) -> Any:
        if code != NDARRAY_EXT:
            raise InvalidRequestError(f"unknown msgpack ext type {code}")
        view = memoryview(data)
        try:
            tag_len = view[0]
            tag = bytes(view[1 : 1 + tag_len]).decode("ascii")
            ndim = view[1 + tag_len]
            start = 2 + tag_len
            shape = struct.unpack_from(f"<{ndim}Q", view, start)
        except (IndexError, struct.error, UnicodeDecodeError) as exc:
            raise InvalidRequestError("malformed ndarray header") from exc
        check_array_header(tag, ndim, shape, self.limits)
        dtype = np.dtype("<u2") if tag == "bfloat16" else np.dtype(tag).newbyteorder("<")
        offset = start + 8 * ndim
        count = int(np.prod(shape, dtype=np.int64)) if ndim else 1
        if len(view) - offset != count * dtype.itemsize:
            raise InvalidRequestError(
                f"ndarray byte length {len(view) - offset} does not match shape {list(shape)} of {tag}"
            )
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
        return BFloat16Array(arr) if tag == "bfloat16" else arr


def check_array_header(tag: str, ndim: int, shape: tuple[int, ...], limits: Limits) -> None:
    """An array's dtype and shape against the limits, before its bytes are touched."""
    if tag not in limits.dtypes:
        raise InvalidRequestError(f"dtype {tag!r} is not allowed on the wire")
    if ndim > limits.max_array_ndim:
        raise InvalidRequestError(f"ndarray has {ndim} dimensions; limit is {limits.max_array_ndim}")
    elements = 1
    for dim in shape:
        elements *= dim
    if elements > limits.max_array_elements:
        raise PayloadTooLargeError(
            f"ndarray has {elements} elements; limit is {limits.max_array_elements}"
        )


def decode(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode msgpack bytes under limits; any failure is InvalidRequestError (or PayloadTooLarge)."""
    if len(data) > limits.max_payload_bytes:
        raise PayloadTooLargeError(f"payload is {len(data)} bytes; limit is {limits.max_payload_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_ArrayDecoder(limits),
            max_bin_len=limits.max_payload_bytes,
            max_str_len=limits.max_payload_bytes,
            max_ext_len=limits.max_payload_bytes,
            max_array_len=limits.max_container_len,
            max_map_len=limits.max_container_len,
        )
    except InvalidRequestError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise InvalidRequestError(f"malformed msgpack payload: {type(exc).__name__}: {exc}") from exc

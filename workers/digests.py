"""Output digests: the fingerprint of a step's output kept in its step record, which a new owner
checks its replay against (workers/rebuild.py). Not a security boundary: a replay is compared with
what the same engine produced before, so a fast non-cryptographic hash is enough.

A record names the hash that made its digest (``digest_kind``). New records use xxh3-128: a 450 KB
latent hashes in about 5 µs, where blake2b took 325 µs (a quarter of a latent step's round trip,
docs/benchmarks.md). Records without the field were written by earlier releases with blake2b-16;
they stay checkable, so a session committed before an upgrade rebuilds after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import xxhash

from schemas.codec import encode_plain
from schemas.errors import ContextLost
from workers.continuation import VERSIONS_KEY


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...


XXH3_128 = "xxh3-128"
BLAKE2B_16 = "blake2b-16"  # records without a digest_kind (earlier releases)
DIGEST_KIND = XXH3_128  # what new records get
_HASHERS: dict[str, Callable[[], _Hasher]] = {
    XXH3_128: xxhash.xxh3_128,
    BLAKE2B_16: lambda: hashlib.blake2b(digest_size=16),
}


def output_digest(output: Mapping[str, Any], kind: str = DIGEST_KIND) -> bytes:
    """A fingerprint of a step's output: arrays are hashed in place, so a latent is read once and
    never re-encoded. ``weight_versions`` is left out: the worker adds it to the engine's output,
    and a replay compares the engine's alone."""
    new = _HASHERS.get(kind)
    if new is None:
        raise ContextLost(f"the step record's digest is of an unknown kind {kind!r}; this worker "
                          f"checks {', '.join(sorted(_HASHERS))}")
    h = new()
    for key in sorted(output):
        if key == VERSIONS_KEY:
            continue
        value = output[key]
        h.update(key.encode())
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        else:
            h.update(encode_plain(value))  # not the frame: a digest must survive a change of framing
    return h.digest()


def record_digest_kind(record: Mapping[str, Any]) -> str:
    """The hash that made a step record's digest."""
    kind = record.get("digest_kind", BLAKE2B_16)
    return kind if isinstance(kind, str) else repr(kind)

"""Size limits every decode enforces, so a bad or hostile payload fails cleanly."""

from __future__ import annotations

from dataclasses import dataclass, field

# Step ids are integers in [0, MAX_STEP_ID] end to end. Lua 5.1 numbers are doubles, and the
# scripts compare and add step ids as numbers: every integer up to 2**53 is exact there, so the
# client refuses larger ids and the worker dead-letters an inbox entry that carries one.
MAX_STEP_ID = 2**53 - 1

# numpy dtype names allowed on the wire; "bfloat16" is carried as its raw 16-bit pattern.
DEFAULT_DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
    }
)


@dataclass(frozen=True)
class Limits:
    """Bounds on one message. Defaults fit DreamZero-sized latents with room to spare."""

    max_payload_bytes: int = 64 * 1024 * 1024
    max_array_elements: int = 16 * 1024 * 1024
    max_array_ndim: int = 8
    max_token_ids: int = 1 << 20
    max_images: int = 16
    max_container_len: int = 1 << 20
    dtypes: frozenset[str] = field(default=DEFAULT_DTYPES)

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_array_elements", "max_array_ndim", "max_token_ids"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive")


DEFAULT_LIMITS = Limits()

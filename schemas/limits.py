"""Size limits every decode enforces, so a bad or hostile payload fails cleanly."""

from __future__ import annotations

from dataclasses import dataclass, field

# Step ids are integers in [0, MAX_STEP_ID] = [0, 2**63) end to end. They reach Lua as decimal
# text and the scripts write the id a client sent back as that same text, so every id in range
# round-trips exactly (a stateless step's id is only a label). Lua 5.1 numbers are doubles: the
# scripts' own arithmetic (next_step_id + 1, the retention window) is exact up to
# LUA_EXACT_STEPS, which a session counting from 0 never reaches (2**53 steps); a contextual id
# above the session's next_step_id is refused as out of order, compared as a number, which a
# rounded double still does correctly.
MAX_STEP_ID = 2**63 - 1
LUA_EXACT_STEPS = 2**53 - 1

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

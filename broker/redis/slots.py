"""Which Redis Cluster slot a cell lands in, and cell names that land on distinct masters.

Every key of a cell carries the hash tag ``{cell}`` (:mod:`broker.redis.keys`), so Redis Cluster
hashes only the cell name: the cell's slot is ``CRC16(cell) mod 16384`` (CRC16-CCITT, XMODEM
variant, as Redis's ``keyHashSlot``). Two cells whose slots belong to one master share that
master's CPU; cells meant to spread load should land on distinct masters, which
:func:`cells_on_distinct_masters` picks.
"""

from __future__ import annotations

from collections.abc import Sequence

SLOTS = 16384
_POLY = 0x1021  # CRC16-CCITT: x^16 + x^12 + x^5 + 1, initial value 0, no reflection (XMODEM)


def _table() -> tuple[int, ...]:
    rows = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ _POLY) if crc & 0x8000 else crc << 1
        rows.append(crc & 0xFFFF)
    return tuple(rows)


_TABLE = _table()


def crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM) of ``data``: the checksum Redis Cluster hashes keys with."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _TABLE[((crc >> 8) ^ byte) & 0xFF]
    return crc


def cell_slot(cell: str) -> int:
    """The slot of every key of ``cell`` (the hash tag is the whole cell name)."""
    return crc16(cell.encode()) % SLOTS


SlotRange = tuple[int, int, str]  # first slot, last slot (inclusive), the master owning them


def master_of(slot: int, slot_ranges: Sequence[SlotRange]) -> str | None:
    """The master serving ``slot`` in ``slot_ranges`` (as ``CLUSTER SLOTS`` lists them), or None."""
    for first, last, master in slot_ranges:
        if first <= slot <= last:
            return master
    return None


def cells_on_distinct_masters(slot_ranges: Sequence[SlotRange], count: int, *, stem: str = "c",
                              max_tries: int = 100_000) -> list[str]:
    """``count`` cell names (``stem`` + a number, the lowest numbers that work) whose slots belong
    to ``count`` different masters. Raises ValueError when the ranges name fewer masters than
    ``count``, or when ``max_tries`` names were not enough (slot ranges that cover almost nothing)."""
    masters = {master for _, _, master in slot_ranges}
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if count > len(masters):
        raise ValueError(f"{count} cells on distinct masters need {count} masters; the cluster has {len(masters)}")
    chosen: dict[str, str] = {}  # master -> cell
    for index in range(max_tries):
        name = f"{stem}{index}"
        master = master_of(cell_slot(name), slot_ranges)
        if master is not None and master not in chosen:
            chosen[master] = name
            if len(chosen) == count:
                return list(chosen.values())
    raise ValueError(f"no {count} cell names on distinct masters among the first {max_tries} tried")

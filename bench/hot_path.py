"""Per-call CPU of pieces of the tiny-step path, the library's way beside the fleet's, back to back.

    python -m bench.hot_path

Best of 7 timeit repeats, µs per call: redis-py's Python command packer vs the C packer of
single-node fleet clients (broker.redis.connect.packing_in_c) for the argument lists of an
enqueue and a commit script call; a job id from ``uuid.uuid4()`` vs ``new_id``; ``as_floats`` of
8 floats (the fast path) vs 8 ints (the item-by-item path every list took before). Not in
``run_all``: these are the numbers behind docs/benchmarks.md#cpu-per-tiny-step.
"""

from __future__ import annotations

import timeit
import uuid
from collections.abc import Callable

from redis.asyncio.connection import Connection

from bench.common import Row, module_main
from broker.client.session import new_id
from broker.redis.connect import packing_in_c
from schemas.wire_fields import as_floats

NAME = "hot_path"
SHA = "a" * 40
ENQUEUE = ("EVALSHA", SHA, 4, "rf:{c}:session:" + "s" * 32, "rf:{c}:inbox:w1", "rf:{c}:log:" + "s" * 32,
           "rf:{c}:announced", "w1", 17, "1", "j" * 32, "c" * 32, b"\x82" * 120, "s" * 32, 0, 0)
COMMIT = ("EVALSHA", SHA, 4, "k1" * 10, "k2" * 10, "k3" * 10, "k4" * 10, "w1", 3, 17, "1733-0", b"\x85" * 200, 0,
          "j" * 32, 3600000, "workers", b"\x83" * 120, -1, 268435456, 1048576, 600000, "0", "", "")


def best_us(call: Callable[[], object], number: int = 2000) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


def _pair(case: str, before: Callable[[], object], after: Callable[[], object], what: tuple[str, str]) -> Row:
    old, new = best_us(before), best_us(after)
    return Row(NAME, case, f"{what[0]} vs {what[1]}", {"before_us": old, "after_us": new, "x": old / new})


async def run(size: str) -> list[Row]:
    plain, fast = Connection(), packing_in_c(Connection)()
    packers = ("redis-py packer", "C packer")
    floats, ints = [0.1] * 8, [1] * 8
    return [
        _pair("pack enqueue EVALSHA (16 args)", lambda: plain.pack_command(*ENQUEUE),
              lambda: fast.pack_command(*ENQUEUE), packers),
        _pair("pack commit EVALSHA (24 args)", lambda: plain.pack_command(*COMMIT),
              lambda: fast.pack_command(*COMMIT), packers),
        _pair("job id", lambda: uuid.uuid4().hex, new_id, ("uuid4().hex", "new_id")),
        _pair("as_floats, 8 values", lambda: as_floats(ints, "x"), lambda: as_floats(floats, "x"),
              ("item by item (ints)", "fast path (floats)")),
    ]


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())

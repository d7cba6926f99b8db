"""What each Redis master spends: commands, CPU and network bytes between two INFO snapshots.

The fleet simulation (bench/fleet_sim.py) divides these deltas by the steps its cells ran, so every
figure is per step and per master. Also here: which master serves a cell, from the cell's hash tag
and the cluster's slot map (a small local helper; the library may grow its own later).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.crc import key_slot

# Commands the meter itself sends: left out of the counts, so measuring does not inflate them.
METER_COMMANDS = frozenset({"info", "cluster|slots", "cluster|nodes", "cluster", "ping"})


@dataclass(frozen=True)
class Master:
    """One master of the cluster and the slot ranges it serves."""

    host: str
    port: int
    slots: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    def serves(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


def cell_slot(cell: str) -> int:
    """The slot of every key of ``cell``: keys carry ``{cell}``, so the tag alone decides."""
    return int(key_slot(("{" + cell + "}").encode()))


def cluster_masters(host: str, port: int) -> list[Master]:
    """The masters and their slot ranges, read with CLUSTER SLOTS from any node."""
    with Redis(host=host, port=port, socket_timeout=10) as node:
        ranges: Any = node.execute_command("CLUSTER SLOTS")
    by_node: dict[tuple[str, int], list[tuple[int, int]]] = {}
    # Each entry: [low, high, [master host, port, id], [replica ...], ...].
    for low, high, primary, *_replicas in ranges:
        primary_host, primary_port = primary[0], primary[1]
        if isinstance(primary_host, bytes):
            primary_host = primary_host.decode()
        by_node.setdefault((str(primary_host), int(primary_port)), []).append((int(low), int(high)))
    return sorted((Master(h, p, tuple(sorted(spans))) for (h, p), spans in by_node.items()),
                  key=lambda m: m.slots[0][0])


def master_of(cell: str, masters: Sequence[Master]) -> Master:
    slot = cell_slot(cell)
    for master in masters:
        if master.serves(slot):
            return master
    raise LookupError(f"no master serves slot {slot} of cell {cell!r}")


def cells_on_masters(masters: Sequence[Master], per_master: int, stem: str = "c") -> dict[str, Master]:
    """``per_master`` cell names on every master (``c0``, ``c1``, ... taken in order, each kept if its
    master still needs one), so the cells spread evenly and every master is measured."""
    wanted = {m.name: per_master for m in masters}
    chosen: dict[str, Master] = {}
    for i in range(100_000):  # ~16k slots: a few dozen names per master is enough
        if not any(wanted.values()):
            return chosen
        name = f"{stem}{i}"
        master = master_of(name, masters)
        if wanted[master.name] > 0:
            wanted[master.name] -= 1
            chosen[name] = master
    raise RuntimeError("could not place a cell on every master")


@dataclass
class Snapshot:
    """The counters of one master at one moment (INFO commandstats, cpu, stats)."""

    calls: dict[str, int] = field(default_factory=dict)
    usec: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0  # every thread of redis-server
    main_cpu_s: float = 0.0  # the main thread: the one that runs every command and script
    net_in: int = 0
    net_out: int = 0


def snapshot(master: Master) -> Snapshot:
    with Redis(host=master.host, port=master.port, socket_timeout=10) as node:
        info: Any = node.info("all")
    snap = Snapshot(cpu_s=float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                    net_in=int(info["total_net_input_bytes"]), net_out=int(info["total_net_output_bytes"]))
    # used_cpu_*_main_thread exists since Redis 6.2; older servers fall back to the whole process.
    snap.main_cpu_s = float(info.get("used_cpu_sys_main_thread", info["used_cpu_sys"])) + float(
        info.get("used_cpu_user_main_thread", info["used_cpu_user"]))
    for key, stats in info.items():
        if key.startswith("cmdstat_"):
            command = key.removeprefix("cmdstat_")
            if command not in METER_COMMANDS:
                snap.calls[command] = int(stats["calls"])
                snap.usec[command] = int(stats["usec"])
    return snap


@dataclass(frozen=True)
class Usage:
    """What one master spent between two snapshots."""

    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float
    main_cpu_s: float
    net_in: int
    net_out: int

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def per(self, count: float) -> dict[str, float]:
        """Every counter divided by ``count`` (steps, or worker-seconds for the idle floor)."""
        if count <= 0:
            return {}
        return {"commands": self.total_calls / count, "cpu_us": 1e6 * self.cpu_s / count,
                "main_cpu_us": 1e6 * self.main_cpu_s / count, "cmd_usec": sum(self.usec.values()) / count,
                "net_in_bytes": self.net_in / count, "net_out_bytes": self.net_out / count}

    def minus(self, other: Usage, factor: float = 1.0) -> Usage:
        """This usage less ``factor`` times ``other`` (the idle floor over a window of other length)."""
        return Usage(calls={c: n - round(factor * other.calls.get(c, 0)) for c, n in self.calls.items()},
                     usec={c: n - round(factor * other.usec.get(c, 0)) for c, n in self.usec.items()},
                     cpu_s=self.cpu_s - factor * other.cpu_s, main_cpu_s=self.main_cpu_s - factor * other.main_cpu_s,
                     net_in=self.net_in - round(factor * other.net_in),
                     net_out=self.net_out - round(factor * other.net_out))

    def commands_per(self, count: float) -> dict[str, float]:
        """Calls of each command per ``count``, the busiest first."""
        return _per_command(self.calls, count)

    def usec_per(self, count: float) -> dict[str, float]:
        """Microseconds each command spent per ``count`` (INFO commandstats' usec), the costliest
        first. A script's own figure includes the commands it called, which are also listed."""
        return _per_command(self.usec, count)


def _per_command(counters: Mapping[str, int], count: float) -> dict[str, float]:
    """Each nonzero counter divided by ``count``, the largest first ({} for no count)."""
    if count <= 0:
        return {}
    return {name: n / count for name, n in sorted(counters.items(), key=lambda kv: -kv[1]) if n}


def combined(usages: Iterable[Usage]) -> Usage:
    """Several masters' usage as one (the whole cluster's)."""
    total = Usage({}, {}, 0.0, 0.0, 0, 0)
    for u in usages:
        for c, n in u.calls.items():
            total.calls[c] = total.calls.get(c, 0) + n
        for c, n in u.usec.items():
            total.usec[c] = total.usec.get(c, 0) + n
        total = Usage(total.calls, total.usec, total.cpu_s + u.cpu_s, total.main_cpu_s + u.main_cpu_s,
                      total.net_in + u.net_in, total.net_out + u.net_out)
    return total


def usage(before: Snapshot, after: Snapshot) -> Usage:
    return Usage(calls={c: after.calls[c] - before.calls.get(c, 0) for c in after.calls},
                 usec={c: after.usec[c] - before.usec.get(c, 0) for c in after.usec},
                 cpu_s=after.cpu_s - before.cpu_s, main_cpu_s=after.main_cpu_s - before.main_cpu_s,
                 net_in=after.net_in - before.net_in, net_out=after.net_out - before.net_out)


class ClusterMeter:
    """Snapshots every master at ``start`` and ``stop``; ``usage`` is then per master name."""

    def __init__(self, masters: Sequence[Master]) -> None:
        self.masters = list(masters)
        self._before: dict[str, Snapshot] = {}
        self.used: Mapping[str, Usage] = {}

    def start(self) -> None:
        self._before = {m.name: snapshot(m) for m in self.masters}

    def stop(self) -> None:
        self.used = {m.name: usage(self._before[m.name], snapshot(m)) for m in self.masters}

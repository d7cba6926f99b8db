"""The fleet simulation (bench/fleet_sim.py): its meter, its cell placement, its CLI, and one tiny run.

Benchmarks are not tests: no speed is asserted, only that the figures are there and add up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis
from redis.crc import key_slot

from bench import fleet_sim, fleet_sim_fit
from bench.redis_meter import ClusterMeter, Master, cell_slot, cells_on_masters, master_of
from broker.redis.embedded import running_redis
from broker.redis.keys import CellKeys

THIRDS = [Master("127.0.0.1", 1, ((0, 5460),)), Master("127.0.0.1", 2, ((5461, 10922),)),
          Master("127.0.0.1", 3, ((10923, 16383),))]


def test_cell_slot_is_the_slot_of_every_key_of_the_cell() -> None:
    keys = CellKeys("rf", "c7")
    for key in (keys.workers, keys.session("s1"), keys.reply("client-1")):
        assert key_slot(key.encode()) == cell_slot("c7")


def test_cells_land_evenly_on_every_master() -> None:
    placed = cells_on_masters(THIRDS, per_master=2)
    assert len(placed) == 6
    for master in THIRDS:
        mine = [cell for cell, m in placed.items() if m == master]
        assert len(mine) == 2
        assert all(master.serves(cell_slot(cell)) and master_of(cell, THIRDS) == master for cell in mine)


def test_a_cell_outside_every_range_is_refused() -> None:
    with pytest.raises(LookupError, match="no master serves"):
        master_of("c0", [Master("127.0.0.1", 1, ((cell_slot("c0") + 1, cell_slot("c0") + 1),))])


def test_meter_counts_the_commands_cpu_and_bytes_between_snapshots() -> None:
    with running_redis() as server:
        meter = ClusterMeter(fleet_sim.masters_of(server.url))
        meter.start()
        with Redis(host="127.0.0.1", port=server.port) as client:
            for i in range(7):
                client.set(f"k{i}", b"x" * 1000)
            client.get("k0")
        meter.stop()
        used = meter.used[f"127.0.0.1:{server.port}"]
        assert used.calls["set"] == 7 and used.calls["get"] == 1
        assert "info" not in used.calls  # the meter's own INFO is left out
        assert used.net_in >= 7 * 1000
        assert used.per(7)["commands"] == pytest.approx(8 / 7)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "workers must be positive"),
    (["--latent-bytes", "1001"], "multiple of 4"),
    (["--kinds", "token,video"], "kinds are latent, token"),
    (["--heartbeat-ms", "9000", "--lease-ms", "5000"], "heartbeat_ms must be below lease_ms"),
    (["--io-threads", "0"], "io_threads must be positive"),
    (["--io-threads", "2", "--redis-url", "redis://127.0.0.1:1/0"], "a --redis-url Redis keeps its own"),
])
def test_bad_options_exit_2_with_the_reason(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_sim.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("url, message", [
    ("redis://127.0.0.1:1/0", "cannot read the masters"),  # nothing listens on port 1
    ("http://127.0.0.1:6379", "cannot read the masters"),
])
def test_an_unusable_redis_url_exits_2_before_starting_anything(url: str, message: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_sim.main(["--redis-url", url]) == 2
    assert message in capsys.readouterr().err


def test_a_non_tcp_url_is_refused() -> None:
    with pytest.raises(ValueError, match="TCP URL"):
        fleet_sim.masters_of("unix:///tmp/redis.sock")


@pytest.mark.slow
def test_tiny_simulation_reports_every_master_and_kind(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    latent_bytes = 4 * 4096
    code = fleet_sim.main(["--workers", "6", "--sessions", "24", "--latent-sessions", "6", "--latent-bytes",
                           str(latent_bytes), "--idle-s", "2", "--warmup-s", "1", "--window-s", "2",
                           "--worker-procs", "2", "--trainer-procs", "1", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    masters = {cell["master"] for cell in report["cells"].values()}
    assert len(report["cells"]) == len(masters) == 3  # one cell per master
    for kind in ("token", "latent"):
        k = report[kind]
        assert k["errors"] == 0, k["first_error"]
        assert set(k["masters"]) == masters
        assert all(m["steps"] > 0 for m in k["masters"].values())
        assert k["steps"] == sum(m["steps"] for m in k["masters"].values())
        # every step is enqueued and committed by a script (the calls of one event-loop turn run as
        # one script call, so fewer than two per step), each adding its entry
        assert 0 < k["commands_per_step"]["evalsha"] <= 2.1
        assert k["commands_per_step"]["xadd"] >= 1.9  # an inbox entry and a reply entry
        # where the master's time went, per command: the scripts' own time covers what they called
        assert set(k["usec_per_step"]) <= set(k["commands_per_step"])
        assert k["usec_per_step"]["evalsha"] >= k["usec_per_step"]["xadd"] > 0
        assert k["worker_cpu_us"] > 0 and k["trainer_cpu_us"] > 0
    # each latent goes into Redis (the commit) and out of it (the reply) at least once
    assert report["latent"]["per_step"]["net_in_bytes"] >= 0.9 * latent_bytes  # 0.9: window edges
    assert report["latent"]["per_step"]["net_out_bytes"] >= 0.9 * latent_bytes
    assert report["token"]["per_step"]["net_out_bytes"] < latent_bytes


def _report(workers_per_master: list[int], steps_s: list[float], floor: float, per_worker: float,
            per_step: float) -> dict[str, object]:
    """A report whose masters were busy exactly ``floor + per_worker*w + per_step*r`` (seconds/s)."""
    names = [f"127.0.0.1:{i}" for i in range(len(workers_per_master))]
    busy = [floor + per_worker * w for w in workers_per_master]
    return {
        "cells": {f"c{i}": {"master": n, "workers": w}
                  for i, (n, w) in enumerate(zip(names, workers_per_master, strict=True))},
        "idle": {"per_master_s": {n: {"main_cpu_us": 1e6 * b} for n, b in zip(names, busy, strict=True)}},
        "token": {"seconds": 10.0, "per_step": {"net_in_bytes": 2000.0, "net_out_bytes": 1000.0}, "masters": {
            n: {"steps": int(10 * r), "per_step": {"main_cpu_us": 1e6 * (b + per_step * r) / r}}
            for n, b, r in zip(names, busy, steps_s, strict=True)}},
    }


def test_fit_recovers_the_floor_the_worker_and_the_step_cost(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    reports = [_report([20, 20, 20], [200.0, 150.0, 100.0], 0.003, 30e-6, 150e-6),
               _report([100, 100, 100], [300.0, 250.0, 50.0], 0.003, 30e-6, 150e-6)]
    fit = fleet_sim_fit.fit(reports, "token")
    assert fit.floor_s == pytest.approx(0.003, rel=1e-6)
    assert fit.per_worker_s == pytest.approx(30e-6, rel=1e-6)
    assert fit.per_step_s == pytest.approx(150e-6, rel=1e-6)
    assert fit.bytes_per_step == pytest.approx(3000.0)
    # 80% of a core, less the floor and 100 workers, at 150 µs a step
    assert fit.master_rate(0.8, 100) == pytest.approx((0.8 - 0.003 - 0.003) / 150e-6)
    assert fit.masters_for(10_000.0, 1000, 0.8) == 2  # (0.03 + 1.5) / 0.797 -> 2
    paths = []
    for i, report in enumerate(reports):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(report), encoding="utf-8")
    assert fleet_sim_fit.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "| token | 3,000 | 30.0 | 150 |" in out  # floor µs/s, per worker µs/s, per step µs
    # 10,000 GPUs at 1 step/s: (10,000 x 30 µs + 10,000 x 150 µs) / (0.8 - 0.003) -> 3 masters
    assert "| token | 1 | 10,000 | 3 | 1 | 3 |" in out


def test_fit_refuses_a_missing_report_or_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_sim_fit.main([str(tmp_path / "absent.json")]) == 2
    assert "absent.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no report has a latent window"):
        fleet_sim_fit.fit([_report([10], [10.0], 0.0, 1e-6, 1e-4)], "latent")

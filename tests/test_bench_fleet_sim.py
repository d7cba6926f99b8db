"""The fleet simulation (bench/fleet_sim.py): its meter, its cell placement, its CLI, and one tiny run.

Benchmarks are not tests: no speed is asserted, only that the figures are there and add up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis
from redis.crc import key_slot

from bench import fleet_sim
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
    (["--kinds", "token,video"], "kinds are token, latent"),
    (["--heartbeat-ms", "9000", "--lease-ms", "5000"], "heartbeat_ms must be below lease_ms"),
])
def test_bad_options_exit_2_with_the_reason(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_sim.main(argv) == 2
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
        # every step enqueues and commits through a script
        assert k["commands_per_step"]["evalsha"] >= 1.5
        assert k["worker_cpu_us"] > 0 and k["trainer_cpu_us"] > 0
    # each latent goes into Redis (the commit) and out of it (the reply) at least once
    assert report["latent"]["per_step"]["net_in_bytes"] >= 0.9 * latent_bytes  # 0.9: window edges
    assert report["latent"]["per_step"]["net_out_bytes"] >= 0.9 * latent_bytes
    assert report["token"]["per_step"]["net_out_bytes"] < latent_bytes

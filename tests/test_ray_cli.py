"""``rollout-fleet ray`` without a Ray cluster: its mistakes are one line and exit 2, checked before
anything connects; without Ray installed, the verb names the extra that installs it. (The verbs
against a real Ray cluster: tests/ray/, the Ray tier.)"""

from __future__ import annotations

import importlib.util

import pytest

from broker.redis.config import CellConfig
from broker.redis.embedded import free_port
from cli.main import main
from workers.ray_fleet import FleetSpec, Placement, worker_env
from workers.ray_fleet.spec import check_name, node_advertise, parse_worker_name, worker_name

HAS_RAY = importlib.util.find_spec("ray") is not None
ENV = {"ROLLOUT_FLEET_REDIS_URL": "redis://:hunter2@127.0.0.1:1/0"}


@pytest.mark.parametrize(("argv", "says"), [
    (["ray", "up"], "ray up needs --workers N"),
    (["ray", "scale"], "ray scale needs --workers N"),
    (["ray", "up", "--workers", "2", "--cell", "*"], "--cell '*'"),
    (["ray", "up", "--workers", "2", "--engine-opt", "x"], "--engine-opt expects KEY=VALUE, got 'x'"),
    (["ray", "up", "--workers", "2", "--worker-env", "NOT_SET_HERE"], "--worker-env: NOT_SET_HERE not set"),
    (["ray", "up", "--workers", "1", "--num-cpus", "0"], "a worker needs some CPUs or GPUs"),
    (["ray", "status", "--name", "no spaces"], "--name: fleet name 'no spaces'"),
    (["ray", "up", "--max-workers", "3"], "autoscaling needs both --min-workers and --max-workers"),
    (["ray", "up", "--min-workers", "3", "--max-workers", "2"], "0 <= min_workers <= max_workers"),
    (["ray", "up", "--min-workers", "1", "--max-workers", "2", "--target-fill", "1.5"], "target_fill 1.5"),
])
def test_mistakes_are_one_line_before_anything_connects(argv: list[str], says: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv, ENV) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert "hunter2" not in err


def test_an_address_nothing_answers_at_is_one_line_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there; Ray itself would retry for minutes
    assert main(["ray", "status", "--address", f"127.0.0.1:{port}"], ENV) == 2
    err = capsys.readouterr().err
    assert f"ray status: no Ray cluster answers at 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["ray", "up", "--workers", "-1"], ["ray", "up", "--num-gpus", "-1"],
                                  ["ray", "up", "--placement", "random"], ["ray", "up", "--serve-results", "7070"]])
def test_bad_values_are_refused_by_the_parser(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv, ENV)
    assert exit_.value.code == 2


@pytest.mark.skipif(HAS_RAY, reason="Ray is installed here")
def test_without_ray_the_verb_names_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ray", "status"], ENV) == 2
    assert "the ray verb needs ray: install rollout-fleet[ray]" in capsys.readouterr().err


def test_the_workers_environment_carries_the_cell_and_the_engine() -> None:
    cell = CellConfig(redis_url="redis://:pw@10.0.0.1:6379/0", prefix="p1", cell="c2", lease_ms=4000)
    env = worker_env(cell, "reference", engine_options={"seed": 3, "name": "a b"}, drain_timeout_s=12.5, gpu=True,
                     extra={"HF_TOKEN": "t"})
    assert env == {"ROLLOUT_FLEET_REDIS_URL": "redis://:pw@10.0.0.1:6379/0", "ROLLOUT_FLEET_PREFIX": "p1",
                   "ROLLOUT_FLEET_CELL": "c2", "ROLLOUT_FLEET_LEASE_MS": "4000", "ROLLOUT_FLEET_ENGINE": "reference",
                   "ROLLOUT_FLEET_ENGINE_OPT": "seed=3 'name=a b'", "ROLLOUT_FLEET_DRAIN_TIMEOUT_S": "12.5",
                   "ROLLOUT_FLEET_DEVICE": "cuda", "HF_TOKEN": "t"}
    # The worker verb reads these variables back as the flags they stand for.
    from cli.main import parse_invocation

    run = parse_invocation(["worker"], env)
    assert run.cell == cell and run.args.engine == "reference" and run.args.device == "cuda"
    assert run.args.engine_opt == ["seed=3", "name=a b"] and run.args.drain_timeout_s == 12.5


def test_workers_on_ray_serve_results_at_their_nodes_address() -> None:
    """``ray up --serve-results 0.0.0.0:0``: every worker listens on a free port of its node and
    advertises the node's address with it (workers/ray_fleet/actor.py applies node_advertise)."""
    from cli.main import parse_invocation

    up = parse_invocation(["ray", "up", "--workers", "2", "--serve-results", "0.0.0.0:0"], ENV)
    env = worker_env(up.cell, "null", serve_results=up.args.serve_results)
    assert env["ROLLOUT_FLEET_SERVE_RESULTS"] == "0.0.0.0:0"
    on_node = {**env, **node_advertise(env, "10.0.3.7")}
    worker = parse_invocation(["worker"], on_node).args
    assert (worker.serve_results, worker.results_advertise) == ("0.0.0.0:0", "10.0.3.7")
    assert node_advertise(env, "fd00::7") == {"ROLLOUT_FLEET_RESULTS_ADVERTISE": "[fd00::7]"}
    # what the worker was told stands: an address of its own, or an advertise given with --worker-env
    assert node_advertise({**env, "ROLLOUT_FLEET_RESULTS_ADVERTISE": "lb.example"}, "10.0.3.7") == {}
    assert node_advertise({**env, "ROLLOUT_FLEET_SERVE_RESULTS": "10.0.3.7:7070"}, "10.0.3.7") == {}
    assert node_advertise(worker_env(up.cell, "null"), "10.0.3.7") == {}  # not serving: nothing
    # a bad address (from --worker-env) is the worker's to refuse, in its log: the actor still starts it
    assert node_advertise({**env, "ROLLOUT_FLEET_SERVE_RESULTS": "7070"}, "10.0.3.7") == {}
    assert "ROLLOUT_FLEET_SERVE_RESULTS" not in worker_env(up.cell, "null")
    with pytest.raises(ValueError, match="HOST:PORT"):
        worker_env(up.cell, "null", serve_results="7070")


def test_the_spec_crosses_into_ray_as_plain_values() -> None:
    spec = FleetSpec(worker_env={"ROLLOUT_FLEET_ENGINE": "null"}, num_gpus=1, placement="spread")  # type: ignore[arg-type]
    assert spec.placement is Placement.SPREAD and spec.bundle() == {"CPU": 1.0, "GPU": 1}
    assert FleetSpec.from_plain(spec.plain()) == spec
    assert FleetSpec(num_gpus=1, num_cpus=0).bundle() == {"GPU": 1}  # Ray refuses zero amounts
    with pytest.raises(ValueError, match="not variable names"):
        FleetSpec(worker_env={"A B": "x"})


def test_the_autoscaler_wants_the_workers_its_sessions_fill_to_the_target() -> None:
    from workers.ray_fleet import Autoscale

    policy = Autoscale(min_workers=1, max_workers=4, target_fill=0.5)
    assert [policy.wanted(sessions, 4) for sessions in (0, 2, 3, 4, 8, 9, 100)] == [1, 1, 2, 2, 4, 4, 4]
    assert policy.wanted(7, 0) == 1  # no live worker to measure: the floor
    spec = FleetSpec(autoscale=policy)
    assert FleetSpec.from_plain(spec.plain()) == spec


def test_names_of_the_ray_objects_round_trip() -> None:
    assert parse_worker_name("f", worker_name("f", 2, 1, 7)) == (2, 1, 7)
    assert parse_worker_name("f", worker_name("f2", 2, 1, 7)) is None  # another fleet's
    with pytest.raises(ValueError):
        check_name("a:b")

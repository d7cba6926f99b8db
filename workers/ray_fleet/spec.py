"""What a Ray fleet is made of: the spec every worker actor is placed with, the names of its Ray
objects, and the environment its workers get.

Everything that crosses into Ray is plain (strings, numbers, dicts of them): Ray carries actor
arguments through its own serializer, and none of the fleet's own classes travel that way.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from broker.redis.config import ENV_VARS, CellConfig
from schemas.results_wire import WILDCARD_HOSTS, parse_address
from workers.ray_fleet.autoscale import Autoscale

NAMESPACE = "rollout-fleet"  # every fleet's Ray actors live here, whatever namespace their driver has
DEFAULT_NAME = "rollout-fleet"
ENV_PREFIX = "ROLLOUT_FLEET_"
SERVE_RESULTS_VAR = ENV_PREFIX + "SERVE_RESULTS"  # the worker's --serve-results (cli.env: its dest's variable)
RESULTS_ADVERTISE_VAR = ENV_PREFIX + "RESULTS_ADVERTISE"
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Placement(StrEnum):
    """How the bundles of one placement group spread over the Ray cluster's nodes."""

    PACK = "pack"  # as few nodes as fit (Ray's PACK)
    SPREAD = "spread"  # as many nodes as there are workers, best effort (Ray's SPREAD)

    @property
    def ray_strategy(self) -> str:
        return self.value.upper()


@dataclass(frozen=True)
class FleetSpec:
    """How each worker actor is placed and started. ``worker_env`` holds every ``ROLLOUT_FLEET_*``
    variable of the worker process (the Redis URL with its password among them) and any other
    variable it needs (a token): it reaches the worker through its environment, never its argv."""

    worker_env: Mapping[str, str] = field(default_factory=dict)
    num_gpus: float = 0.0  # per worker, reserved through its placement group bundle; 0: CPU only
    num_cpus: float = 1.0  # per worker
    placement: Placement = Placement.PACK
    drain_timeout_s: float = 30.0  # the worker's own drain bound (its --drain-timeout)
    max_restarts: int = -1  # Ray restarts a dead worker actor this often; -1: always
    place_timeout_s: float = 300.0  # a placement group not placed within this is given back
    autoscale: Autoscale | None = None  # None: the count changes only by scale

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement(self.placement))  # "pack" is accepted as Placement.PACK
        if self.num_gpus < 0 or self.num_cpus < 0 or self.num_gpus + self.num_cpus <= 0:
            raise ValueError(f"a worker needs some CPUs or GPUs, got num_cpus={self.num_cpus} "
                             f"num_gpus={self.num_gpus}")
        if self.drain_timeout_s <= 0 or self.place_timeout_s <= 0:
            raise ValueError("drain_timeout_s and place_timeout_s must be positive")
        bad = [name for name in self.worker_env if not _VARIABLE.match(name)]
        if bad:
            raise ValueError(f"worker_env: not variable names: {', '.join(sorted(bad))}")

    def bundle(self) -> dict[str, float]:
        """One worker's placement group bundle (zero amounts left out: Ray refuses them)."""
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus}
        return {resource: amount for resource, amount in wanted.items() if amount > 0}

    @property
    def engine(self) -> str:
        return self.worker_env.get(ENV_PREFIX + "ENGINE", "reference")

    def plain(self) -> dict[str, Any]:
        values = asdict(self)
        values["worker_env"] = dict(self.worker_env)
        values["placement"] = self.placement.value
        return values

    @classmethod
    def from_plain(cls, values: Mapping[str, Any]) -> FleetSpec:
        autoscale = values.get("autoscale")
        return cls(**{**values, "autoscale": None if autoscale is None else Autoscale(**autoscale)})


def worker_env(cell: CellConfig, engine: str, *, engine_options: Mapping[str, Any] | Sequence[str] = (),
               drain_timeout_s: float | None = None, gpu: bool = False, serve_results: str | None = None,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``ROLLOUT_FLEET_*`` variables of a worker of ``cell`` running ``engine``.

    ``engine_options``: a mapping (non-strings JSON-encoded, as the CLI parses them) or ``KEY=VALUE``
    strings as ``--engine-opt`` takes them. ``gpu``: the reference engines run on ``cuda``.
    ``serve_results``: the worker's ``--serve-results HOST:PORT`` (large results in one hop;
    ``0.0.0.0:0`` on Ray: each worker a free port, advertised at its node's address, see
    :func:`node_advertise`). ``extra``: any other worker variable (``ROLLOUT_FLEET_CAPACITY``...),
    applied last."""
    env = {ENV_VARS[name]: str(getattr(cell, name)) for name in ENV_VARS}
    env[ENV_PREFIX + "ENGINE"] = engine
    pairs = list(engine_options) if not isinstance(engine_options, Mapping) else [
        f"{key}={value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}"
        for key, value in engine_options.items()]
    if pairs:
        env[ENV_PREFIX + "ENGINE_OPT"] = " ".join(shlex.quote(pair) for pair in pairs)
    if drain_timeout_s is not None:
        env[ENV_PREFIX + "DRAIN_TIMEOUT_S"] = str(drain_timeout_s)
    if gpu and engine == "reference":
        env[ENV_PREFIX + "DEVICE"] = "cuda"
    if serve_results is not None:
        parse_address(serve_results)  # a bad one fails here, not in every worker of the fleet
        env[SERVE_RESULTS_VAR] = serve_results
    return {**env, **(extra or {})}


def node_advertise(env: Mapping[str, str], node_ip: str) -> dict[str, str]:
    """The variable a worker started with ``env`` on the node at ``node_ip`` also gets: a worker
    that serves results on every address of its node (``--serve-results 0.0.0.0:PORT``) and was
    given no ``--results-advertise`` advertises the node's address, with the port it listens on
    (several workers of one node listen on port 0, a free port each). Nothing otherwise."""
    listen = env.get(SERVE_RESULTS_VAR)
    if not listen or env.get(RESULTS_ADVERTISE_VAR):
        return {}
    try:
        host = parse_address(listen)[0]
    except ValueError:  # the worker refuses it with a line of its own, in its log
        return {}
    return {RESULTS_ADVERTISE_VAR: f"[{node_ip}]" if ":" in node_ip else node_ip} if host in WILDCARD_HOSTS else {}


def check_name(name: str) -> str:
    """A fleet name: it prefixes the names of its Ray actors and placement groups."""
    if not _NAME.match(name):
        raise ValueError(f"fleet name {name!r}: 1-63 letters, digits, '.', '_' or '-', starting with a letter "
                         "or digit")
    return name


def group_name(fleet: str, group: int) -> str:
    return f"{fleet}:g{group}"


def worker_name(fleet: str, group: int, bundle: int, index: int) -> str:
    """The Ray name of worker ``index``, in bundle ``bundle`` of placement group ``group``."""
    return f"{fleet}:g{group}:b{bundle}:w{index}"


def parse_worker_name(fleet: str, name: str) -> tuple[int, int, int] | None:
    """(group, bundle, index) of one of ``fleet``'s worker actors, else None."""
    found = re.fullmatch(re.escape(fleet) + r":g(\d+):b(\d+):w(\d+)", name)
    return None if found is None else (int(found[1]), int(found[2]), int(found[3]))


def parse_group_name(fleet: str, name: str) -> int | None:
    found = re.fullmatch(re.escape(fleet) + r":g(\d+)", name)
    return None if found is None else int(found[1])

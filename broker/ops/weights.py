"""The cell's control stream: tell the workers of a model to update weights to a version."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.cells import cells_of
from broker.redis.config import CellConfig
from broker.redis.connect import server_time_ms
from broker.redis.keys import CellKeys
from broker.redis.scripts import Scripts

CONTROL_MAXLEN = 1000


IN_FLIGHT = ("finish", "abort", "continue")


@dataclass(frozen=True)
class WeightUpdate:
    """``in_flight``: what happens to steps running when the update arrives. ``finish`` (default):
    they finish on the old weights and report the old version. ``abort``: the engine stops them and
    they run again, whole, on the new weights (engines that cannot abort let them finish).
    ``continue``: as ``abort``, but a token step keeps the tokens it generated and continues from
    them on the new weights (a partial rollout; its result gives each token's version in
    ``weight_versions``); a world-model step runs again, whole."""

    model: str
    version: int
    path: str
    in_flight: str = "finish"

    @property
    def abort(self) -> bool:
        return self.in_flight in ("abort", "continue")

    @property
    def keep_partial(self) -> bool:
        return self.in_flight == "continue"

    def fields(self) -> dict[str, str]:
        return {"kind": "update_weights", "model": self.model, "version": str(self.version), "path": self.path,
                "in_flight": self.in_flight}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> WeightUpdate | None:
        if fields.get(b"kind") != b"update_weights":
            return None
        try:
            in_flight = fields.get(b"in_flight", b"finish").decode()
            if in_flight not in IN_FLIGHT:
                return None
            return cls(fields[b"model"].decode(), int(fields[b"version"]), fields[b"path"].decode(), in_flight)
        except (KeyError, ValueError, UnicodeDecodeError):
            return None


async def update_weights(redis: Redis, keys: CellKeys, *, model: str, version: int, path: str,
                         in_flight: str = "finish") -> str:
    """Ask every worker serving ``model`` (now or later) to load ``path`` as policy ``version``;
    ``in_flight="abort"`` aborts the steps running then (they run again on the new weights);
    ``in_flight="continue"`` aborts them too, and token steps continue from their generated tokens.
    The cell's announced version of ``model`` rises to ``version`` with it (docs/async_rl.md)."""
    if version <= 0:
        raise ValueError("policy versions start at 1")
    if in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
    update = WeightUpdate(model, version, path, in_flight)
    # The entry and the model's announced version (what max_staleness and admission read) move together.
    return await Scripts(redis, keys, coalesce=False).announce(update.fields(), model=model, version=version,
                                                               maxlen=CONTROL_MAXLEN)


class WeightUpdateFailed(RuntimeError):
    """A worker serving the model says the update to the awaited version failed."""


def weights_error_prefix(model: str, version: int) -> str:
    """How a worker's ``weights_error`` registry field starts for a failed update."""
    return f"{model} version {version}:"


def model_version(fields: list[bytes | None], model: str) -> int:
    """A worker's version of ``model`` from its (policy_versions, policy_version) registry fields:
    the per-model one where the worker publishes it, else the engine-wide one (older workers)."""
    per_model, overall = fields
    if per_model:
        try:
            versions = json.loads(per_model)
            if isinstance(versions, dict) and isinstance(versions.get(model), int):
                return int(versions[model])
        except ValueError:
            pass
    return int(overall or 0)


async def live_models(redis: Redis, keys: CellKeys, *, lease_ms: int) -> dict[str, list[str]]:
    """The models of the workers whose heartbeat is younger than ``lease_ms``: model -> worker ids."""
    since = await server_time_ms(redis, keys.workers) - lease_ms
    ids: Any = await redis.zrangebyscore(keys.workers, since, "+inf")
    served: dict[str, list[str]] = {}
    for raw in ids:
        wid = raw.decode()
        models: Any = await resolve(redis.hget(keys.worker(wid), "models"))
        for model in (models or b"").decode().split(","):
            if model:
                served.setdefault(model, []).append(wid)
    return served


async def workers_at_version(redis: Redis, keys: CellKeys, *, model: str, version: int,
                             timeout: float = 60.0) -> list[str]:
    """Wait until every registered worker serving ``model`` reports ``version`` of it; their ids.
    WeightUpdateFailed at once when one of them says the update to ``version`` failed."""
    deadline = time.monotonic() + timeout
    failed_prefix = weights_error_prefix(model, version)
    while True:
        ids: Any = await redis.zrange(keys.workers, 0, -1)
        serving = []
        for raw in ids:
            wid = raw.decode()
            fields: Any = await resolve(redis.hmget(keys.worker(wid), ["models", "policy_versions",
                                                                      "policy_version", "weights_error"]))
            if fields[0] is None or model not in fields[0].decode().split(","):
                continue
            current = model_version(fields[1:3], model)
            error = (fields[3] or b"").decode(errors="replace")
            if current < version and error.startswith(failed_prefix):
                raise WeightUpdateFailed(f"worker {wid}: {error}")
            serving.append((wid, current))
        if serving and all(v >= version for _, v in serving):
            return [w for w, _ in serving]
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers of {model} did not reach policy version {version}: {serving}")
        await asyncio.sleep(0.05)


async def update_weights_in_cells(redis: Redis, config: CellConfig, *, model: str, version: int, path: str,
                                  in_flight: str = "finish", allow_unserved: bool = False,
                                  wait_s: float | None = None, say: Callable[[str], None] = print) -> list[str]:
    """``update-weights`` in ``config``'s cell, or with cell ``*`` in every known cell: announce
    the version in each (a worker started there later loads it), then with ``wait_s`` wait until
    the live workers of ``model`` in every cell that serves it report it (one bound for all).
    ValueError when no live worker serves the model and ``allow_unserved`` is not set. Returns
    the workers that reached the version (with ``wait_s``)."""
    cells = [config.in_cell(cell).keys for cell in await cells_of(redis, config)]
    served = {keys.cell: await live_models(redis, keys, lease_ms=config.lease_ms) for keys in cells}
    serving = [keys for keys in cells if model in served[keys.cell]]
    if not serving and not allow_unserved:
        names = sorted({name for models in served.values() for name in models})
        raise ValueError(f"no live worker serves model {model!r} (live workers serve: "
                         f"{', '.join(names) or 'nothing'}; --allow-unserved announces it anyway)")
    for keys in cells:
        entry = await update_weights(redis, keys, model=model, version=version, path=path, in_flight=in_flight)
        say(f"announced {model} version {version} ({entry})" + (f" in cell {keys.cell}" if config.any_cell else ""))
    done: list[str] = []
    if wait_s:
        deadline = time.monotonic() + wait_s
        for keys in serving:
            done += await workers_at_version(redis, keys, model=model, version=version,
                                             timeout=max(0.0, deadline - time.monotonic()))
        say(f"{len(done)} workers serve version {version}")
    return done

"""The one owner of a cell's configuration: which Redis, which key prefix, which cell, which lease.

Workers, the supervisor, the trainer clients, status, the gateway and the demo all take a
:class:`CellConfig`; its defaults are written here and nowhere else. Nothing reads the environment
on import: :meth:`CellConfig.from_env` reads it when called (the CLI does, once, at the edge).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from broker.redis.connect import URL_SCHEMES, RedisURLError, is_cluster_url, parse_cluster_url, redacted
from broker.redis.keys import ANY_CELL, CellKeys, DeploymentKeys

DEFAULT_URL = "redis://127.0.0.1:6379/0"

# Setting -> the environment variable that may set it.
ENV_VARS: Mapping[str, str] = {
    "redis_url": "ROLLOUT_FLEET_REDIS_URL",
    "prefix": "ROLLOUT_FLEET_PREFIX",
    "cell": "ROLLOUT_FLEET_CELL",
    "lease_ms": "ROLLOUT_FLEET_LEASE_MS",
}


class ConfigError(ValueError):
    """A configuration value was refused; the message names the setting and the value."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


@dataclass(frozen=True)
class CellConfig:
    redis_url: str = DEFAULT_URL
    prefix: str = "rf"
    # The hash tag every key of the cell shares; "*" (ANY_CELL): every cell of the deployment, for
    # clients and ops commands (a worker joins exactly one cell).
    cell: str = "0"
    # A worker whose heartbeat is older than this is failed over; the workers, the supervisor and
    # the clients of one cell must agree on it.
    lease_ms: int = 5000

    def __post_init__(self) -> None:
        if not isinstance(self.redis_url, str) or not self.redis_url.startswith(URL_SCHEMES):
            raise ConfigError("redis_url", f"expected a {', '.join(URL_SCHEMES)} URL, got {_shown(self.redis_url)!r}")
        if is_cluster_url(self.redis_url):
            try:  # its node list and settings, checked before anything connects
                parse_cluster_url(self.redis_url)
            except RedisURLError as exc:
                raise ConfigError("redis_url", str(exc)) from None
        for setting in ("prefix", "cell"):
            if setting == "cell" and self.cell == ANY_CELL:
                continue
            try:
                CellKeys(**{setting: getattr(self, setting)})  # keys.py owns what a key part may hold
            except (ValueError, TypeError) as exc:
                raise ConfigError(setting, str(exc)) from None
        if isinstance(self.lease_ms, bool) or not isinstance(self.lease_ms, int) or self.lease_ms <= 0:
            raise ConfigError("lease_ms", f"expected a positive number of milliseconds, got {self.lease_ms!r}")

    @property
    def any_cell(self) -> bool:
        """True when this configuration names every cell rather than one."""
        return self.cell == ANY_CELL

    @property
    def keys(self) -> CellKeys:
        if self.any_cell:
            raise ConfigError("cell", f"{ANY_CELL!r} means every cell; this needs one cell (--cell NAME)")
        return CellKeys(self.prefix, self.cell)

    @property
    def deployment_keys(self) -> DeploymentKeys:
        return DeploymentKeys(self.prefix)

    def in_cell(self, cell: str) -> CellConfig:
        """This configuration for one cell (its Redis, prefix and lease)."""
        return self.with_overrides(cell=cell)

    def with_overrides(self, *, redis_url: str | None = None, prefix: str | None = None, cell: str | None = None,
                       lease_ms: int | None = None) -> CellConfig:
        """This configuration with every value that is not None replaced (None: keep this one's)."""
        return CellConfig(redis_url=self.redis_url if redis_url is None else redis_url,
                          prefix=self.prefix if prefix is None else prefix,
                          cell=self.cell if cell is None else cell,
                          lease_ms=self.lease_ms if lease_ms is None else lease_ms)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CellConfig:
        """Defaults overridden by the ``ROLLOUT_FLEET_*`` variables that are set (``os.environ``
        unless ``environ`` is given). A bad value raises ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        raw = {setting: env.get(var) for setting, var in ENV_VARS.items()}
        lease = raw["lease_ms"]
        try:
            return cls().with_overrides(redis_url=raw["redis_url"], prefix=raw["prefix"], cell=raw["cell"],
                                        lease_ms=None if lease is None else _lease_ms(lease))
        except ConfigError as exc:
            shown = redacted(str(raw[exc.setting])) if exc.setting == "redis_url" else raw[exc.setting]
            raise ConfigError(ENV_VARS[exc.setting], f"{shown!r} refused ({exc})") from None

def _shown(url: object) -> object:
    """A URL as an error message may show it: without its password."""
    return redacted(url) if isinstance(url, str) else url


def _lease_ms(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError("lease_ms", "expected a whole number of milliseconds") from None

"""HTTP plumbing shared by the engines that front a server (vLLM, vLLM-Omni): one pooled client,
the mapping of answers to our errors, and the weight reload through the server's development
routes (``VLLM_SERVER_DEV_MODE=1``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import httpx

from schemas.errors import InvalidRequestError, TransientEngineError
from schemas.messages import Mode
from workers.engines.base import Engine

_TRANSIENT_STATUS = {408, 425, 429}
HEALTH_TIMEOUT_S = 2.0  # a readiness probe: a server slower than this to say "healthy" is not ready
DEV_MODE_HINT = "start the server with VLLM_SERVER_DEV_MODE=1 (weight reloads use its development routes)"


def http_client(base_url: str, *, timeout_s: float, connect_timeout_s: float, max_connections: int,
                transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """One pooled client per engine: connections are reused across steps."""
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                             limits=httpx.Limits(max_connections=max_connections,
                                                 max_keepalive_connections=max_connections),
                             transport=transport)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


def check_response(response: httpx.Response, what: str) -> Any:
    """The JSON body of a 2xx answer; else the mapped exception."""
    if response.status_code < 300:
        return response.json() if response.content else None
    message = f"{what}: HTTP {response.status_code}: {_error_message(response)}"
    if 400 <= response.status_code < 500 and response.status_code not in _TRANSIENT_STATUS:
        raise InvalidRequestError(message)
    raise TransientEngineError(message)


async def post_json(client: httpx.AsyncClient, path: str, body: Mapping[str, Any] | None, what: str,
                    params: Mapping[str, str] | None = None) -> Any:
    try:
        response = await client.post(path, json=body, params=params)
    except httpx.TimeoutException as exc:
        raise TransientEngineError(f"{what}: timed out ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        raise TransientEngineError(f"{what}: {type(exc).__name__}: {exc}") from exc
    return check_response(response, what)


def check_rpc_results(results: Any, method: str) -> None:
    """Raise unless every worker of a ``collective_rpc`` did the call: vLLM-Omni answers stages that
    do not implement a method with a ``{"todo": ...}`` entry instead of failing."""
    entries: Sequence[Any] = results if isinstance(results, (list, tuple)) else [results]
    for index, entry in enumerate(entries):
        if isinstance(entry, Mapping) and (entry.get("todo") or entry.get("error")):
            raise RuntimeError(f"{method}: worker {index} of the engine did not do it: {dict(entry)}")


async def reload_over_http(http: httpx.AsyncClient, path: str, *, version: int | None) -> None:
    """The engine's own in-place reload of ``path`` on a server: pause (letting its running requests
    finish), ``reload_weights`` on every engine worker, reset the prefix cache so no KV of the old
    weights is reused, record ``version`` (when the server keeps one), resume."""
    try:
        await post_json(http, "/pause", None, "pause", params={"mode": "wait"})
    except InvalidRequestError as exc:  # 404: no development routes on this server
        raise RuntimeError(f"{exc}; {DEV_MODE_HINT}") from exc
    try:
        answer = await post_json(http, "/collective_rpc",
                                 {"method": "reload_weights", "kwargs": {"weights_path": path}}, "reload_weights")
        check_rpc_results((answer or {}).get("results", []), "reload_weights")
        for _ in range(50):  # refused while blocks are still held (an abort being processed)
            reset = await post_json(http, "/reset_prefix_cache", None, "reset_prefix_cache")
            if isinstance(reset, Mapping) and reset.get("success"):
                break
            await asyncio.sleep(0.1)
        else:
            raise TransientEngineError("reset_prefix_cache: the server kept refusing")
        if version is not None:
            await post_json(http, "/update_weight_version", {"new_version": str(version)}, "update_weight_version")
    finally:
        await post_json(http, "/resume", None, "resume")


class ServerConfig(Protocol):
    """What the engines that front a server share in their configs."""

    @property
    def base_url(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def server_model(self) -> str | None: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def batches_in_flight(self) -> int: ...


class ServerEngine(Engine):
    """An engine that fronts one server: one pooled client, the fleet's and the server's model
    names, and weight reloads through the server's development routes."""

    mode: Mode
    server_keeps_version = True  # the server has /update_weight_version (vLLM does, vLLM-Omni not)

    def __init__(self, config: ServerConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.server_config = config
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    def models(self) -> Mapping[str, Mode]:
        return {self.server_config.model: self.mode}

    def max_batch_size(self, model: str) -> int:
        return self.server_config.max_batch_size

    def batches_in_flight(self, model: str) -> int:
        return self.server_config.batches_in_flight

    @property
    def server_model(self) -> str:
        return self.server_config.server_model or self.server_config.model

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            cfg = self.server_config
            self._client = http_client(cfg.base_url, timeout_s=cfg.timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                                       max_connections=cfg.max_connections, transport=self._transport)
        return self._client

    async def _close_http(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def ready(self) -> bool:
        """The server's ``GET /health`` answers 2xx (vLLM and vLLM-Omni answer 200 once the model is
        loaded); a refused connection or another status raises with the reason."""
        response = await self._http().get("/health", timeout=HEALTH_TIMEOUT_S)
        if response.status_code // 100 != 2:
            raise RuntimeError(f"{self.server_config.base_url}/health answered HTTP {response.status_code}")
        return True

    async def load_weights(self, path: str, version: int) -> None:
        """The server engine's own in-place reload (``reload_over_http``); the worker calls it only
        while none of its steps runs."""
        await reload_over_http(self._http(), path, version=version if self.server_keeps_version else None)
        self._version = version

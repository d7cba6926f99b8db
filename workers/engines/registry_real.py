"""The real engines by name: vLLM and vLLM-Omni, in process or over HTTP.

| name             | mode              | options (``--engine-opt KEY=VALUE``; values parsed as JSON)              |
|------------------|-------------------|--------------------------------------------------------------------------|
| ``vllm``         | tokens            | ``model`` (checkpoint dir, required), ``served_model_name``, ``dtype``,   |
|                  |                   | ``max_model_len``, ``enforce_eager``, ``enable_prefix_caching``,          |
|                  |                   | ``enable_return_routed_experts``, ``seed``, ``default_seed``,             |
|                  |                   | ``max_batch_size``, ``engine_args`` (more AsyncEngineArgs), ``env``       |
| ``vllm-http``    | tokens            | ``base_url`` and ``model`` (required), ``server_model``, ``timeout_s``,   |
|                  |                   | ``connect_timeout_s``, ``max_connections``, ``default_seed``,             |
|                  |                   | ``max_batch_size``                                                        |
| ``vllm-omni``    | world_model_env   | ``model`` (default ``dreamzero``), ``weights``, ``client_factory``        |
|                  |                   | (``module:callable``), ``client_options``, ``default_seed``,              |
|                  |                   | ``max_batch_size``                                                        |
| ``vllm-omni-http`` | world_model_env | ``base_url`` (required), ``model``, ``server_model``, ``timeout_s``,      |
|                  |                   | ``connect_timeout_s``, ``max_connections``, ``default_seed``,             |
|                  |                   | ``max_batch_size``                                                        |

Each engine module imports vllm / vllm_omni only when the engine starts; the HTTP ones need only httpx.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.engines.base import Engine

REAL_ENGINES = ("vllm", "vllm-http", "vllm-omni", "vllm-omni-http")


def build_real_engine(name: str, options: Mapping[str, Any] | None = None) -> Engine:
    opts = dict(options or {})
    try:
        if name == "vllm":
            from workers.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

            return VLLMEngine(VLLMEngineConfig(**opts))
        if name == "vllm-http":
            from workers.engines.vllm_http import VLLMHTTPConfig, VLLMHTTPEngine

            return VLLMHTTPEngine(VLLMHTTPConfig(**opts))
        if name == "vllm-omni":
            from workers.engines.vllm_omni_engine import VLLMOmniEngine, VLLMOmniEngineConfig

            return VLLMOmniEngine(VLLMOmniEngineConfig(**opts))
        if name == "vllm-omni-http":
            from workers.engines.vllm_omni_http import VLLMOmniHTTPConfig, VLLMOmniHTTPEngine

            return VLLMOmniHTTPEngine(VLLMOmniHTTPConfig(**opts))
    except TypeError as exc:  # a missing or unknown option
        raise ValueError(f"engine {name!r}: {exc}") from exc
    raise ValueError(f"unknown engine {name!r}; choose one of: {', '.join(REAL_ENGINES)}")

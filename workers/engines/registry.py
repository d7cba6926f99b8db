"""Engines by name, or by ``module:Class``. An engine's module is imported only when it is chosen,
so the trainer client and the CLI stay light (no torch / vllm / vllm_omni on import).

| name             | mode              | options (``--engine-opt KEY=VALUE``; values parsed as JSON)              |
|------------------|-------------------|--------------------------------------------------------------------------|
| ``reference``    | both              | ``seed``, ``latent_shape``, ``device``, ``threads``, ``lm`` (a mapping),  |
|                  |                   | ``max_batch_size``                                                        |
| ``null``         | both              | ``latent_shape``, ``delay_ms``, ``fail_prompt``                           |
| ``vllm``         | tokens            | ``model`` (checkpoint dir, required), ``served_model_name``, ``dtype``,   |
|                  |                   | ``max_model_len``, ``enforce_eager``, ``enable_prefix_caching``,          |
|                  |                   | ``enable_return_routed_experts``, ``seed``, ``default_seed``,             |
|                  |                   | ``max_batch_size``, ``batches_in_flight``, ``engine_args``                |
|                  |                   | (more AsyncEngineArgs), ``env``                                           |
| ``vllm-http``    | tokens            | ``base_url`` and ``model`` (required), ``server_model``, ``timeout_s``,   |
|                  |                   | ``connect_timeout_s``, ``max_connections``, ``default_seed``,             |
|                  |                   | ``max_batch_size``, ``batches_in_flight`` (default 4)                     |
| ``vllm-omni``    | world_model_env   | ``model`` (default ``dreamzero``), ``weights``, ``client_factory``        |
|                  |                   | (``module:callable``), ``client_options``, ``default_seed``,              |
|                  |                   | ``max_batch_size``                                                        |
| ``vllm-omni-http`` | world_model_env | ``base_url`` (required), ``model``, ``server_model``, ``timeout_s``,      |
|                  |                   | ``connect_timeout_s``, ``max_connections``, ``default_seed``,             |
|                  |                   | ``max_batch_size``, ``batches_in_flight`` (default 4)                     |

Any other engine: ``--engine package.module:Class``, an ``Engine`` subclass importable by the worker
(e.g. ``bench.sim_engine:SimEngine``); its options fill its ``config_type``, or are its constructor's
keyword arguments (``Engine.from_options``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from workers.engines.base import Engine

BUILTIN_ENGINES: Mapping[str, str] = {
    "reference": "workers.engines.reference:ReferenceEngine",
    "null": "workers.engines.null:NullEngine",
    "vllm": "workers.engines.vllm_engine:VLLMEngine",
    "vllm-http": "workers.engines.vllm_http:VLLMHTTPEngine",
    "vllm-omni": "workers.engines.vllm_omni_engine:VLLMOmniEngine",
    "vllm-omni-http": "workers.engines.vllm_omni_http:VLLMOmniHTTPEngine",
}
ENGINES = tuple(BUILTIN_ENGINES)
REAL_ENGINES = ("vllm", "vllm-http", "vllm-omni", "vllm-omni-http")
ENGINE_HELP = (f"engine: one of {', '.join(ENGINES)}, or module:Class (an Engine subclass the worker can import, "
               "e.g. bench.sim_engine:SimEngine); default: reference")


def load_object(path: str) -> Any:
    """``module:attribute`` -> the attribute."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"expected 'module:attribute', got {path!r}")
    return getattr(importlib.import_module(module), name)


def engine_name(name: str) -> str:
    """``name`` when it can name an engine (a built-in name or ``module:Class``; the class itself is
    imported only by ``build_engine``), else ``ValueError``: the CLI's check of ``--engine``."""
    module, sep, attribute = name.partition(":")
    if name in BUILTIN_ENGINES or (sep and module and attribute):
        return name
    raise ValueError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}, or module:Class")


def engine_class(name: str) -> type[Engine]:
    """The class a built-in name or ``module:Class`` names."""
    if name in BUILTIN_ENGINES:
        found = load_object(BUILTIN_ENGINES[name])
    else:
        try:
            found = load_object(engine_name(name))
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"engine {name!r}: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, Engine)):
        raise ValueError(f"engine {name!r} is not an Engine subclass")
    return found


def build_engine(name: str, options: Mapping[str, Any] | None = None) -> Engine:
    engine = engine_class(name)
    try:
        return engine.from_options(dict(options or {}))
    except TypeError as exc:  # a missing or unknown option
        raise ValueError(f"engine {name!r}: {exc}") from exc

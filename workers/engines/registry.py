"""Engines by name. Heavy engines are imported only when chosen, so the client stays light."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.engines.base import Engine
from workers.engines.registry_real import REAL_ENGINES

ENGINES = ("reference", "null", *REAL_ENGINES)


def build_engine(name: str, options: Mapping[str, Any] | None = None) -> Engine:
    opts = dict(options or {})
    if name == "null":
        from workers.engines.null import NullEngine, NullEngineConfig

        return NullEngine(NullEngineConfig(**opts))
    if name == "reference":
        from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

        engine: Engine = ReferenceEngine(ReferenceEngineConfig(**opts))
        return engine
    if name in REAL_ENGINES:
        from workers.engines.registry_real import build_real_engine

        return build_real_engine(name, opts)
    raise ValueError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}")

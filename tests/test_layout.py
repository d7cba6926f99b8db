"""The layout is part of the design: imports run one way between the rooms, and rooms stay small.

docs/architecture.md draws the same picture; this test keeps the code and the picture together.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "broker", "workers", "bench")

# Each room and the rooms it may import (besides itself). Nothing imports "up": schemas <- broker
# <- workers <- bench; inside broker, the Redis layer is the bottom and the client sits on it;
# engines see only the contracts, so a worker can front any engine without the broker's code.
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "broker.redis": {"schemas"},
    "broker.client": {"broker.redis", "schemas"},
    "broker.ops": {"broker.redis", "broker.client", "schemas"},
    "broker.rollouts": {"broker.client", "schemas"},
    "broker.integrations": {"broker.client", "broker.rollouts", "schemas"},
    "broker.gateway": {"broker.client", "broker.redis", "broker.ops", "schemas"},  # ops: metrics, dashboard, replay
    "broker": {"broker.client"},
    "workers.engines": {"schemas"},
    "workers": {"broker", "broker.redis", "broker.client", "broker.ops", "broker.gateway", "schemas",
                "workers.engines"},
    "bench": {"broker", "broker.redis", "broker.client", "broker.ops", "schemas", "workers", "workers.engines"},
}
BROKER_ROOMS = {"redis", "client", "ops", "rollouts", "integrations", "gateway"}
MAX_MODULE_LINES = 600  # flags an outlier for review; a module is sized by its concept
MAX_FUNCTION_LINES = 80


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "broker" and len(parts) > 1 and parts[1] in BROKER_ROOMS:
        return f"broker.{parts[1]}"
    if parts[:2] == ["workers", "engines"]:
        return "workers.engines"
    return parts[0]


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield name.removesuffix(".__init__"), path


def imported(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_imports_run_one_way() -> None:
    wrong = []
    for name, path in modules():
        here = room_of(name)
        for target in imported(ast.parse(path.read_text(encoding="utf-8"))):
            if target.split(".")[0] not in PACKAGES:
                continue
            there = room_of(target)
            if there != here and there not in ALLOWED[here]:
                wrong.append(f"{name} imports {target} ({here} -> {there})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", PACKAGES)
def test_rooms_stay_small(package: str) -> None:
    big = []
    for name, path in modules():
        if room_of(name).split(".")[0] != package:
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{name}.{node.name}: {length} lines")
    assert not big, "\n".join(big)


def test_the_room_checker_sees_a_wrong_import() -> None:
    """The checker itself: an engine importing the broker is caught."""
    tree = ast.parse("from broker.client import FleetClient\nimport numpy\n")
    targets = [t for t in imported(tree) if t.split(".")[0] in PACKAGES]
    assert [room_of(t) for t in targets] == ["broker.client"]
    assert "broker.client" not in ALLOWED[room_of("workers.engines.vllm_http")]

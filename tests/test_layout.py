"""The layout is part of the design: imports run one way between the rooms, no module is in an
import cycle, one module builds every Redis client, every Lua script takes its keys in KEYS, and
rooms stay sized by their concepts.

docs/architecture.md draws the same picture; this test keeps the code and the picture together.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "broker", "workers", "cli", "bench")
SHIPPED = ("schemas", "broker", "workers", "cli")  # what the wheel installs; bench/ is a tool of the checkout

# Each room and the rooms it may import (besides itself). Nothing imports "up": schemas <- broker
# <- workers <- cli, the composition root at the top that nothing imports (bench, a tool of the
# checkout beside it, drives the same processes); inside broker, the Redis layer is the bottom and
# the client sits on it; engines see only the contracts, so a worker can front any engine without
# the broker's code. Workers use four modules of broker.ops: failover (reaping, drain, rebalance),
# metrics, cell_stats (the stats stream) and weights (the weight-update protocol).
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
    "workers": {"broker.redis", "broker.ops", "schemas", "workers.engines"},
    "cli": {"broker", "broker.redis", "broker.client", "broker.ops", "broker.gateway", "schemas", "workers",
            "workers.engines"},
    "bench": {"broker", "broker.redis", "broker.client", "broker.ops", "schemas", "workers", "workers.engines",
              "cli"},
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


def module_of(target: str, known: set[str]) -> str | None:
    """The module of ours an import names (``from broker.client import fleet`` -> broker.client.fleet)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, at the top or inside a function (both run)."""
    paths = dict(modules())
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                found = module_of(target, set(paths))
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle() -> None:
    """A module is read after the modules it imports: no two modules of ours import each other,
    directly or around a circle, not even from inside a function."""
    found = cycles(import_graph())
    assert not found, "\n".join(" <-> ".join(component) for component in found)


def test_the_cycle_checker_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_nothing_shipped_imports_the_cli() -> None:
    """The CLI is the composition root: schemas, broker and workers never import it."""
    wrong = [f"{name} imports {target}" for name, targets in import_graph().items()
             if room_of(name) not in ("cli", "bench") for target in targets if room_of(target) == "cli"]
    assert not wrong, "\n".join(wrong)


def test_one_factory_builds_every_redis_client() -> None:
    """broker/redis/connect.py builds every Redis client and pool (cluster URLs, timeouts, retries
    and TLS are decided there once): nobody else calls ``from_url``."""
    factory = ROOT / "broker" / "redis" / "connect.py"
    wrong = []
    for _, path in modules():
        if path == factory:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "from_url":
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, "build the client with broker.redis.connect instead:\n" + "\n".join(wrong)


def test_every_lua_script_takes_its_keys_in_keys() -> None:
    """No script builds a key from ARGV or reads KEYS/ARGV past its opening block of named locals
    (the checker and its self-tests: tests/test_lua_scripts.py; the keys a script derives from a
    declared key of its slot: docs/architecture.md, "Keys in Lua scripts")."""
    from tests.test_lua_scripts import LUA, check

    wrong = [f"{path.name}: {violation}" for path in sorted(LUA.glob("*.lua"))
             for violation in check(path.read_text(encoding="utf-8"))]
    assert not wrong, "\n".join(wrong)

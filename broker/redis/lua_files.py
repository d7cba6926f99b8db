"""The Lua script files beside this package, as written and as Redis runs them."""

from __future__ import annotations

from functools import cache
from importlib import resources

PRELUDE_MARK = "-- Uses: prelude.lua"


def lua_file(name: str) -> str:
    """One .lua file as written (without the prelude)."""
    return resources.files("broker.redis").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


@cache
def lua_source(name: str) -> str:
    """A script as Redis runs it: the file, after prelude.lua when its header says it uses it
    (Redis has no include; the shared idioms stay written once)."""
    source = lua_file(name)
    return lua_file("prelude") + source if PRELUDE_MARK in source else source

"""The Lua script files beside this package, as written and as Redis runs them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

PRELUDE_MARK = "-- Uses: prelude.lua"

# A top-level declaration of prelude.lua: `local function name(` or `local a, b = ...`.
_DECLARATION = re.compile(r"^local\s+(?:function\s+([A-Za-z_]\w*)|([A-Za-z_][\w\s,]*?)\s*=)")
_WORD = re.compile(r"[A-Za-z_]\w*")


def lua_file(name: str) -> str:
    """One .lua file as written (without the prelude)."""
    return resources.files("broker.redis").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True)
class PreludePart:
    """One top-level declaration of prelude.lua with the comment above it: the names it declares
    and every word of its text (the names it may use, and some that are not names)."""

    names: frozenset[str]
    words: frozenset[str]
    text: str


def _declared(line: str) -> frozenset[str] | None:
    m = _DECLARATION.match(line)
    if m is None:
        return None
    return frozenset([m.group(1)] if m.group(1) else (n.strip() for n in m.group(2).split(",")))


@cache
def prelude_parts(prelude: str | None = None) -> tuple[str, tuple[PreludePart, ...]]:
    """prelude.lua (or the text ``prelude``) as its opening comment and its top-level declarations,
    in order. Every top-level statement of the prelude is a ``local`` declaration
    (tests/test_lua_scripts.py checks it); a line that is not one, a comment or blank continues the
    declaration above it."""
    opening: list[str] = []
    parts: list[tuple[frozenset[str], list[str]]] = []
    pending: list[str] = []  # comments and blank lines: the next declaration's, unless code follows
    for line in (lua_file("prelude") if prelude is None else prelude).splitlines(keepends=True):
        names = _declared(line)
        if names is not None:
            parts.append((names, [*pending, line]))
            pending = []
        elif not parts:
            opening.append(line)
        elif line.startswith("--") or not line.strip():
            pending.append(line)
        else:
            parts[-1][1].extend([*pending, line])
            pending = []
    if parts:
        parts[-1][1].extend(pending)
    return "".join(opening), tuple(
        PreludePart(names, frozenset(_WORD.findall("".join(lines))), "".join(lines)) for names, lines in parts
    )


def prelude_for(source: str, prelude: str | None = None) -> str:
    """The part of prelude.lua a script needs: the declarations whose names its text mentions, and
    those theirs mention, in the prelude's order. Every declaration Redis runs costs every call of
    the script (a closure made, a value computed; ~9,000 instructions a call for the whole prelude,
    docs/sizing.md), so a script carries only what it uses. A name in a comment counts as used: more
    than needed is only slower, while less would fail at run time. ``prelude``: another prelude's
    text (a revision's, bench/step_scripts.py) instead of this one's."""
    opening, parts = prelude_parts(prelude)
    wanted = set(_WORD.findall(source))
    chosen = [False] * len(parts)
    changed = True
    while changed:  # a declaration only uses the ones above it, but a pass per level is simpler
        changed = False
        for i, part in enumerate(parts):
            if not chosen[i] and part.names & wanted:
                chosen[i] = changed = True
                wanted |= part.words
    return opening + "".join(part.text for part, keep in zip(parts, chosen, strict=True) if keep)


@cache
def lua_source(name: str) -> str:
    """A script as Redis runs it: the file, after the part of prelude.lua it uses when its header
    says it uses the prelude (Redis has no include; the shared idioms stay written once)."""
    source = lua_file(name)
    return prelude_for(source) + source if PRELUDE_MARK in source else source

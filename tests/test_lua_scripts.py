"""The Lua scripts' two habits, checked statically over broker/redis/lua/*.lua.

1. A script opens by reading KEYS and ARGV into named locals (``local session_key = KEYS[1]``);
   after that opening block it never indexes KEYS or ARGV by a literal position: only by a name
   (a variable-length tail, a loop from an index named at the top).
2. No key name a script touches comes from ARGV: every key argument of a ``redis.call`` and every
   argument of prelude.lua's derived-key helpers is free of ARGV and of any value computed from
   it. A key the script derives (docs/architecture.md, "Keys") starts from a KEYS entry, so it
   shares that entry's hash tag and slot.

The checker is a small line-level taint analysis, not a Lua parser: it knows the scripts' own
idioms and refuses a command it has no key positions for, so a new one is a decision, not a miss.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.redis.blobs import BLOB_MARK
from broker.redis.layouts import DEAD_LETTER_PAYLOAD_BYTES
from broker.redis.lua_files import prelude_parts
from broker.redis.script_replies import Retired
from broker.redis.scripts import Scripts, lua_source

LUA = Path(__file__).resolve().parent.parent / "broker" / "redis" / "lua"

# Which arguments of each command (after its name) are keys: an int n means the first n, None all.
KEY_ARGS: dict[str, int | None] = {
    "TIME": 0,
    "DEL": None, "EXISTS": None, "UNLINK": None,
    "RENAME": 2, "COPY": 2,
    "GET": 1, "SET": 1, "STRLEN": 1, "PEXPIRE": 1, "PTTL": 1, "PERSIST": 1,
    "HGET": 1, "HSET": 1, "HMGET": 1, "HDEL": 1, "HINCRBY": 1, "HSETNX": 1, "HKEYS": 1, "HGETALL": 1,
    "SADD": 1,
    "ZADD": 1, "ZREM": 1, "ZSCORE": 1, "ZMSCORE": 1, "ZINCRBY": 1, "ZRANGE": 1, "ZCARD": 1,
    "XADD": 1, "XACK": 1, "XDEL": 1, "XRANGE": 1, "XLEN": 1,
}
SUBCOMMAND_KEY_ARGS = {("XGROUP", "CREATE"): 1}  # XGROUP CREATE <key> ...
KEY_HELPERS = ("log_step_key", "result_blob", "record_blob", "input_blob", "log_blobs",  # prelude.lua
               "in_place_marker", "in_place_reader")

_LOCAL = re.compile(r"^local\s+([A-Za-z_][\w\s,]*?)\s*=\s*(.+)$")
_ASSIGN = re.compile(r"^([A-Za-z_][\w\s,]*?)\s*=\s*(?!=)(.+)$")
_FOR = re.compile(r"^for\s+([A-Za-z_][\w\s,]*?)\s+(?:=|in)\s+(.+?)\s+do\b")
_NAME = re.compile(r"[A-Za-z_]\w*")
_LITERAL_INDEX = re.compile(r"\b(KEYS|ARGV)\s*\[\s*\d")
_LITERAL_TAIL = re.compile(r"\b(?:unpack|table\.concat)\(\s*(KEYS|ARGV)\s*(?:,\s*'[^']*')?\s*,\s*\d")
_STRING = re.compile(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"")


@dataclass(frozen=True)
class Violation:
    line: int
    why: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.why}"


def _code(line: str) -> str:
    """A line without its comment (a `--` outside a string)."""
    out, i = [], 0
    while i < len(line):
        if line[i] in "'\"":
            match = _STRING.match(line, i)
            end = match.end() if match else len(line)
            out.append(line[i:end])
            i = end
        elif line.startswith("--", i):
            break
        else:
            out.append(line[i])
            i += 1
    return "".join(out).strip()


def _names(expr: str) -> set[str]:
    return set(_NAME.findall(_STRING.sub("''", expr)))


def _argv_free(expr: str) -> str:
    """The expression with what is not a value from ARGV left out: KEYS entries (whatever picks
    the position) and counts (#ARGV, #KEYS)."""
    expr = re.sub(r"\bKEYS\s*\[[^\]]*\]", "KEY", expr)
    return re.sub(r"#\s*(ARGV|KEYS)\b", "0", expr)


def _split_args(text: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose '(' is just before ``start``."""
    args, depth, current, i = [], 0, [], start
    while i < len(text):
        c = text[i]
        if c in "'\"":
            match = _STRING.match(text, i)
            end = match.end() if match else len(text)
            current.append(text[i:end])
            i = end
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif c == "," and depth == 0:
            args.append("".join(current).strip())
            current = []
            i += 1
            continue
        current.append(c)
        i += 1
    args.append("".join(current).strip())
    return [a for a in args if a]


# A script that also runs in batches (prelude.lua run_batch) opens with the function of one call,
# whose parameters KEYS and ARGV are that call's; its opening block of named locals follows. Its
# helpers may come before it: top-level functions of named values that never read KEYS or ARGV (a
# closure made inside the one call for each call costs its master more than the call does).
_ONE_CALL = re.compile(r"^local function \w+\(KEYS, ARGV\)$")
_HELPER = re.compile(r"^local function \w+\([\w\s,]*\)?$")  # its parameters may go on over lines


def _after_helpers(lines: list[str], i: int) -> int:
    """The index of the first code line after the helpers that start at ``i`` (none: ``i``); a
    function that reads KEYS or ARGV is no helper, and the opening block ends before it."""
    while i < len(lines) and _HELPER.match(_code(lines[i])) and not _ONE_CALL.match(_code(lines[i])):
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "end"), None)
        if end is None or any(re.search(r"\b(KEYS|ARGV)\b", _code(line)) for line in lines[i:end + 1]):
            return i
        i = end + 1
        while i < len(lines) and not _code(lines[i]):
            i += 1
    return i
_BLOCK_WORDS = {"KEYS", "ARGV", "tonumber", "or", "and", "not", "nil", "true", "false"}


def _opening_block(lines: list[str]) -> int:
    """The index of the first line after the comments and the opening block of named locals: each
    a ``local`` whose value reads KEYS or ARGV, is a literal (a tail's first index), or is computed
    from names the block defined before it (``tonumber(step_id)``, ``first_cap + pools``)."""
    i, named = 0, set()
    while i < len(lines) and (not _code(lines[i])):
        i += 1
    helpers_end = _after_helpers(lines, i)
    if helpers_end < len(lines) and _ONE_CALL.match(_code(lines[helpers_end])):  # a batched script's one call
        i = helpers_end + 1
    while i < len(lines):
        code = _code(lines[i])
        match = _LOCAL.match(code)
        if not code:
            i += 1
            continue
        if not match or "function" in code:
            break
        value = match.group(2)
        if not (re.search(r"\b(KEYS|ARGV)\b", value) or _names(value) <= named | _BLOCK_WORDS):
            break
        named |= {name.strip() for name in match.group(1).split(",")}
        i += 1
    return i


def check(source: str) -> list[Violation]:
    """What a script (as written, without the prelude) does against the two habits."""
    lines = source.splitlines()
    return sorted(_literal_positions(lines) + _argv_keys(lines, _tainted(lines)), key=lambda v: v.line)


def _literal_positions(lines: list[str]) -> list[Violation]:
    body = _opening_block(lines)
    return [Violation(n, f"KEYS/ARGV by a literal position after the opening block: {code}")
            for n, code in enumerate((_code(line) for line in lines[body:]), start=body + 1)
            if _LITERAL_INDEX.search(code) or _LITERAL_TAIL.search(code)]


def _tainted(lines: list[str]) -> set[str]:
    """Every name assigned from ARGV, or from a value computed from one, anywhere in the file."""
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for line in lines:
            code = _code(line)
            match = _LOCAL.match(code) or _FOR.match(code) or _ASSIGN.match(code)
            if not match or code.startswith(("if ", "elseif ", "while ", "return ")):
                continue
            value = _argv_free(match.group(2))
            if re.search(r"\bARGV\b", value) or _names(value) & tainted:
                new = {name.strip() for name in match.group(1).split(",")} - tainted
                tainted |= new
                changed = changed or bool(new)
    return tainted


def _argv_keys(lines: list[str], tainted: set[str]) -> list[Violation]:
    violations = []
    for n, line in enumerate(lines, start=1):
        for why, expr in _key_expressions(_code(line)):
            value = _argv_free(expr)
            bad = sorted(_names(value) & tainted) + (["ARGV"] if re.search(r"\bARGV\b", value) else [])
            if bad:
                violations.append(Violation(n, f"{why} built from ARGV ({', '.join(bad)}): {expr}"))
            if why.startswith("unknown"):
                violations.append(Violation(n, why))
    return violations


def _key_expressions(code: str) -> list[tuple[str, str]]:
    """(what, expression) for each key argument of a redis.call and each argument of a key helper
    on the line."""
    found: list[tuple[str, str]] = []
    for match in re.finditer(r"redis\.call\s*(?:\(|,)", code):
        start = match.end()
        if code[match.end() - 1] == ",":  # pcall(redis.call, 'CMD', ...)
            start = match.end()
        args = _split_args(code, start)
        if not args or not _STRING.fullmatch(args[0]):
            found.append(("unknown command (not a literal)", code))
            continue
        command = args[0][1:-1].upper()
        rest = args[1:]
        if command in ("XGROUP",) and rest and _STRING.fullmatch(rest[0]):
            count = SUBCOMMAND_KEY_ARGS.get((command, rest[0][1:-1].upper()))
            if count is None:
                found.append((f"unknown command {command} {rest[0]} (add its key positions)", code))
                continue
            rest = rest[1:]
        elif command not in KEY_ARGS:
            found.append((f"unknown command {command} (add its key positions to KEY_ARGS)", code))
            continue
        else:
            count = KEY_ARGS[command]
        keys = rest if count is None else rest[:count]
        found += [(f"key of {command}", key) for key in keys]
    for match in re.finditer(r"\b(" + "|".join(KEY_HELPERS) + r")\s*\(", code):
        if code[:match.start()].rstrip().endswith("function"):
            continue  # the helper's definition
        found += [(f"argument of {match.group(1)}", arg) for arg in _split_args(code, match.end())]
    return found


def prelude_names() -> set[str]:
    """The top-level names prelude.lua defines: a script it is prepended to must not reuse them."""
    names = set()
    for line in (LUA / "prelude.lua").read_text().splitlines():
        match = re.match(r"^local\s+(?:function\s+)?([A-Za-z_]\w*)", line)
        if match:
            names.add(match.group(1))
    return names


SCRIPTS = sorted(LUA.glob("*.lua"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_script_reads_keys_and_argv_into_named_locals_and_builds_no_key_from_argv(path: Path) -> None:
    assert [str(v) for v in check(path.read_text())] == []


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.stem != "prelude"],
                         ids=[p.stem for p in SCRIPTS if p.stem != "prelude"])
def test_script_locals_do_not_shadow_the_prelude(path: Path) -> None:
    source = path.read_text()
    if "-- Uses: prelude.lua" not in source:
        return
    lines = source.splitlines()
    top = [_LOCAL.match(_code(line)) for line in lines[:_opening_block(lines)]]
    names = {name.strip() for m in top if m for name in m.group(1).split(",")}
    assert names & prelude_names() == set()


# The checker catches what it is for: retire.lua as it was (a key prefix in ARGV, positions in the
# body) and a key spliced from an ARGV name.
OLD_RETIRE = """\
-- KEYS: 4 inbox; ARGV: 1 worker id, 6 the log keys' prefix
local now = now_ms()
local function kept_payload(fields, payload)
  local session, job = '', ''
  local blob = input_blob(ARGV[6] .. session, job)
  local size = redis.call('STRLEN', blob)
  return size
end
for _, entry in ipairs(redis.call('XRANGE', KEYS[4], '-', '+')) do
  redis.call('ZREM', KEYS[1], ARGV[1])
end
"""

ARGV_KEY = """\
local session_key = KEYS[1]
local session_id = ARGV[1]
local other = 'cell:{c}:session:' .. session_id
redis.call('HSET', session_key, 'field', session_id)
redis.call('DEL', other)
redis.call('HGET', result_blob(session_key, tonumber(session_id)), 'x')
"""

CLEAN = """\
-- KEYS: 1 session hash, 2.. pools; ARGV: 1 worker id
local session_key = KEYS[1]
local first_pool = 2
local worker_id = ARGV[1]
redis.call('HSET', session_key, 'owner', worker_id, 'id', worker_id .. '@x')
for i = first_pool, #KEYS do
  redis.call('ZREM', KEYS[i], worker_id)
end
for _, blob in ipairs(log_blobs(session_key)) do
  redis.call('DEL', blob)
end
pcall(redis.call, 'XGROUP', 'CREATE', session_key, worker_id, '0', 'MKSTREAM')
"""


def test_checker_catches_a_key_prefix_from_argv_and_literal_positions() -> None:
    found = [str(v) for v in check(OLD_RETIRE)]
    assert any("argument of input_blob built from ARGV" in v for v in found), found
    assert any("key of STRLEN built from ARGV (blob)" in v for v in found), found
    assert any(v.startswith("line 9: KEYS/ARGV by a literal position") for v in found), found


def test_checker_catches_a_key_spliced_from_an_argv_value() -> None:
    found = [str(v) for v in check(ARGV_KEY)]
    assert any("key of DEL built from ARGV (other" in v for v in found), found
    assert any("argument of result_blob built from ARGV (session_id)" in v for v in found), found
    assert not any("HSET" in v for v in found), found  # a hash field made of ARGV is no key


def test_checker_accepts_named_locals_tails_and_derived_keys() -> None:
    assert check(CLEAN) == []


def test_checker_reads_the_opening_block_of_a_batched_scripts_one_call() -> None:
    """A script that also runs in batches opens with its one call's function: the named locals
    follow it, and a literal position after them is still caught."""
    one_call = ("local function commit_one(KEYS, ARGV)\n  local session_key = KEYS[1]\n"
                "  local step = ARGV[1]\n  redis.call('HSET', session_key, 'step', step)\n"
                "  return ARGV[2]\nend\n")
    assert [str(v) for v in check(one_call)] == [
        "line 5: KEYS/ARGV by a literal position after the opening block: return ARGV[2]"]


def test_checker_takes_helpers_before_the_one_call_only_when_they_never_read_keys_or_argv() -> None:
    helper = ("local function unstage(staged, staged_key)\n  if staged then\n    redis.call('DEL', staged_key)\n"
              "  end\nend\n\nlocal function commit_one(KEYS, ARGV)\n  local staged_key = KEYS[5]\n"
              "  unstage(true, staged_key)\nend\n")
    assert check(helper) == []
    reads_keys = helper.replace("redis.call('DEL', staged_key)", "redis.call('DEL', KEYS[5])")
    found = [str(v) for v in check(reads_keys)]
    assert any(v.startswith("line 3: KEYS/ARGV by a literal position") for v in found), found


def test_checker_refuses_a_command_it_has_no_key_positions_for() -> None:
    found = [str(v) for v in check("local k = KEYS[1]\nredis.call('LPUSH', k, 'x')\n")]
    assert any("unknown command LPUSH" in v for v in found), found


# retire.lua is given its orphans' input blobs in KEYS; an entry staged after the caller's read
# stops the script before any write, and Scripts.retire reads the inbox again.

async def test_retire_refuses_an_unlisted_staged_orphan_and_its_caller_lists_it(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    blob = k.input_blob("s1", "j0")
    await redis.zadd(k.workers, {"w1": 0})
    await redis.xadd(k.inbox("w1"), {"kind": "step", "job_id": "j0", "session_id": "s1", "payload": BLOB_MARK})
    await redis.set(blob, b"staged bytes")
    keys = [k.workers, k.capacity, k.worker("w1"), k.inbox("w1"), k.dead, k.owned, k.pressure]
    raw = await redis.eval(lua_source("retire"), len(keys), *keys, "w1", 1000, "drained", 100,
                           DEAD_LETTER_PAYLOAD_BYTES, 0)
    assert raw == [b"unlisted"]
    assert await redis.xlen(k.inbox("w1")) == 1 and await redis.get(blob) == b"staged bytes"
    assert await redis.zscore(k.workers, "w1") is not None and await redis.exists(k.dead) == 0
    assert await scripts.retire("w1", pools=[], lease_ms=1000, reason="drained") == Retired(1)
    [(_, letter)] = await redis.xrange(k.dead)
    assert letter[b"payload"] == b"staged bytes" and await redis.exists(blob, k.inbox("w1")) == 0


def test_every_top_level_line_of_the_prelude_is_a_declaration_its_end_or_a_comment() -> None:
    """What broker/redis/lua_files.py prelude_parts relies on to split the prelude: a statement of
    another kind at the top level would run only with the declaration above it."""
    for number, line in enumerate((LUA / "prelude.lua").read_text().splitlines(), 1):
        if line and not line[0].isspace():
            assert line.startswith(("local ", "--")) or line == "end", f"prelude.lua line {number}: {line!r}"


@pytest.mark.parametrize("path", [p for p in SCRIPTS if "-- Uses: prelude.lua" in p.read_text()],
                         ids=[p.stem for p in SCRIPTS if "-- Uses: prelude.lua" in p.read_text()])
def test_a_script_carries_the_prelude_declarations_it_uses_and_theirs(path: Path) -> None:
    """lua_source gives a script the part of the prelude it names, closed under what that part
    names, and no other: every prelude name its file or a chosen declaration mentions is declared
    in what Redis runs, and a declaration nothing chosen mentions is left out."""
    _, parts = prelude_parts()
    source = lua_source(path.stem)
    chosen = [part for part in parts if part.text in source]
    declared = {name for part in chosen for name in part.names}
    mentioned = set(re.findall(r"[A-Za-z_]\w*", path.read_text())).union(*(part.words for part in chosen))
    every = {name for part in parts for name in part.names}
    assert mentioned & every <= declared
    assert all(part.names & mentioned for part in chosen)
    assert source.endswith(path.read_text())

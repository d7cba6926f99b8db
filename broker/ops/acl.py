"""The one Redis ACL of a fleet: what a worker, a client, the supervisor, the gateway, ``status``
and ``replay`` need, and nothing more. docs/security.md shows it; tests/test_security.py runs
every component under a user made from it and checks that Redis denied nothing.

Anyone who can write the fleet's keys is trusted with the fleet (docs/security.md): the ACL keeps
the fleet's user away from the rest of the Redis (other keys, administration, pub/sub), and keeps
anyone else's user away from the fleet's keys.

Usage (redis-cli; the password is the operator's)::

    ACL SETUSER fleet on >PASSWORD <the rules of fleet_acl_rules("rf"), space separated>
"""

from __future__ import annotations

from broker.ops.arq_queue import ARQ_KEY_PATTERNS
from broker.redis.keys import CellKeys

GLOB_CHARACTERS = "*?[]\\"

COMMAND_RULES: tuple[str, ...] = (
    "-@all",
    # Data commands (streams, hashes, sorted sets, strings, expiries) on the keys named below.
    "+@read", "+@write",
    # MULTI/EXEC/WATCH: redis-py pipelines and arq's job claims.
    "+@transaction",
    # PING, HELLO, AUTH, SELECT, CLIENT SETNAME...: connection set-up of every client.
    "+@connection",
    # The Lua scripts: redis-py loads each once and calls it by hash from then on.
    "+evalsha", "+script|load", "+script|exists",
    # The scripts take the time from the Redis clock, so that every host agrees on lease ages.
    "+time",
    # Out again whatever the categories above let in that could harm the server or other users:
    # FLUSHDB, KEYS, SORT, MIGRATE, RESTORE, CLIENT KILL, CONFIG...
    "-@dangerous",
    # arq's worker logs the server's version, memory and client count when it starts (read-only).
    "+info",
    # On a Redis Cluster, the client reads the slot map (read-only; a single node answers an error).
    "+cluster|slots",
)


def fleet_acl_rules(prefix: str) -> list[str]:
    """The ACL rules of a fleet whose keys start with ``prefix`` (``CellConfig.prefix``), in
    ``ACL SETUSER`` order. arq (the supervisor's queue) writes a few keys under its own fixed
    ``arq:`` prefix; they are named one by one."""
    CellKeys(prefix)  # refuses a prefix no key of the fleet could start with
    if any(c in prefix for c in GLOB_CHARACTERS):
        raise ValueError(f"prefix {prefix!r}: an ACL key pattern would read its glob characters "
                         f"({GLOB_CHARACTERS}) as wildcards and let the user reach other keys")
    return ["resetkeys", f"~{prefix}:*", *(f"~{pattern}" for pattern in ARQ_KEY_PATTERNS),
            "resetchannels", *COMMAND_RULES]

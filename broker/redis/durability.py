"""Commits that a replica confirmed before anyone is told (``--durability replicated``).

Redis replicates asynchronously: a master answers a write before any replica has it, so a master
that dies right after a commit can be replaced by a replica that never saw it. ``WAIT n t`` blocks
until ``n`` replicas acknowledged every write *this connection* made (the master remembers the
replication offset of each client's last write), so the commit script and its WAIT must leave on
one connection: on a single node one plain pipeline holds one connection; on a cluster the two go
to the slot's master through :meth:`ClusterNode.execute_pipeline`, which writes and reads a list
of commands on one connection of that node (redis-py's cluster pipeline would send a keyless WAIT
to every primary, and its redirection retries can move a command to another connection).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.redis.connect import is_cluster


class Durability(StrEnum):
    """When a committed step's reply goes out: with its commit (``async``), or once a replica has the
    commit (``replicated``: Redis ``WAIT``)."""

    ASYNC = "async"
    REPLICATED = "replicated"


DURABILITY_MODES: tuple[Durability, ...] = tuple(Durability)
# What a cluster answers while a slot's master fails over or moves: retried like a lost connection.
_FAILOVER_ERRORS = (MovedError, AskError, TryAgainError, ClusterDownError)


@dataclass(frozen=True)
class ReplicaWait:
    """``replicas`` that must acknowledge a commit; one WAIT blocks at most ``wait_ms``."""

    replicas: int = 1
    wait_ms: int = 500

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.wait_ms < 1:
            raise ValueError("a replica wait needs at least 1 replica and 1 ms")


async def call_then_wait(redis: Redis, key: str, command: list[Any], wait: ReplicaWait,
                         before: list[Any] | None = None) -> tuple[Any, int]:
    """Send ``command`` (whose keys all hash to ``key``'s slot) and then ``WAIT`` on one connection:
    its reply (an exception object when it failed) and how many replicas acknowledged it. A
    failed WAIT raises, and so does a slot that moved or a cluster without a master for it (as a
    connection error: the caller retries the pair, and a commit repeated is a duplicate).
    ``before``: a command of the same slot sent first on that connection (a staged result)."""
    commands = [*([before] if before is not None else []), command, ["WAIT", wait.replicas, wait.wait_ms]]
    if is_cluster(redis):
        replies = await _on_slot_master(cast(RedisCluster, redis), key, commands)
    else:
        async with redis.pipeline(transaction=False) as pipe:
            for args in commands:
                pipe.execute_command(*args)
            replies = await pipe.execute(raise_on_error=False)
    reply, acked = replies[-2:]
    if isinstance(reply, _FAILOVER_ERRORS):
        raise RedisConnectionError(f"the slot's master is changing: {reply}") from reply
    if isinstance(acked, Exception):
        raise acked
    return reply, int(acked)


async def _on_slot_master(cluster: RedisCluster, key: str, commands: list[list[Any]]) -> list[Any]:
    if cluster._initialize:  # first use, or a failover was noticed: learn the slot map first
        await cluster.initialize()
    node: ClusterNode | None = cluster.get_node_from_key(key)
    if node is None:
        raise LookupError(f"no node serves the slot of {key!r}")
    stack = [PipelineCommand(i, *args) for i, args in enumerate(commands)]
    try:
        await node.execute_pipeline(stack)
    except Exception:
        # A dead node or a moved slot: have the client learn the map again before the retry.
        cluster._initialize = True
        raise
    results = [cmd.result for cmd in stack]
    if any(isinstance(r, Exception) for r in results):
        cluster._initialize = True
    return results

"""The one place a Redis client is built from a URL: a single node, or a Redis Cluster.

``redis://`` / ``rediss://`` / ``unix://`` give redis-py's plain client, exactly as before.
``redis+cluster://HOST:PORT[,HOST:PORT...]`` (and ``rediss+cluster://`` for TLS) give redis-py's
cluster client, seeded with every listed node: any node of the cluster will do, the client learns
the slot map from it and follows ``MOVED``/``ASK`` redirections and failovers on its own.

Everything of a cell lives in one slot (every key carries the hash tag ``{cell}``), so the fleet's
Lua scripts and streams work unchanged on a cluster. Two things a cluster client does not do and
the fleet therefore avoids on every path: ``MULTI``/``EXEC`` pipelines (redis-py's cluster pipeline
refuses transactions; see :func:`atomic_pipeline`) and commands over keys of several slots.

The cluster client is handed out typed as :class:`redis.asyncio.Redis`: it answers the same command
methods, and the two differences above are kept off every path it takes.

Every client and pool built here has deadlines (:func:`connection_deadlines`): a connect gives up
after ``CONNECT_TIMEOUT_S``, and the kernel drops a TCP connection whose peer has gone silent
(keepalive probes plus ``TCP_USER_TIMEOUT``), so a half-open connection fails within seconds with a
``ConnectionError``/``TimeoutError`` every retry loop already handles. Reads get no ``socket_timeout``:
with redis-py 5.3.1 a task cancelled while blocked in a read wrapped in that timeout can hang
(docs/network-faults.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool, DefaultParser, parse_url
from redis.event import AsyncAfterConnectionReleasedEvent, AsyncReAuthConnectionListener
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from broker.redis.refusals import refusing

try:
    import hiredis  # noqa: F401  (redis-py's serializer below calls it)
    from redis.connection import HiredisRespSerializer

    _RESP: Any = HiredisRespSerializer()  # splits "CONFIG GET"-style names as redis-py's packer does
except ImportError:  # redis-py without its hiredis extra
    _RESP = None
# MISCONF, BUSY, NOREPLICAS raised as their own classes, as redis-py raises OOM (broker/redis/refusals.py).
REFUSALS_PARSED = {"parser_class": refusing(DefaultParser)}
_PACKED: dict[type[AbstractConnection], type[AbstractConnection]] = {}
_CHUNKED: dict[type[AbstractConnection], type[AbstractConnection]] = {}
_CHECKED: dict[type[AbstractConnection], type[AbstractConnection]] = {}
READ_CHUNK = 1 << 20  # bytes a client reads from its socket at a time (redis-py's default: 64 KiB)
_LARGE_ARG = 6000  # redis-py's buffer cutoff: larger values travel as their own buffer

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
URL_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
DEFAULT_CLUSTER_PORT = 6379
# Deadlines on every connection (docs/network-faults.md). A peer gone without closing (a partition,
# a dead host or switch: no RST) is noticed by the kernel, not by a timer around the read: after
# KEEPALIVE_IDLE_S of silence a probe a second, and TCP_USER_TIMEOUT drops the connection once
# USER_TIMEOUT_MS pass with a probe or a command unacknowledged. A live Redis acknowledges the probes
# however long a read blocks (a worker's BLOCK is 15 s by default, a consumer's up to 30 s); a frozen
# but live Redis (SIGSTOP) still acknowledges at the TCP level and is waited for. A connect to an address
# that drops packets gives up after CONNECT_TIMEOUT_S (one SYN) instead of riding SYN back-off (1, 3,
# 7 s ...): after a partition heals the next attempt, at most one backoff (2 s) later, connects.
KEEPALIVE_IDLE_S = 1
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_PROBES = 3
USER_TIMEOUT_MS = 3000
CONNECT_TIMEOUT_S = 1.0
# Connection settings a cluster URL may carry in its query (the same names redis-py reads from
# ``rediss://`` URLs); anything else is refused rather than silently dropped.
_CLUSTER_QUERY = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname",
                  "socket_timeout", "socket_connect_timeout", "health_check_interval", "client_name")


class RedisURLError(ValueError):
    """A Redis URL that cannot be used; the message says what is wrong with it."""


class _FleetCluster(RedisCluster):
    """redis-py's cluster client, except that a cluster it cannot reach raises ConnectionError.

    When no seed node answers (every node down, a wrong address, a node without cluster mode),
    redis-py raises RedisClusterException, which is not a RedisError: every "Redis unavailable,
    retry" loop and every one-line CLI error would take it for a bug. It is the cluster's
    "connection refused", so it is raised as one, the cause chained.

    And stream reads are routed by their keys here: redis-py finds the keys of XREAD/XREADGROUP
    (they follow ``STREAMS``) by asking one fixed node ``COMMAND GETKEYS`` before every read, so at
    fleet scale that one node pays for every worker's blocked read (docs/sizing.md).

    And an XREADGROUP is sent once: redis-py sends a command again after a ConnectionError or
    TimeoutError (and after any error closes the client's connections, every blocked read of the
    client fails so), but the read that failed may have delivered entries, which Redis then holds
    as pending for this consumer while the second read only asks for new ones: steps a live worker
    never sees. The error reaches the caller instead, whose next read starts from its pending
    entries (workers/worker.py). Redirections (MOVED, ASK) are still followed."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        name = args[0].decode() if args and isinstance(args[0], bytes) else str(args[0]) if args else ""
        if name.upper() != "XREADGROUP" or "target_nodes" in kwargs:
            return await super().execute_command(*args, **kwargs)
        if self._initialize:
            await self.initialize()
        try:
            node = self.nodes_manager.get_node_from_slot(await self._determine_slot(*args))
        except SlotNotCoveredError:
            self._initialize = True  # the next call learns the slot map again, as redis-py's retry would
            raise
        return await super().execute_command(*args, target_nodes=node, **kwargs)  # a named node: no retries

    async def initialize(self) -> RedisCluster:
        try:
            return await super().initialize()
        except RedisClusterException as exc:
            raise RedisConnectionError(str(exc)) from exc

    async def _determine_slot(self, command: str, *args: Any) -> int:
        slots = {self.keyslot(key) for key in stream_read_keys(command, args)}
        if len(slots) == 1:
            return slots.pop()
        return await super()._determine_slot(command, *args)  # other commands; cross-slot reads: its error


def stream_read_keys(command: str, args: tuple[Any, ...]) -> list[Any]:
    """The stream keys of an XREAD / XREADGROUP (empty for any other command): the first half of
    what follows ``STREAMS``. XREADGROUP's ``GROUP name consumer`` comes first and is skipped, so a
    group or consumer called "streams" is not taken for the keyword."""
    name = (command.decode() if isinstance(command, bytes) else str(command)).upper()
    if name not in ("XREAD", "XREADGROUP"):
        return []
    for i in range(3 if name == "XREADGROUP" else 0, len(args)):
        word = args[i].decode() if isinstance(args[i], bytes) else str(args[i])
        if word.upper() == "STREAMS":
            rest = args[i + 1:]
            return list(rest[: len(rest) // 2])
    return []


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def is_cluster(redis: Redis) -> bool:
    """Whether a client built here talks to a Redis Cluster."""
    return isinstance(redis, RedisCluster)


def cluster_client_errors(redis: Redis) -> tuple[type[Exception], ...]:
    """What else a pipeline of ``redis`` raises when a node is lost: redis-py 5.3's cluster pipeline
    reads ``get_default_node().name`` after an error, while a concurrent pipeline's retry may just
    have closed the client (default node None) to learn the slot map again after a master died,
    so that AttributeError is the failover. Nothing for a single-node client."""
    return (AttributeError,) if is_cluster(redis) else ()


def keepalive_options() -> dict[int, int]:
    """The TCP options of :data:`KEEPALIVE_IDLE_S` and its neighbours, as this platform names them
    (``TCP_USER_TIMEOUT`` and ``TCP_KEEPIDLE`` are Linux's; others get what they have)."""
    wanted = {"TCP_KEEPIDLE": KEEPALIVE_IDLE_S, "TCP_KEEPINTVL": KEEPALIVE_INTERVAL_S,
              "TCP_KEEPCNT": KEEPALIVE_PROBES, "TCP_USER_TIMEOUT": USER_TIMEOUT_MS}
    return {getattr(socket, name): value for name, value in wanted.items() if hasattr(socket, name)}


def tune_stream(writer: asyncio.StreamWriter) -> None:
    """The same deadlines on a TCP stream of the fleet's own (a worker's result port and its
    trainers' connections to it, workers/result_server.py): keepalive with :func:`keepalive_options`,
    so a dead peer is noticed within seconds, and no Nagle delay. A socket that refuses an option
    keeps its default."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in keepalive_options().items():
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def connection_deadlines(url: str) -> dict[str, Any]:
    """The deadline settings of every connection to ``url``: a connect timeout, and on TCP (and TLS)
    keepalive with a user timeout. Never a ``socket_timeout`` (see the module docstring)."""
    if url.startswith("unix://"):
        return {"socket_connect_timeout": CONNECT_TIMEOUT_S}
    return {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_keepalive": True,
            "socket_keepalive_options": keepalive_options()}


def open_redis(url: str, **options: Any) -> Redis:
    """A client for ``url``; ``options`` (``decode_responses``, ``socket_timeout``, ...) go to redis-py.
    The deadlines of :func:`connection_deadlines` apply unless the URL's query or ``options`` set
    their own. Nothing connects yet: the first command does (and, on a cluster, reads the slot map)."""
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES):
        raise RedisURLError(f"expected a {', '.join(URL_SCHEMES)} URL, got {url!r}")
    deadlines = connection_deadlines(url)
    if not is_cluster_url(url):  # redis-py lets the URL's query override these keyword arguments
        pool = HandingOutInPlace.from_url(url, **{"socket_read_size": READ_CHUNK, **REFUSALS_PARSED, **deadlines,
                                                   **options})
        pool.connection_class = checked_in_place(reading_in_large_chunks(packing_in_c(pool.connection_class)))
        return Redis.from_pool(pool)  # the client closes the pool with itself, as Redis.from_url's does
    nodes, settings = parse_cluster_url(url)
    cluster = _FleetCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                            **{**deadlines, **settings, **options})
    return cast(Redis, cluster)  # same command methods (see the module docstring)


def open_pool(url: str, **options: Any) -> ConnectionPool:
    """A connection pool for a single-node ``url``, for clients built on a pool of their own (arq's
    ``ArqRedis``); ``options`` (``retry``, ``retry_on_error``, ...) go to redis-py. A cluster URL is
    refused: such a client has no cluster routing."""
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES):
        raise RedisURLError(f"expected a {', '.join(URL_SCHEMES)} URL, got {url!r}")
    if is_cluster_url(url):
        raise RedisURLError(f"a connection pool needs a single-node URL, got {redacted(url)}")
    return ConnectionPool.from_url(url, **{**REFUSALS_PARSED, **connection_deadlines(url), **options})


def packing_in_c(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` (TCP, TLS or unix socket) with its commands packed by hiredis, in C.

    redis-py's asyncio connection packs every argument in Python (an encoder call, two joins and a
    ``str(len)`` each): a step's script call has 10-15 arguments, and that packing was the largest
    single item of the trainer's and the worker's CPU per tiny step (docs/benchmarks.md). The bytes
    on the wire are the same. A command carrying a large value (a latent result) or a memoryview
    keeps redis-py's packer, which sends that value as its own buffer instead of copying it into one.
    """
    if _RESP is None:  # hiredis not installed: redis-py's own packer
        return base
    packed = _PACKED.get(base)
    if packed is not None:
        return packed

    def pack_command(self: AbstractConnection, *args: Any) -> list[bytes]:
        for arg in args:
            if isinstance(arg, memoryview) or (isinstance(arg, bytes) and len(arg) > _LARGE_ARG):
                return base.pack_command(self, *args)  # sent as their own buffers, uncopied
        return _RESP.pack(*args)  # type: ignore[no-any-return]

    packed = _PACKED[base] = type(f"CPacked{base.__name__}", (base,), {"pack_command": pack_command})
    return packed


def reading_in_large_chunks(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` with an asyncio stream that buffers up to READ_CHUNK before it pauses the socket.

    redis-py reads 64 KiB at a time from a stream that stops reading the socket at 128 KiB, so a
    450 KB latent result took about 7 reads, each a trip through the event loop and the parser;
    with ``socket_read_size=READ_CHUNK`` (set by :func:`open_redis`) it takes one or two. Measured:
    a trainer's CPU per 450 KB latent step went from 310 to 270 µs (docs/benchmarks.md). TCP and
    TLS connections only: redis-py opens unix sockets without these arguments.
    """
    chunked = _CHUNKED.get(base)
    if chunked is not None:
        return chunked

    def _connection_arguments(self: AbstractConnection) -> Mapping[str, Any]:
        return {**base._connection_arguments(self), "limit": READ_CHUNK}  # type: ignore[attr-defined]

    chunked = _CHUNKED[base] = type(f"Chunked{base.__name__}", (base,),
                                    {"_connection_arguments": _connection_arguments})
    return chunked


def checked_in_place(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` whose pool check before every command answers in place when nothing has arrived.

    redis-py's pool checks a connection it hands out for data nobody asked for (a reply left
    unread, or the server's close) by reading it under a zero timeout: the task yields, the event
    loop turns once (a select, a timer, a cancellation caught), and the check answers "nothing"
    (14-16 µs on these VMs, docs/benchmarks.md; a tiny step's commands pay it on both sides of
    the hop). Whatever the loop has already received is in the connection's buffers: the stream's
    bytes, its end (the server closed it) or error, the transport closing, the parser's unread
    bytes. When all of those are empty the check answers False without the turn; otherwise, or
    where one of them cannot be read (a parser other than hiredis's, another redis-py), redis-py's
    own check runs, reconnecting as it does. What arrived within the last turn is not seen here;
    the command then fails with the ``ConnectionError`` every retry loop already rides out."""
    checked = _CHECKED.get(base)
    if checked is not None:
        return checked

    async def can_read_destructive(self: AbstractConnection) -> bool:
        if _nothing_arrived(self):
            return False
        return await base.can_read_destructive(self)  # type: ignore[no-untyped-call,no-any-return]

    checked = _CHECKED[base] = type(f"Checked{base.__name__}", (base,),
                                    {"can_read_destructive": can_read_destructive})
    return checked


class HandingOutInPlace(ConnectionPool):
    """redis-py's pool, except that handing out an idle connection and taking it back take no awaits
    when none could matter.

    redis-py takes the pool's lock to hand out a connection (a connect may await inside it) and,
    on taking one back, dispatches a "released" event whose one listener re-authenticates the
    connection when a credential provider has left it a new token: 6.9 µs of coroutines and
    objects per pooled command on the VM of docs/benchmarks.md (a pipeline is one), against 2.6 µs
    here; it matters where commands go one at a time (a lone session, the CLI, control). Here
    a connection is handed out directly when the lock is free and the newest idle connection is
    connected with nothing arrived on it (:func:`_nothing_arrived`, the check of
    :func:`checked_in_place`), all without yielding, so no other task can interleave; and it is
    taken back directly when its listeners are redis-py's own and it holds no token. Anything else
    (the lock held, a connection to open, data on the idle one, a token, another dispatcher's
    listeners) takes redis-py's own path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        listeners = getattr(self._event_dispatcher, "_event_listeners_mapping", {}).get(
            AsyncAfterConnectionReleasedEvent)
        self._release_in_place = (isinstance(listeners, list) and len(listeners) == 1
                                  and type(listeners[0]) is AsyncReAuthConnectionListener)

    async def get_connection(self, *args: Any, **options: Any) -> AbstractConnection:
        idle = self._available_connections
        if idle and not self._lock.locked():
            conn = idle[-1]  # the one redis-py would take
            if conn.is_connected and _nothing_arrived(conn):
                idle.pop()
                self._in_use_connections.add(conn)
                return conn
        return await super().get_connection(*args, **options)  # type: ignore[no-any-return]  # as called

    async def release(self, connection: AbstractConnection) -> None:
        if self._release_in_place and getattr(connection, "_re_auth_token", True) is None:
            self._in_use_connections.remove(connection)  # a stranger's connection raises, as redis-py's
            self._available_connections.append(connection)
            return
        await super().release(connection)


def _nothing_arrived(conn: AbstractConnection) -> bool:
    """Whether a connected ``conn`` has nothing buffered, no end and no error (False where any of
    these cannot be read)."""
    stream, writer = getattr(conn, "_reader", None), getattr(conn, "_writer", None)
    unread = getattr(getattr(getattr(conn, "_parser", None), "_reader", None), "has_data", None)  # hiredis
    buffered = getattr(stream, "_buffer", None)  # asyncio's StreamReader; redis-py reads it too
    if stream is None or writer is None or unread is None or buffered is None:
        return False
    return (not buffered and not stream.at_eof() and stream.exception() is None
            and not writer.transport.is_closing() and not unread())


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The seed nodes and the connection settings (credentials, TLS, timeouts) of a cluster URL."""
    scheme, _, rest = url.partition("://")
    tls = scheme == "rediss+cluster"
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, _, hosts = netloc.rpartition("@")
    nodes = [_node(part, url) for part in hosts.split(",")]
    path = urlsplit(url).path.strip("/")
    if path not in ("", "0"):
        raise RedisURLError(f"a Redis Cluster has only database 0, got /{path} in {redacted(url)}")
    # redis-py's own parser reads credentials and query settings, so they mean what they mean in
    # a single-node URL; it needs one host, so it is shown the first.
    first = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}{hosts.split(',')[0]}"
    query = urlsplit(url).query
    parsed = parse_url(first + (f"/?{query}" if query else ""))
    unknown = sorted(set(parsed) - {"host", "port", "db", "username", "password", "connection_class",
                                    *_CLUSTER_QUERY})
    if unknown:
        raise RedisURLError(f"{', '.join(unknown)} cannot be set on a cluster URL ({redacted(url)})")
    settings = {k: v for k, v in parsed.items() if k not in ("host", "port", "db", "connection_class")}
    if tls:
        settings["ssl"] = True
    return nodes, settings


async def server_time(redis: Redis, near_key: str) -> tuple[int, int]:
    """``TIME`` (seconds, microseconds) from the node that serves ``near_key``. Leases are written
    by scripts with that node's clock; on a cluster redis-py would ask its default node, another
    machine whose clock may be off by more than a lease."""
    if not is_cluster(redis):
        secs, micros = await redis.time()
        return int(secs), int(micros)
    cluster = cast(RedisCluster, redis)
    await cluster.initialize()  # the slot map (a no-op once read)
    answer: Any = await cluster.execute_command("TIME", target_nodes=cluster.get_node_from_key(near_key))
    return int(answer[0]), int(answer[1])


async def server_time_ms(redis: Redis, near_key: str) -> int:
    """:func:`server_time` in milliseconds."""
    secs, micros = await server_time(redis, near_key)
    return secs * 1000 + micros // 1000


def atomic_pipeline(redis: Redis) -> Pipeline:
    """A ``MULTI``/``EXEC`` pipeline on one node; on a cluster a plain pipeline, because redis-py's
    cluster pipeline refuses transactions. Callers use it only where every command is idempotent
    and a partial run is repaired by running the whole again (acks, deletes, set adds)."""
    if is_cluster(redis):
        return redis.pipeline()  # the cluster's pipeline: same queueing methods, no MULTI
    return redis.pipeline(transaction=True)


def _node(part: str, url: str) -> tuple[str, int]:
    host, sep, port = part.strip().rpartition(":")
    if not sep:
        host, port = part.strip(), str(DEFAULT_CLUSTER_PORT)
    host = host.strip("[]")  # an IPv6 literal
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisURLError(f"bad node {part!r} in {redacted(url)}: expected HOST:PORT")
    return host, int(port)


def redacted(url: str) -> str:
    """The URL without its password, for error messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{hosts}"

"""broker/redis/connect.py: which client a URL builds, and cluster URLs parsed or refused with a
message that names the problem and never shows the password (no server needed: redis-py's clients
do not connect until their first command); then, against a private server, what its connections
do differently: reads in large chunks, and the pool's check before a command answered in place."""

from __future__ import annotations

import asyncio
import os
import ssl
import uuid

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import DataError

from broker.redis.config import CellConfig, ConfigError
from broker.redis.connect import (
    DEFAULT_CLUSTER_PORT,
    READ_CHUNK,
    RedisURLError,
    is_cluster,
    is_cluster_url,
    open_redis,
    parse_cluster_url,
    stream_read_keys,
)
from broker.redis.embedded import RedisServer


def test_seed_nodes_are_every_listed_node_with_the_default_port_where_none_is_given() -> None:
    nodes, settings = parse_cluster_url("redis+cluster://10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", DEFAULT_CLUSTER_PORT), ("::1", 7002)]
    assert "ssl" not in settings


def test_credentials_reach_every_node() -> None:
    _, settings = parse_cluster_url("redis+cluster://fleet:s3cret@h1:7000,h2:7001")
    assert (settings["username"], settings["password"]) == ("fleet", "s3cret")


def test_tls_scheme_and_query_settings() -> None:
    nodes, settings = parse_cluster_url(
        "rediss+cluster://h1:7000,h2:7001?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required&socket_timeout=3")
    assert nodes == [("h1", 7000), ("h2", 7001)]
    assert settings["ssl"] is True
    assert settings["ssl_ca_certs"] == "/etc/ca.pem"
    assert settings["ssl_cert_reqs"] == "required"
    assert settings["socket_timeout"] == 3.0


@pytest.mark.parametrize("url", ["redis+cluster://h1:7000/0", "redis+cluster://h1:7000/", "redis+cluster://h1:7000"])
def test_database_zero_is_the_only_one(url: str) -> None:
    assert parse_cluster_url(url)[0] == [("h1", 7000)]


def test_a_database_other_than_zero_is_refused_without_the_password() -> None:
    with pytest.raises(RedisURLError, match="only database 0") as caught:
        parse_cluster_url("redis+cluster://fleet:s3cret@h1:7000/2")
    assert "s3cret" not in str(caught.value)
    assert "fleet:***@" in str(caught.value)


def test_an_unknown_query_setting_is_refused_without_the_password() -> None:
    with pytest.raises(RedisURLError, match="max_connections cannot be set") as caught:
        parse_cluster_url("redis+cluster://fleet:s3cret@h1:7000?max_connections=5")
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize("node", ["h1:notaport", "h1:0", "h1:70000", ":7000", "h1:7000,,h2:7001"])
def test_a_bad_node_is_refused_by_name(node: str) -> None:
    with pytest.raises(RedisURLError, match="bad node") as caught:
        parse_cluster_url(f"redis+cluster://u:pw123@{node}")
    assert "pw123" not in str(caught.value)


@pytest.mark.parametrize("url", ["http://h1:7000", "h1:7000", "redis+sentinel://h1:26379", ""])
def test_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(RedisURLError, match="expected a"):
        open_redis(url)


async def test_a_cluster_url_builds_the_cluster_client_and_a_plain_one_the_plain_client() -> None:
    cluster = open_redis("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", decode_responses=True)
    plain = open_redis("redis://127.0.0.1:6379/3")
    try:
        assert isinstance(cluster, RedisCluster) and is_cluster(cluster)
        assert isinstance(plain, Redis) and not is_cluster(plain)
        assert is_cluster_url("rediss+cluster://h:1") and not is_cluster_url("rediss://h:1")
        assert plain.connection_pool.connection_kwargs["db"] == 3
    finally:
        await cluster.aclose()
        await plain.aclose()


async def test_a_tls_cluster_url_gives_tls_connections_with_its_settings() -> None:
    cluster = open_redis("rediss+cluster://127.0.0.1:7000?ssl_cert_reqs=none")
    try:
        kwargs = cluster.connection_kwargs  # type: ignore[attr-defined]
        assert kwargs["ssl_cert_reqs"] in ("none", ssl.CERT_NONE)
        assert kwargs["connection_class"].__name__ == "SSLConnection"
    finally:
        await cluster.aclose()


@pytest.mark.parametrize("url", ["redis+cluster://h1:7000,h2:7001", "rediss+cluster://u:p@h1:7000"])
def test_cell_config_takes_the_cluster_schemes(url: str) -> None:
    assert CellConfig(redis_url=url).redis_url == url
    assert CellConfig.from_env({"ROLLOUT_FLEET_REDIS_URL": url}).redis_url == url


def test_cell_config_refuses_an_unknown_scheme_by_name() -> None:
    with pytest.raises(ConfigError, match="redis_url"):
        CellConfig(redis_url="redis+sentinel://h1:26379")


def test_stream_reads_name_their_keys_after_streams() -> None:
    assert stream_read_keys("XREAD", ("COUNT", 1, "BLOCK", 10, "STREAMS", "a{c}", "b{c}", "0", "$")) == ["a{c}", "b{c}"]
    # a group and a consumer called "streams" are not the keyword
    assert stream_read_keys("XREADGROUP", ("GROUP", "streams", "STREAMS", "COUNT", 1, "STREAMS", b"k", ">")) == [b"k"]
    assert stream_read_keys("xread", ("STREAMS", "k", "0")) == ["k"]
    assert stream_read_keys("GET", ("k",)) == []
    assert stream_read_keys("XREAD", ("COUNT", 1)) == []


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0", "unix:///tmp/redis.sock"])
def test_commands_are_packed_in_c_into_the_same_bytes_as_redis_pys_packer(url: str) -> None:
    from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

    client = open_redis(url)
    conn = client.connection_pool.make_connection()
    base = {"redis": Connection, "rediss": SSLConnection, "unix": UnixDomainSocketConnection}[url.split(":")[0]]
    assert isinstance(conn, base) and type(conn) is not base
    large = b"x" * 10_000  # over redis-py's buffer cutoff: sent as its own buffer, not copied into one
    for args in [("EVALSHA", "abc", 2, b"k1", "k2", 1.5, -0.0, 1e300, 2**70, "h\u00e9llo", b"\x00\xff", -5),
                 ("CONFIG GET", "maxmemory"), (b"CONFIG GET", b"maxmemory"), ("SET", "k", large)]:
        ours, theirs = conn.pack_command(*args), base.pack_command(conn, *args)
        assert b"".join(ours) == b"".join(theirs)
    assert conn.pack_command("SET", "k", large)[-2] is large
    view = memoryview(b"abc")
    assert conn.pack_command("SET", "k", view)[-2] is view
    for bad in (True, None, object()):  # refused as redis-py refuses it, before anything is sent
        with pytest.raises(DataError):
            conn.pack_command("SET", "k", bad)


@pytest.mark.asyncio
async def test_a_client_reads_its_socket_in_large_chunks_and_large_values_round_trip(
        redis_server: RedisServer) -> None:
    client = open_redis(redis_server.url)
    key = f"t{uuid.uuid4().hex}:big"
    try:
        value = os.urandom(3 * READ_CHUNK + 17)  # several chunks, and one cut mid-chunk
        await client.set(key, value, px=60_000)
        assert await client.get(key) == value
        conn = client.connection_pool.make_connection()
        await conn.connect()
        try:
            assert conn._reader._limit == READ_CHUNK  # asyncio's stream buffer: 64 KiB by default
            assert conn._parser._read_size == READ_CHUNK  # redis-py's read: 64 KiB by default
        finally:
            await conn.disconnect()
    finally:
        await client.delete(key)
        await client.aclose()


@pytest.mark.asyncio
async def test_the_pool_check_answers_in_place_for_a_quiet_connection(redis_server: RedisServer) -> None:
    """Nothing arrived: redis-py's check before a command answers without an event-loop turn."""
    client = open_redis(redis_server.url)
    try:
        await client.ping()
        conn = await client.connection_pool.get_connection()
        try:
            check = conn.can_read_destructive()
            with pytest.raises(StopIteration) as answered:  # done at its first step: it never yielded
                check.send(None)
            assert answered.value.value is False
        finally:
            await client.connection_pool.release(conn)
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_reply_left_unread_on_a_pooled_connection_is_not_read_as_the_next_commands(
        redis_server: RedisServer) -> None:
    client = open_redis(redis_server.url)
    key = f"t{uuid.uuid4().hex}:k"
    try:
        await client.set(key, b"value", px=60_000)
        pool = client.connection_pool
        conn = await pool.get_connection()
        await conn.send_command("PING")  # its +PONG is never read
        await pool.release(conn)
        for _ in range(200):  # until the reply is in the connection's buffers
            await asyncio.sleep(0.005)
            if conn._reader is not None and conn._reader._buffer:
                break
        assert await client.get(key) == b"value"  # not the PONG left behind
    finally:
        await client.delete(key)
        await client.aclose()


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_while_pooled_is_replaced(redis_server: RedisServer) -> None:
    client, admin = open_redis(redis_server.url), open_redis(redis_server.url)
    try:
        first = await client.client_id()
        assert await admin.client_kill_filter(_id=first) == 1
        for _ in range(200):  # until the close has reached the pooled connection
            await asyncio.sleep(0.005)
            conn = client.connection_pool._available_connections[-1]
            if conn._reader is None or conn._reader.at_eof():
                break
        assert await client.client_id() != first  # a new connection, and no error
    finally:
        await client.aclose()
        await admin.aclose()


@pytest.mark.asyncio
async def test_the_pool_hands_out_its_idle_connection_and_takes_it_back_with_its_books_kept(
        redis_server: RedisServer) -> None:
    client = open_redis(redis_server.url)
    try:
        await client.ping()
        pool = client.connection_pool
        idle = pool._available_connections[-1]
        handing_out = pool.get_connection()
        with pytest.raises(StopIteration) as handed:  # done at its first step: no lock, no event-loop turn
            handing_out.send(None)
        conn = handed.value.value
        assert conn is idle and conn in pool._in_use_connections and conn not in pool._available_connections
        taking_back = pool.release(conn)
        with pytest.raises(StopIteration):
            taking_back.send(None)
        assert pool._available_connections == [conn] and not pool._in_use_connections
        assert await client.ping() is True
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_connection_left_a_new_credential_is_authenticated_again_when_taken_back(
        redis_server: RedisServer) -> None:
    """redis-py's release event runs where it has work: a credential provider's new token."""
    from redis.auth.token import SimpleToken

    client, admin = open_redis(redis_server.url), open_redis(redis_server.url)
    user = f"t{uuid.uuid4().hex[:12]}"
    try:
        await admin.execute_command("ACL", "SETUSER", user, "on", ">s3cret", "~*", "+@all")
        pool = client.connection_pool
        conn = await pool.get_connection()
        conn.set_re_auth_token(SimpleToken("s3cret", 0, 0, {"oid": user}))
        await pool.release(conn)  # AUTH as the token's user
        assert conn._re_auth_token is None
        again = await pool.get_connection()
        try:
            assert again is conn
            await again.send_command("ACL", "WHOAMI")
            assert await again.read_response() == user.encode()
        finally:
            await pool.release(again)
    finally:
        await admin.execute_command("ACL", "DELUSER", user)
        await client.aclose()
        await admin.aclose()

"""The embedded Redis refuses a port it does not own: another Redis on it (the system's on 6379),
any other listener, or a child that exits, each one line, never a server that seems to be ours."""

from __future__ import annotations

import socket

import pytest
import redis

from broker.redis.embedded import PortTaken, RedisServer, RedisStartError, _probe


def test_a_port_another_redis_serves_is_refused_and_that_redis_is_left_alone(redis_server: RedisServer) -> None:
    theirs = redis.Redis(port=redis_server.port)
    try:
        with pytest.raises(PortTaken) as refused:
            RedisServer(port=redis_server.port).start()
        assert f"port {redis_server.port} is taken" in str(refused.value)
        assert len(str(refused.value).splitlines()) == 1
        assert theirs.ping()  # untouched
    finally:
        theirs.close()


def test_a_port_any_other_listener_holds_is_refused() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        server = RedisServer(port=port)
        with pytest.raises(PortTaken):
            server.start()
        assert server.process is None


def test_a_child_that_exits_says_why_in_one_line() -> None:
    server = RedisServer(extra_args=["--no-such-directive", "x"])
    with pytest.raises(RedisStartError) as failed:
        server.start()
    message = str(failed.value)
    assert message.startswith("redis-server exited with 1: ") and len(message.splitlines()) == 1, message
    assert "Bad directive" in message or "no-such-directive" in message, message
    assert server.process is None


def test_the_server_that_answers_is_the_child_started(redis_server: RedisServer) -> None:
    assert redis_server.process is not None
    assert _probe(redis_server.port) == (redis_server.process.pid, True)


def test_a_stopped_server_starts_again_on_its_port() -> None:
    server = RedisServer().start()
    try:
        port = server.port
        server.stop(kill=True)
        server.start()
        assert server.port == port and redis.Redis(port=port).ping()
    finally:
        server.cleanup()

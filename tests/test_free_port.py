"""free_port: blocks of ports for servers started later (the demo's workers bind P + i, a cluster
node binds P and its bus P + 10000), kept out of the kernel's range for outbound connections."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from broker.redis import embedded
from broker.redis.embedded import PORT_FLOOR, free_port


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", port))
    return sock


@pytest.mark.parametrize(("count", "stride"), [(1, 1), (3, 1), (2, 10000)])
def test_every_port_of_a_block_can_be_bound_and_none_is_ephemeral(count: int, stride: int) -> None:
    start = free_port(count=count, stride=stride)
    ports = [start + i * stride for i in range(count)]
    for sock in [_bind(port) for port in ports]:  # raises if any of them is taken
        sock.close()
    assert ports[0] >= PORT_FLOOR and ports[-1] < embedded._ephemeral_low()


def test_a_block_with_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    first = free_port(count=5)
    with _bind(first + 2) as held:
        held.listen()
        draws: Iterator[int] = iter([first, first + 100, first + 200])
        monkeypatch.setattr(embedded.random, "randrange", lambda *_: next(draws))
        assert free_port(count=5) != first  # the block holding the listening port is passed over

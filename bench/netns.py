"""Separate hosts on this machine: Linux network namespaces joined by one bridge, and half-open
partitions made with iptables DROP (no RST, as when a switch or a VM host dies). Needs root.

Every host is a namespace ``rfn<site>-<name>`` with one veth into a switch namespace
(``rfn<site>-sw``, a bridge) and one address of ``10.201.<site>.0/24``; the harness itself (this
process, in the root namespace) is ``.1`` of it. Nothing else is touched: no other address is used,
no host-wide setting changes, and :meth:`Network.close` (or the next start of the same site)
removes every namespace and link. Two networks of different sites can run at once.
A partition is two DROP rules inside the Redis host's namespace (traffic from and to the cut
host), so the harness's own connection to Redis keeps working while a host is cut.
Used by the fault tier (tests/faults/) and bench/partition.py (docs/network-faults.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

COMMAND_TIMEOUT_S = 30.0
SITES = 8  # 10.201.0.0/24 .. 10.201.7.0/24: .1 the harness, then one address per host


class NetworkError(RuntimeError):
    """A namespace, link or rule could not be made; the message carries the command's stderr."""


def missing_tools() -> list[str]:
    """What this machine lacks to build a network (empty when it can): root, ip, iptables."""
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise NetworkError(f"{' '.join(args)} did not finish in {COMMAND_TIMEOUT_S}s") from exc
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    """One namespace with one address; ``prefix`` runs a command inside it."""

    name: str
    ip: str
    ns_prefix: str

    @property
    def namespace(self) -> str:
        return f"{self.ns_prefix}{self.name}"

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(*self.prefix(), *args, check=check)


@dataclass
class Network:
    """``with Network() as net: redis = net.host("redis"); w = net.host("worker"); net.cut(w, redis)``."""

    site: int = 0
    hosts: dict[str, Host] = field(default_factory=dict)
    cuts: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not 0 <= self.site < SITES:
            raise NetworkError(f"site must be in 0..{SITES - 1}, got {self.site}")

    @property
    def prefix(self) -> str:
        return f"rfn{self.site}-"

    @property
    def root_ip(self) -> str:
        """The harness's own address (this process, in the root namespace)."""
        return f"10.201.{self.site}.1"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def __enter__(self) -> Network:
        remove_all(self.prefix)
        try:
            sh("ip", "netns", "add", self.switch)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            self._plug(f"{self.prefix}root", None, self.root_ip)
        except BaseException:
            remove_all(self.prefix)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        remove_all(self.prefix)
        self.hosts.clear()
        self.cuts.clear()

    def host(self, name: str) -> Host:
        """A new host ``name`` (a namespace with loopback up and one address on the switch)."""
        if name in self.hosts or len(self.hosts) >= 200 or len(self.prefix + name) > 15:
            raise NetworkError(f"cannot add host {name!r}")
        host = Host(name, f"10.201.{self.site}.{len(self.hosts) + 2}", self.prefix)
        sh("ip", "netns", "add", host.namespace)
        sh("ip", "-n", host.namespace, "link", "set", "lo", "up")
        self._plug(f"{self.prefix}{len(self.hosts)}", host, host.ip)
        self.hosts[name] = host
        return host

    def _plug(self, link: str, host: Host | None, ip: str) -> None:
        """A veth from ``host`` (None: the root namespace) into the switch's bridge."""
        port = f"{link}p"
        sh("ip", "link", "add", link, "type", "veth", "peer", "name", port)
        sh("ip", "link", "set", port, "netns", self.switch)
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", port, "up")
        where: list[str] = []
        if host is not None:
            sh("ip", "link", "set", link, "netns", host.namespace)
            where = ["-n", host.namespace]
        sh("ip", *where, "addr", "add", f"{ip}/24", "dev", link)
        sh("ip", *where, "link", "set", link, "up")

    def cut(self, host: Host | str, server: Host) -> None:
        """A half-open partition between ``host`` (or an address) and ``server``: every packet
        either way is dropped inside ``server``'s namespace; neither side gets a RST or an error."""
        ip = host.ip if isinstance(host, Host) else host
        if (ip, server.name) in self.cuts:
            return
        for rule in _rules(ip):
            server.run("iptables", "-I", *rule)
        self.cuts.add((ip, server.name))

    def heal(self, host: Host | str, server: Host) -> None:
        ip = host.ip if isinstance(host, Host) else host
        if (ip, server.name) not in self.cuts:
            return
        for rule in _rules(ip):
            server.run("iptables", "-D", *rule)
        self.cuts.discard((ip, server.name))


def _rules(ip: str) -> Sequence[list[str]]:
    return [["INPUT", "-s", ip, "-j", "DROP"], ["OUTPUT", "-d", ip, "-j", "DROP"]]


def remove_all(prefix: str) -> None:
    """Every namespace and root link of one site (a crashed run's included). Processes still
    running in a namespace keep it alive until they exit; their links go with it."""
    listed = sh("ip", "netns", "list", check=False).stdout.split()
    for name in listed:
        if name.startswith(prefix):
            sh("ip", "netns", "delete", name, check=False)
    sh("ip", "link", "delete", f"{prefix}root", check=False)

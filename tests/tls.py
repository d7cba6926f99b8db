"""A private certificate authority and a Redis server that speaks TLS, for the security tests."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from broker.redis.embedded import RedisServer, free_port

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # fast to make


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> Certificates:
    """A CA made for this test run and a server certificate it signed, valid for 127.0.0.1."""
    _openssl("req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=rollout-fleet test CA", cwd=directory)
    _openssl("req", *EC_KEY, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1",
             cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "1", "-extfile", "san.ext", cwd=directory)
    return Certificates(ca=directory / "ca.crt", cert=directory / "server.crt", key=directory / "server.key")


@dataclass
class TlsRedis:
    server: RedisServer
    tls_port: int
    certificates: Certificates

    def url(self, *, with_ca: bool = True) -> str:
        """The ``rediss://`` URL of the server (trusting the test CA unless ``with_ca`` is False)."""
        query = f"?ssl_ca_certs={self.certificates.ca}" if with_ca else ""
        return f"rediss://127.0.0.1:{self.tls_port}/0{query}"


def tls_redis_server(certificates: Certificates) -> TlsRedis:
    """A redis-server serving TLS on a free port (and plain TCP on another, which the embedded
    server's readiness check uses). Raises RuntimeError if the binary was built without TLS."""
    tls_port = free_port()
    server = RedisServer(extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(certificates.cert),
        "--tls-key-file", str(certificates.key), "--tls-ca-cert-file", str(certificates.ca),
        "--tls-auth-clients", "no",  # clients authenticate with a password or an ACL user, not a cert
    ])
    return TlsRedis(server.start(), tls_port, certificates)

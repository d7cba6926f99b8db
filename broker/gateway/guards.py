"""ASGI guards in front of the app, which answer before a body is read: the bearer key (401) and
the body size (413).

Both are plain ASGI rather than FastAPI dependencies: a dependency runs after the body has been
read and parsed, which is exactly the cost a hostile client must not be able to impose."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.gateway.errors import error_response

OPEN_PATHS = frozenset({"/health"})  # answered without a key: load balancers probe it
# A browser cannot send a bearer header when it opens a page: on the dashboard's paths the key may
# also come as ?key= (the page then sets it as this cookie and drops it from the address bar).
DASHBOARD_PATH = "/dashboard"
DASHBOARD_KEY_PARAM = "key"
DASHBOARD_COOKIE = "rollout_fleet_key"
CALLER_STATE = "api_key_digest"  # scope["state"] entry: the caller's key digest (None: open gateway)
# After a 413 the gateway drops what the client still sends for a moment before it closes (see
# BodyLimit._refuse): until the client is quiet this long, and never past these bounds.
LINGER_QUIET_S = 0.25
LINGER_BOUND_S = 2.0
LINGER_MAX_BYTES = 16 * 1024 * 1024


def key_digest(key: str) -> str:
    """What the gateway stores of a key (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class BearerAuth:
    """With keys configured, every route but :data:`OPEN_PATHS` needs ``Authorization: Bearer <key>``;
    the caller's key digest goes into the request state for session ownership."""

    def __init__(self, app: ASGIApp, api_keys: frozenset[str]) -> None:
        self.app = app
        self.digests = tuple(key_digest(key) for key in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            digest = self._caller(scope)
            if digest is None and self.digests and scope["path"] not in OPEN_PATHS:
                response = error_response(401, "missing or unknown API key: send 'Authorization: Bearer <key>'",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})[CALLER_STATE] = digest
        await self.app(scope, receive, send)

    def _caller(self, scope: Scope) -> str | None:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            token = _browser_key(scope) if _is_dashboard(scope["path"]) else ""
        if not token.strip():
            return None
        digest = key_digest(token.strip())
        # Compare every digest in constant time, so timing does not tell which key came close.
        matches = [hmac.compare_digest(digest, known) for known in self.digests]
        return digest if any(matches) else None


def _is_dashboard(path: str) -> bool:
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def _browser_key(scope: Scope) -> str:
    """The key a browser sends the dashboard: ``?key=`` first, else the cookie."""
    query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
    if query.get(DASHBOARD_KEY_PARAM):
        return query[DASHBOARD_KEY_PARAM][0]
    cookies = SimpleCookie()
    try:
        cookies.load(_header(scope, b"cookie") or "")
    except CookieError:  # a malformed Cookie header is no key, not a 500
        return ""
    morsel = cookies.get(DASHBOARD_COOKIE)
    return morsel.value if morsel is not None else ""


class BodyLimit:
    """Refuses a body over ``max_bytes`` with 413: at once when Content-Length says so, else as soon
    as the streamed bytes pass the limit (the rest is never buffered: only what is already in
    flight is dropped, see :func:`linger`). A body within the limit is buffered and handed to the
    app unchanged."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send, declared)
            return
        first = await self._read_within_limit(receive)
        if first is None:
            await self._refuse(scope, receive, send, f"more than {self.max_bytes}")
            return
        await self.app(scope, _replay(first, receive), send)

    async def _read_within_limit(self, receive: Receive) -> Message | None:
        """The whole body as one message (or the disconnect that cut it short); None past the limit."""
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        response = error_response(413, f"request body of {size} bytes; the limit is {self.max_bytes}",
                                  headers={"Connection": "close"})
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        # The response is whole on the wire, but the server closes the socket once the last body
        # message is sent: with unread bytes still arriving, the kernel answers them with a reset,
        # which can throw away the 413 before the client has read it. A short, bounded drain lets
        # the client see the answer and stop sending first (a lingering close).
        await linger(receive, quiet_s=LINGER_QUIET_S, bound_s=LINGER_BOUND_S, max_bytes=LINGER_MAX_BYTES)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def linger(receive: Receive, *, quiet_s: float, bound_s: float, max_bytes: int) -> int:
    """Read and drop what the client still sends, until it is quiet for ``quiet_s``, its body
    ends, it disconnects, ``bound_s`` passes or ``max_bytes`` are dropped. Returns bytes dropped."""
    dropped = 0
    deadline = asyncio.get_running_loop().time() + bound_s
    while dropped <= max_bytes:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        try:
            async with asyncio.timeout(min(quiet_s, left)):
                message = await receive()
        except TimeoutError:
            break
        if message["type"] != "http.request":
            break
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return dropped


def _replay(first: Message, receive: Receive) -> Receive:
    """A receive that answers the buffered body once, then the server's own (disconnects)."""
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay

"""ASGI guards in front of the app, which answer before a body is read: the body size (413).

Plain ASGI rather than a FastAPI dependency: a dependency runs after the body has been read and
parsed, which is exactly the cost a hostile client must not be able to impose."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.gateway.errors import error_response


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class BodyLimit:
    """Refuses a body over ``max_bytes`` with 413: at once when Content-Length says so, else as soon
    as the streamed bytes pass the limit (the rest is never read). A body within the limit is
    buffered and handed to the app unchanged."""

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
        await response(scope, receive, send)


def _replay(first: Message, receive: Receive) -> Receive:
    """A receive that answers the buffered body once, then the server's own (disconnects)."""
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay

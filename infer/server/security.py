"""ASGI middleware: API-key check and request-body size limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would sit
between a streaming response and the client and hide disconnects from it.
"""

from __future__ import annotations

import json
import secrets

from .errors import error_body

# Routes anyone may call: probes and scrapers carry no key (vLLM guards /v1 only).
PUBLIC_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


async def _send_error(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Every route but the public ones needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        # compare_digest: the time taken must not tell how much of a guess was right.
        if scheme.lower() != b"bearer" or not any(secrets.compare_digest(token.strip(), k) for k in self.keys):
            return await _send_error(send, 401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                     [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes` with 413 before the app parses anything.

    The body is read here, counted, and replayed to the app; later receive()
    calls go to the server, so the app still learns of a disconnect.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, f"request body of {int(length)} bytes exceeds the limit of "
                                                f"{self.max_bytes} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

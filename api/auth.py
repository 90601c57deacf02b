"""Bearer-token check for every route but the health probe.

A pure ASGI middleware rather than a route dependency, so /docs, /openapi.json, /metrics and even
unknown paths are covered: nothing about the target leaks to an unauthenticated client.
"""

from __future__ import annotations

import hmac
import json
import logging

log = logging.getLogger("nvmeof.api")

OPEN_PATHS = frozenset({"/health", "/api/v1/health"})


class BearerAuthMiddleware:
    def __init__(self, app, *, token: str) -> None:
        if not token:
            raise ValueError("an empty API token would accept anyone; pass None to disable the check")
        self.app = app
        self._token = token.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        reason = self._refusal(scope)
        if reason is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "unknown client"
        log.warning("API request refused: %s %s from %s: %s", scope["method"], scope["path"], where, reason)
        body = json.dumps({"detail": f"unauthorized: {reason}"}).encode()
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="nvmeof"'),
            ],
        })
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope) -> str | None:
        """None when the request carries the token, else why it was refused."""
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if not values:
            return "no Authorization header; send 'Authorization: Bearer <token>'"
        scheme, _, credential = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return "the Authorization scheme is not Bearer"
        # Constant-time comparison: response timing must not reveal how much of a guess matched.
        if not hmac.compare_digest(credential.strip(), self._token):
            return "wrong token"
        return None

"""What every request must pass before a route sees it: the request checks and the credential.

``ApiGuard``, one ASGI middleware in front of every path: Host, Origin, content type, body cap, then the
bearer token or the /login session cookie (only /health and the dashboard's shell are open); refusals are
logged without query string or credential. The checks in order and why each: ARCHITECTURE.md, "REST API guard".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qs

log = logging.getLogger("nvmeof.api")

UI_SHELL = frozenset({"/ui", "/ui/ui.js", "/ui/ui.css"})
OPEN_PATHS = frozenset({"/health"}) | UI_SHELL
LOGIN_PATH = "/login"
LOGIN_REDIRECT = "/docs"
# Where /login?next= may send the browser: a fixed list, so the link is no open redirect.
LOGIN_NEXT = frozenset({"/docs", "/ui"})
SESSION_COOKIE = "nvmeof_session"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON_TYPE = "application/json"


class Refusal(Exception):
    def __init__(self, status: int, detail: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = list(headers)


def _split_host(value: str) -> tuple[str, int] | None:
    """``name[:port]`` or ``[v6][:port]`` from a Host header, lower-cased; None when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, tail = value[1:].partition("]")
        if not sep or (tail and not tail.startswith(":")):
            return None
        port_text = tail[1:] if tail else ""
    elif value.count(":") == 1:
        name, port_text = value.split(":")
    elif ":" in value:
        return None  # a bare IPv6 address must be bracketed in Host
    else:
        name, port_text = value, ""
    if not port_text:
        return name.rstrip("."), 80
    if not port_text.isdigit():
        return None
    return name.rstrip("."), int(port_text)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` headers name this API. A wildcard bind (0.0.0.0, ::) accepts any IP literal:
    a rebinding attack needs the attacker's own name in Host, never a bare address."""

    port: int
    names: frozenset[str]
    any_ip: bool = False

    @classmethod
    def for_bind(cls, host: str, port: int, names: Iterable[str] = ()) -> HostPolicy:
        accepted = {n.strip().lower().rstrip(".") for n in names if n.strip()}
        address = ipaddress.ip_address(host)
        if address.is_unspecified:
            return cls(port, frozenset(accepted), any_ip=True)
        accepted.add(str(address))
        if address.is_loopback:
            accepted.add("localhost")
        return cls(port, frozenset(accepted))

    def allows(self, header: str) -> bool:
        parsed = _split_host(header)
        if parsed is None or parsed[1] != self.port:
            return False
        name = parsed[0]
        return name in self.names or (self.any_ip and _is_ip(name))

    def describe(self) -> str:
        shown = [f"[{n}]:{self.port}" if ":" in n else f"{n}:{self.port}" for n in sorted(self.names)]
        if self.any_ip:
            shown.insert(0, f"any IP address:{self.port}")
        return ", ".join(shown)


def session_value(token: str) -> str:
    """The login cookie: derived from the token, so it changes with it and does not carry it."""
    return hmac.new(token.encode("utf-8"), b"nvmeof-session-v1", hashlib.sha256).hexdigest()


def _headers(scope) -> dict[bytes, bytes]:
    # Repeated headers: the first one counts (a second Host or Content-Type is refused by h11 anyway).
    out: dict[bytes, bytes] = {}
    for key, value in scope["headers"]:
        out.setdefault(key.lower(), value)
    return out


def _cookie(headers: dict[bytes, bytes], name: str) -> str | None:
    for part in headers.get(b"cookie", b"").decode("latin-1").split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip()
    return None


class ApiGuard:
    def __init__(self, app, *, token: str, hosts: HostPolicy | None, max_body: int,
                 token_hint: str | None = None) -> None:
        if not token:
            raise ValueError("the API always needs a token: an empty one would accept anyone")
        if max_body < 0:
            raise ValueError(f"max_body must be 0 or more bytes, got {max_body}")
        self.app = app
        self._token = token.encode("utf-8")
        self._session = session_value(token).encode("ascii")
        self.hosts = hosts
        self.max_body = max_body
        self._hint = token_hint

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # no route speaks WebSocket; never accept one
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        try:
            self._check_headers(scope, headers)
            if scope["path"] == LOGIN_PATH:
                await self._login(scope, headers, send)
                return
            if scope["path"] not in OPEN_PATHS:
                self._check_credential(headers)
            if scope["method"] in BODY_METHODS and self._has_body(headers):
                receive = await self._read_body(receive)
        except Refusal as refusal:
            self._log(scope, refusal)
            await _send_json(send, refusal.status, {"detail": refusal.detail}, refusal.headers)
            return
        await self.app(scope, receive, send)

    # -- checks on the headers --------------------------------------------------------------------

    def _check_headers(self, scope, headers: dict[bytes, bytes]) -> None:
        host = headers.get(b"host", b"").decode("latin-1")
        if self.hosts is not None and not self.hosts.allows(host):
            raise Refusal(403, f"Host header {host!r} does not name this API (it answers to "
                               f"{self.hosts.describe()}): refused against DNS rebinding; "
                               "add a name with nvmeof serve --api-host-name NAME")
        origin = headers.get(b"origin")
        if origin is not None and origin.decode("latin-1").lower() != f"http://{host}".lower():
            raise Refusal(403, f"cross-origin request from Origin {origin.decode('latin-1')!r} refused: "
                               "this API sends no CORS headers and serves only its own origin")
        if scope["method"] in BODY_METHODS:
            ctype = headers.get(b"content-type")
            if ctype is not None:
                media = ctype.decode("latin-1").split(";", 1)[0].strip().lower()
                if media != JSON_TYPE:
                    raise Refusal(415, f"Content-Type {media!r} refused: a {scope['method']} request carries "
                                       f"{JSON_TYPE} (or no body)")
            elif self._has_body(headers):
                raise Refusal(415, f"a {scope['method']} request body needs Content-Type: {JSON_TYPE}")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                raise Refusal(400, f"Content-Length {length.decode('latin-1')!r} is not a number of bytes")
            if int(length) > self.max_body:
                raise Refusal(413, f"request body of {int(length)} bytes is over the limit of {self.max_body} "
                                   "(nvmeof serve --api-max-body SIZE)", [(b"connection", b"close")])

    @staticmethod
    def _has_body(headers: dict[bytes, bytes]) -> bool:
        return b"transfer-encoding" in headers or headers.get(b"content-length", b"0").strip() not in (b"0", b"")

    # -- the credential ---------------------------------------------------------------------------

    def _check_credential(self, headers: dict[bytes, bytes]) -> None:
        value = headers.get(b"authorization")
        if value is None:
            cookie = _cookie(headers, SESSION_COOKIE)
            if cookie is not None and hmac.compare_digest(cookie.encode("latin-1"), self._session):
                return
            self._unauthorized("no Authorization header; send 'Authorization: Bearer <token>'"
                               + (" (or a stale login cookie)" if cookie is not None else ""))
        scheme, _, credential = value.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            self._unauthorized("the Authorization scheme is not Bearer")
        # Constant-time comparison: response timing must not reveal how much of a guess matched.
        if not hmac.compare_digest(credential.strip(), self._token):
            self._unauthorized("wrong token")

    def _unauthorized(self, reason: str) -> None:
        hint = f"; the token is in {self._hint}" if self._hint else ""
        raise Refusal(401, f"unauthorized: {reason}{hint}", [(b"www-authenticate", b'Bearer realm="nvmeof"')])

    async def _login(self, scope, headers: dict[bytes, bytes], send) -> None:
        """``GET /login?token=T[&next=/ui]``: the links `nvmeof serve` prints (and the dashboard's token
        form). Sets the session cookie and sends the browser on to /docs or ``next``, whose requests then
        carry the cookie."""
        if scope["method"] != "GET":
            raise Refusal(405, "use GET /login?token=TOKEN (the link nvmeof serve printed)")
        query = parse_qs(scope["query_string"].decode("latin-1"))
        given = query.get("token", [""])[0]
        target = query.get("next", [LOGIN_REDIRECT])[0]
        if target not in LOGIN_NEXT:
            raise Refusal(400, f"/login next={target!r} is not a page of this API; use one of "
                               f"{', '.join(sorted(LOGIN_NEXT))}")
        if not hmac.compare_digest(given.encode("latin-1", "replace"), self._token):
            cookie = _cookie(headers, SESSION_COOKIE)
            if not (cookie and hmac.compare_digest(cookie.encode("latin-1"), self._session)):
                self._unauthorized("the login link carries no token or a wrong one")
        log.info("API login from %s: session cookie set", _client(scope))
        cookie_header = f"{SESSION_COOKIE}={self._session.decode()}; HttpOnly; SameSite=Strict; Path=/"
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", target.encode()), (b"set-cookie", cookie_header.encode()),
            (b"cache-control", b"no-store"), (b"content-length", b"0"),
        ]})
        await send({"type": "http.response.body", "body": b""})

    # -- the body ---------------------------------------------------------------------------------

    async def _read_body(self, receive):
        """Read the whole body (at most the cap) and hand the route a receive that replays it."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the route sees just that
                return _replaying(message)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise Refusal(413, f"request body is over the limit of {self.max_body} bytes "
                                   "(nvmeof serve --api-max-body SIZE)", [(b"connection", b"close")])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    # -- logging ----------------------------------------------------------------------------------

    @staticmethod
    def _log(scope, refusal: Refusal) -> None:
        # The path only: the query string of /login carries the token.
        log.warning("API request refused (%d): %s %s from %s: %s", refusal.status, scope["method"], scope["path"],
                    _client(scope), refusal.detail)


def _replaying(message: dict):
    async def receive() -> dict:
        return message

    return receive


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "local socket"


async def _send_json(send, status: int, content: dict, extra: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra,
    ]})
    await send({"type": "http.response.body", "body": body})

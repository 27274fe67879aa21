"""Who the dashboard answers: requests naming one of its own hosts, carrying its token.

The Host check defeats DNS rebinding (a web page whose name turns into 127.0.0.1 reading the
dashboard from the viewer's browser); the token keeps other users of the machine, and anyone on
the network, from reading every device's results.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

COOKIE: Final = "pfl_dashboard_session"
SESSION_CONTEXT: Final = b"pfl-edge dashboard session v1"
LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})
PUBLIC_PREFIXES: Final = ("/static/", "/favicon.ico")
"""The page's code and icon: served without the token (they hold no fleet data)."""


@dataclass(frozen=True)
class HostCheck:
    """The Host header values a dashboard listening on `listen_host` answers to.

    Its own listen address or name, the loopback names, and, when it listens on every address,
    any IP address (a rebinding attack needs a DNS name; an IP cannot be rebound).
    """

    listen_host: str

    def allows(self, header: str) -> bool:
        """Whether a request with this Host header (port included or not) is for us."""
        host = _host_name(header)
        if not host:
            return False
        if host in LOOPBACK_NAMES or host == self.listen_host.lower():
            return True
        if self.listen_host in WILDCARDS:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                return False
            return True
        return False


def _host_name(header: str) -> str:
    """`name`, `name:port`, `[v6]` or `[v6]:port` -> the lower-case name or address."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else ""
    name, _, port = header.rpartition(":") if ":" in header else (header, "", "")
    if port and not port.isdigit():
        return ""
    return name.rstrip(".")


class DashboardGate:
    """ASGI middleware: a foreign Host gets 400; without the token (when there is one), 401.

    The token comes as a bearer header or `?token=` once: a link with `?token=` sets a session
    cookie and redirects to the same page without it, so the token does not stay in the address
    bar or the browser history. The cookie holds `session_value(token)`, an HMAC of the token:
    a cookie read from the browser's store does not give the token (nor work as a bearer).
    """

    def __init__(
        self, app: Callable[..., Awaitable[None]], token: str | None, hosts: HostCheck
    ) -> None:
        self.app = app
        self.token = token
        self.hosts = hosts
        self.session = None if token is None else session_value(token)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:  # type: ignore[type-arg]
        """Pass the request on, or answer it with the refusal."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        response = self._refusal(request)
        if response is None:
            await self.app(scope, receive, send)
        else:
            await response(scope, receive, send)

    def _refusal(self, request: Request) -> Response | None:
        if not self.hosts.allows(request.headers.get("host", "")):
            return PlainTextResponse(
                "this dashboard answers only to its own address (Host header refused)",
                status_code=400,
            )
        if self.token is None or request.url.path.startswith(PUBLIC_PREFIXES):
            return None
        offered = request.query_params.get("token")
        if offered is not None and self._matches(offered):
            response = RedirectResponse(request.url.remove_query_params("token"), 303)
            response.set_cookie(
                COOKIE,
                self.session or "",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
            return response
        if _same(request.cookies.get(COOKIE, ""), self.session) or self._matches(
            request.headers.get("authorization", "").removeprefix("Bearer ")
        ):
            return None
        return PlainTextResponse(
            "this dashboard needs its token: open the link pfl-coord printed "
            "(…/?token=…) or send 'Authorization: Bearer <token>'",
            status_code=401,
        )

    def _matches(self, offered: str) -> bool:
        return _same(offered, self.token)


def session_value(token: str) -> str:
    """The session cookie's value for `token`: an HMAC keyed by it, never the token itself."""
    return hmac.new(token.encode(), SESSION_CONTEXT, hashlib.sha256).hexdigest()


def _same(offered: str, expected: str | None) -> bool:
    return (
        expected is not None
        and bool(offered)
        and hmac.compare_digest(offered.encode(), expected.encode())
    )

"""Who may call the server, checked in front of the app (a refused request never reaches it), as llama.cpp, Ollama
and Jupyter check it for a server on the user's own machine:

- Host: bound to a loopback address (or given --allowed-hosts), the server answers only requests whose Host header
  names a loopback address, `localhost`, the bound host or an --allowed-hosts name: a web page whose domain an
  attacker re-points at 127.0.0.1 (DNS rebinding) sends its own domain there.
- Origin: a request from a web page of another origin (a cross-site form or fetch) is refused unless
  --allowed-origins names that origin; allowed origins get the CORS headers a browser needs, preflights included.
- API key: with --api-key, every /v1 request needs `Authorization: Bearer <key>` (as vLLM's --api-key).
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response

from .requests import ApiError
from ..config import ServerSettings

CORS_METHODS = "GET, POST, OPTIONS"
DEFAULT_PORTS = {"http": 80, "https": 443}


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address.lower() == "localhost"


def host_name(host_header: str) -> str:
    """The name part of a Host header: 'localhost:8000' -> 'localhost', '[::1]:8000' -> '::1'; a malformed bracketed
    one ('[::1', '[::1]x') whole, so that it names no allowed host."""
    host = host_header.strip().lower()
    if host.startswith("["):
        address, bracket, rest = host[1:].partition("]")
        well_formed = bracket and (not rest or rest[:1] == ":" and rest[1:].isdigit())
        return address if well_formed else host
    name, _, port = host.rpartition(":")
    return (name if name and port.isdigit() else host).rstrip(".")


def allowed_name(name: str) -> str:
    """An --allowed-hosts name (refused with a port: ServerSettings.check) as host_name gives a Host header's:
    'Example.com.' (the same name, fully qualified) -> 'example.com', '[::1]' -> '::1'."""
    name = name.lower()
    return name[1:-1] if name.startswith("[") and name.endswith("]") else name.rstrip(".")


def checks_host(settings: ServerSettings, bound_address: str) -> bool:
    return (is_loopback(bound_address) or bool(settings.allowed_hosts)) and "*" not in settings.allowed_hosts


def host_check_warning(settings: ServerSettings, bound_address: str) -> str | None:
    """The one line `serve` prints when the Host header goes unchecked: bound to an address other machines reach."""
    if checks_host(settings, bound_address):
        return None
    why = "--allowed-hosts '*' allows every name" if "*" in settings.allowed_hosts else \
        f"--host {settings.host} is not a loopback address"
    return (f"{why}, so the Host header is not checked: a web page can "
            "reach this server by re-pointing its own domain at this machine (DNS rebinding); keep the check by "
            "naming the host names clients use with --allowed-hosts")


def origin_key(origin: str) -> tuple | str:
    """An origin as compared: its scheme, host name and port (a port left out is the scheme's default, as browsers
    leave it out); the text itself where it is no such URL ('null')."""
    try:
        url = urlsplit(origin.strip().lower())
        if url.scheme and url.hostname:
            return url.scheme, url.hostname, url.port or DEFAULT_PORTS.get(url.scheme)
    except ValueError:  # a port that is not a number
        pass
    return origin.strip().rstrip("/").lower()


def same_origin(origin: str, host: str | None, scheme: str) -> bool:
    """Whether a web page's Origin is this server as the request reached it: scheme, host and port."""
    page = origin_key(origin)
    return host is not None and isinstance(page, tuple) and page == origin_key(f"{scheme}://{host.strip()}")


class AccessGuard:
    """ASGI middleware: Host, Origin and API key checks; CORS headers for allowed origins."""

    def __init__(self, app, settings: ServerSettings, bound_address: str):
        self.app = app
        self.check_host = checks_host(settings, bound_address)
        self.hosts = {"localhost", settings.host.lower(), *map(allowed_name, settings.allowed_hosts)}
        self.origins = {*map(origin_key, settings.allowed_origins)}
        self.key = settings.api_key.encode() if settings.api_key else None

    def host_allowed(self, host: str | None) -> bool:
        if host is None or not self.check_host:  # browsers always send Host: a request without one is no web page's
            return True
        name = host_name(host)
        return name in self.hosts or is_loopback(name)

    def origin_allowed(self, origin: str, host: str | None, scheme: str) -> bool:
        if same_origin(origin, host, scheme):
            return True
        return "*" in self.origins or origin_key(origin) in self.origins

    def key_valid(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        if not self.host_allowed(host):
            return await ApiError(403, f"Host '{host}' is not allowed: this server answers requests to a loopback "
                                  "address or localhost (--allowed-hosts adds names)", type_="permission_error",
                                  code="host_not_allowed").response()(scope, receive, send)
        if origin is not None and not self.origin_allowed(origin, host, scope.get("scheme", "http")):
            return await ApiError(403, f"cross-origin request from '{origin}' refused (--allowed-origins allows "
                                  "origins)", type_="permission_error",
                                  code="origin_not_allowed").response()(scope, receive, send)
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin is not None else {}
        if scope["method"] == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            requested = headers.get("access-control-request-headers", "Authorization, Content-Type")
            return await Response(status_code=204, headers={
                **cors, "Access-Control-Allow-Methods": CORS_METHODS, "Access-Control-Allow-Headers": requested,
                "Access-Control-Max-Age": "600"})(scope, receive, send)
        needs_key = self.key is not None and scope["path"].startswith("/v1")
        if needs_key and not self.key_valid(headers.get("authorization")):
            return await ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                  code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer", **cors}).response()(scope, receive, send)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      *((k.lower().encode(), v.encode("latin-1")) for k, v in cors.items())]
            await send(message)

        await self.app(scope, receive, send_with_cors)

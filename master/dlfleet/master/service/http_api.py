"""The master's HTTP endpoint, on the event loop of its gRPC server (aiohttp):

    GET /healthz          open: `ok` while the master serves
    GET /login?token=T    sets the token cookie and redirects to /
    GET /                 the live dashboard for a browser (Accept: text/html,
                          see dashboard.py), else the list of endpoints
    GET /static/NAME      open: the dashboard's stylesheet and script
    GET /metrics          Prometheus text format (prometheus_client)
    GET /api/v1/status    the job's status document (dlfleet.api.status_document)
    GET /api/v1/events    the timeline: ?since=SEQ&limit=N, oldest first

Everything but /healthz, /static/ (and /metrics when `open_metrics`) needs
the job token, the one the gRPC services check: `Authorization: Bearer T`,
`X-Dlfleet-Token: T`, or the cookie that /login sets (compared in constant
time). Without it the answer is 401 and says how to authenticate: in JSON, or
as a page for a browser. With TLS the endpoint speaks HTTPS only, with the
master's certificate (and the cookie is Secure).

Handlers run on the loop that owns the master's state, so a scrape reads a
consistent state without a lock.

Lives in the master service process.
"""

from __future__ import annotations

import errno
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dlfleet.api.errors import DlfleetError
from dlfleet.api.serving.ports import Endpoint, PortInUse
from dlfleet.api.serving.tokens import JOB_TOKEN_REFUSAL, token_matches
from dlfleet.master.service.dashboard import Dashboard, wants_html
from dlfleet.master.service.timeline import Timeline

TOKEN_HEADER = "X-Dlfleet-Token"
TOKEN_COOKIE = "dlfleet_token"
OPEN_PATHS = frozenset({"/healthz", "/login"})
OPEN_PREFIX = "/static/"  # the dashboard's files: no job data in them
ENDPOINTS = ("/healthz", "/metrics", "/api/v1/status", "/api/v1/events")
EVENTS_LIMIT = 1_000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class HttpSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    open_metrics: bool = False  # /metrics without the token (for a scraper)


def tls_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A server context from PEM bytes (ssl reads only files: a private
    temporary folder holds them while they load)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory(prefix="dlfleet-tls-") as folder:
        cert_file, key_file = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert_file.write_bytes(cert)
        key_file.touch(mode=0o600)
        key_file.write_bytes(key)
        try:
            context.load_cert_chain(cert_file, key_file)
        except ssl.SSLError as exc:
            raise DlfleetError(f"the HTTP endpoint cannot use the TLS pair: {exc}") from None
    return context


class HttpEndpoint:
    """Serves the routes above on `settings.host:settings.port`."""

    def __init__(
        self,
        settings: HttpSettings,
        *,
        token: str,
        registry: CollectorRegistry,
        status: Callable[[], dict[str, Any]],
        tls: tuple[bytes, bytes] | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        if not token:
            raise DlfleetError("the HTTP endpoint needs a non-empty job token")
        self.settings = settings
        self._token = token.encode()
        self._registry = registry
        self._status = status
        self._tls = tls
        self._timeline = timeline if timeline is not None else Timeline()
        self._dashboard: Dashboard | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    @property
    def url(self) -> str:
        host = self.settings.host
        shown = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{shown}:{self.port}"

    async def start(self) -> int:
        dashboard = self._dashboard = Dashboard.from_package()
        app = web.Application(middlewares=[self._authenticate])
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/login", self._login),
                web.get("/", self._index),
                web.get(OPEN_PREFIX + "{name}", dashboard.static),
                web.get("/metrics", self._metrics),
                web.get("/api/v1/status", self._api_status),
                web.get("/api/v1/events", self._api_events),
            ]
        )
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        context = tls_context(*self._tls) if self._tls is not None else None
        site = web.TCPSite(runner, self.settings.host, self.settings.port, ssl_context=context)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(Endpoint.HTTP, self.settings.host, self.settings.port) from None
            address = f"{self.settings.host}:{self.settings.port}"
            raise DlfleetError(f"could not bind the HTTP endpoint to {address}: {exc}") from None
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------ auth

    def _authenticated(self, request: web.Request) -> bool:
        given = request.headers.get(TOKEN_HEADER)
        authorization = request.headers.get("Authorization", "")
        if given is None and authorization.startswith("Bearer "):
            given = authorization.removeprefix("Bearer ").strip()
        if given is None:
            given = request.cookies.get(TOKEN_COOKIE)
        return token_matches(given, self._token)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if (
            path in OPEN_PATHS
            or path.startswith(OPEN_PREFIX)
            or (path == "/metrics" and self.settings.open_metrics)
            or self._authenticated(request)
        ):
            return await handler(request)
        if wants_html(request) and self._dashboard is not None:
            return self._dashboard.login_page(request)
        return web.json_response(
            {
                "error": JOB_TOKEN_REFUSAL,
                "how": f"send `Authorization: Bearer <token>` or `{TOKEN_HEADER}: <token>`, "
                "or open /login?token=<token> once in a browser",
            },
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="dlfleet"'},
        )

    # ------------------------------------------------------------ routes

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")

    async def _login(self, request: web.Request) -> web.StreamResponse:
        given = request.query.get("token", "")
        if not token_matches(given, self._token):
            return web.json_response({"error": "wrong job token"}, status=401)
        # no-store: the address with the token is not kept in a cache.
        response = web.Response(status=302, headers={"Location": "/", "Cache-Control": "no-store"})
        response.set_cookie(
            TOKEN_COOKIE,
            given,
            httponly=True,
            samesite="Strict",
            secure=self._tls is not None,
        )
        return response

    async def _index(self, request: web.Request) -> web.StreamResponse:
        if wants_html(request) and self._dashboard is not None:
            return self._dashboard.page(request)
        return web.json_response({"endpoints": list(ENDPOINTS)})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _api_status(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self._status())

    async def _api_events(self, request: web.Request) -> web.StreamResponse:
        """{"events": [...], "last_seq": N}: poll again with since=last_seq. A
        last_seq below the `since` asked for means a new master (a new
        timeline): read it from 0."""
        try:
            since = int(request.query.get("since", "0"))
            limit = int(request.query.get("limit", str(EVENTS_LIMIT)))
        except ValueError:
            return web.json_response({"error": "since and limit must be integers"}, status=400)
        if since < 0 or not 1 <= limit <= EVENTS_LIMIT:
            return web.json_response(
                {"error": f"since must be >= 0 and limit in 1..{EVENTS_LIMIT}"}, status=400
            )
        entries = self._timeline.since(since, limit)
        last = entries[-1].seq if entries else self._timeline.last_seq
        return web.json_response(
            {"events": [entry.to_json() for entry in entries], "last_seq": last}
        )

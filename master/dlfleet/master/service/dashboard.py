"""The live dashboard the master's HTTP endpoint serves to a browser at `/`:
one HTML page, its stylesheet and its script, shipped in the package
(`static/`) and served as they are; no build step, nothing from a CDN.

The files hold no job data, so they are open to anyone who reaches the
endpoint (the login page needs its stylesheet before there is a cookie); the
page reads the job from `/api/v1/status` and `/api/v1/events`, which need
the token, with the cookie that `/login` sets. The page's script never puts
the token in a URL.

Each file is read once, when the endpoint starts, and carries an ETag: a
browser revalidates (Cache-Control: no-cache) and gets 304 while the file is
the same, the new file after an upgrade.

Lives in the master service process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from aiohttp import web

PAGE = "dashboard.html"
LOGIN_PAGE = "login.html"
CONTENT_TYPES = {
    ".html": "text/html",
    ".css": "text/css",
    ".js": "text/javascript",
}
# The pages run their own files and talk to their own origin only.
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": PAGE_POLICY,
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str  # quoted, as the header carries it


def wants_html(request: web.Request) -> bool:
    """A browser navigating (it asks for HTML first), not a script or curl."""
    return "text/html" in request.headers.get("Accept", "")


class Dashboard:
    """The files of `static/`, by name, ready to serve."""

    def __init__(self, assets: dict[str, Asset]) -> None:
        missing = {PAGE, LOGIN_PAGE} - set(assets)
        if missing:
            raise ValueError(f"the dashboard lacks {sorted(missing)}")
        self._assets = assets

    @classmethod
    def from_package(cls) -> Dashboard:
        folder = resources.files(__package__ or "dlfleet.master.service") / "static"
        assets: dict[str, Asset] = {}
        for entry in folder.iterdir():
            suffix = "." + entry.name.rpartition(".")[2]
            if entry.is_file() and suffix in CONTENT_TYPES:
                body = entry.read_bytes()
                etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
                assets[entry.name] = Asset(body, CONTENT_TYPES[suffix], etag)
        return cls(assets)

    def page(self, request: web.Request) -> web.StreamResponse:
        return self._serve(request, PAGE)

    def login_page(self, request: web.Request) -> web.StreamResponse:
        """What a browser gets without the token: how to log in (401)."""
        asset = self._assets[LOGIN_PAGE]
        return web.Response(
            status=401,
            body=asset.body,
            content_type=asset.content_type,
            charset="utf-8",
            headers={**PAGE_HEADERS, "Cache-Control": "no-store"},
        )

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in self._assets or name.endswith(".html"):
            raise web.HTTPNotFound()
        return self._serve(request, name)

    def _serve(self, request: web.Request, name: str) -> web.StreamResponse:
        asset = self._assets[name]
        headers = {**PAGE_HEADERS, "ETag": asset.etag}
        if request.headers.get("If-None-Match") == asset.etag:
            return web.Response(status=304, headers=headers)
        return web.Response(
            body=asset.body, content_type=asset.content_type, charset="utf-8", headers=headers
        )

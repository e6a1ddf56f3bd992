"""The master serves its dashboard through real HTTP to a real master on
127.0.0.1:0: a browser gets the page at `/` with its stylesheet and script
(open static files, revalidated by ETag), a browser without the token gets a
page that says how to log in, and the data the page reads stays behind the
token. The page itself runs in a browser in tests/e2e/test_dashboard_browser.py."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import TOKEN, Running, make_cert

from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.http_api import HttpSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
Answer = tuple[int, dict[str, str], bytes]


def get(
    url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None
) -> Answer:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            return int(answer.status), dict(answer.headers.items()), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers.items()), error.read()


def base(running: Running) -> str:
    assert running.server.http is not None
    return str(running.server.http.url)


def test_a_browser_with_the_token_gets_the_page_and_its_assets(
    start_master: Callable[..., Running],
) -> None:
    url = base(start_master(http=HttpSettings()))
    status, headers, body = get(url + "/", {"Accept": BROWSER, "Cookie": f"dlfleet_token={TOKEN}"})
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    policy = headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert headers["Referrer-Policy"] == "no-referrer"
    page = body.decode()
    assets = re.findall(r'(?:href|src)="(/static/[^"]+)"', page)
    assert sorted(assets) == ["/static/dashboard.css", "/static/dashboard.js"]
    assert "<script>" not in page and TOKEN not in page  # no inline script, no token
    kinds = {"/static/dashboard.css": "text/css", "/static/dashboard.js": "text/javascript"}
    for path, kind in kinds.items():
        status, headers, body = get(url + path)  # no token: the files hold no job data
        assert status == 200, path
        assert headers["Content-Type"] == f"{kind}; charset=utf-8"
        assert headers["Cache-Control"] == "no-cache" and body
        again, headers_again, empty = get(url + path, {"If-None-Match": headers["ETag"]})
        assert (again, empty, headers_again["ETag"]) == (304, b"", headers["ETag"])
    script = get(url + "/static/dashboard.js")[2].decode()
    assert "/api/v1/status" in script and "/api/v1/events" in script
    assert 'credentials: "same-origin"' in script  # the cookie, never a token in a URL


def test_a_script_still_gets_the_endpoint_list_at_the_root(
    start_master: Callable[..., Running],
) -> None:
    url = base(start_master(http=HttpSettings()))
    status, headers, body = get(url + "/", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert "/api/v1/status" in json.loads(body)["endpoints"]


def test_a_browser_without_the_token_is_told_how_to_log_in(
    start_master: Callable[..., Running],
) -> None:
    url = base(start_master(http=HttpSettings()))
    for cookie in ({}, {"Cookie": "dlfleet_token=wrong"}):
        status, headers, body = get(url + "/", {"Accept": BROWSER, **cookie})
        assert status == 401
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert "/login?token=" in body.decode()
    for path in ("/api/v1/status", "/api/v1/events"):  # what the page fetches
        status, headers, body = get(url + path, {"Accept": "application/json"})
        assert status == 401 and "job token" in json.loads(body)["error"]


def test_static_serves_only_the_dashboards_files(start_master: Callable[..., Running]) -> None:
    url = base(start_master(http=HttpSettings()))
    for name in ("nope.js", "dashboard.html", "login.html", "..%2Fhttp_api.py", "%2e%2e"):
        assert get(url + "/static/" + name)[0] == 404, name


def test_login_is_not_cached_and_lands_on_the_dashboard(
    start_master: Callable[..., Running],
) -> None:
    url = base(start_master(http=HttpSettings()))

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    with pytest.raises(urllib.error.HTTPError) as raised:
        opener.open(url + f"/login?token={TOKEN}", timeout=10)
    assert raised.value.code == 302
    assert raised.value.headers["Location"] == "/"
    assert raised.value.headers["Cache-Control"] == "no-store"


def test_the_status_names_each_nodes_ranks_in_the_active_round(
    start_master: Callable[..., Running],
) -> None:
    settings = MasterSettings(
        job_name="job", rendezvous=RendezvousSettings(min_nodes=1, max_nodes=1)
    )
    running = start_master(settings, http=HttpSettings())
    client = running.client
    node = client.register_node(job_name="job", node_name="node-a", local_world_size=2)
    status, _, body = get(base(running) + "/api/v1/status", {"X-Dlfleet-Token": TOKEN})
    assert json.loads(body)["nodes"][0]["ranks"] == []
    client.join_rendezvous(
        node_id=node.node_id,
        incarnation=node.incarnation,
        local_world_size=2,
        host="127.0.0.1",
        bootstrap_port=29500,
        timeout_s=20,
    )
    status, _, body = get(base(running) + "/api/v1/status", {"X-Dlfleet-Token": TOKEN})
    assert status == 200
    assert json.loads(body)["nodes"][0]["ranks"] == [0, 1]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_tls_master_serves_the_dashboard_over_https_with_a_secure_cookie(
    tmp_path: Path, start_master: Callable[..., Running]
) -> None:
    from dlfleet.api.serving.tls import load_tls_pair

    cert, key = make_cert(tmp_path, "master")
    running = start_master(http=HttpSettings(), tls=load_tls_pair(cert, key))
    url = base(running)
    assert url.startswith("https://")
    verified = ssl.create_default_context(cafile=str(cert))
    connection = http.client.HTTPSConnection(
        "127.0.0.1", running.server.http.port, timeout=10, context=verified
    )
    connection.request("GET", f"/login?token={TOKEN}")
    answer = connection.getresponse()
    answer.read()
    cookie = answer.getheader("Set-Cookie") or ""
    assert answer.status == 302 and "Secure" in cookie and "HttpOnly" in cookie
    connection.close()
    browser = {"Accept": BROWSER, "Cookie": cookie.split(";")[0]}
    status, _, body = get(url + "/", browser, context=verified)
    assert status == 200 and b"/static/dashboard.js" in body
    # The page names its files and data by path only: they come over TLS too.
    assert b"http://" not in body and b"https://" not in body
    script = get(url + "/static/dashboard.js", context=verified)[2]
    assert b"http://" not in script.replace(b"http://www.w3.org/2000/svg", b"")

"""The master's HTTP endpoint through real HTTP requests to a real master on
127.0.0.1:0: who may read what, `/metrics` parsed as Prometheus would while
shards are leased and acknowledged, `/api/v1/status` against its schema, and
HTTPS when the master serves TLS."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from harness import TOKEN, Running, make_cert
from prometheus_client.parser import text_string_to_metric_families

from dlfleet.api.status_document import SCHEMA_PATH
from dlfleet.api.v1 import rendezvous_pb2, shards_pb2
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.http_api import HttpSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(
    url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def base(running: Running) -> str:
    assert running.server.http is not None
    return str(running.server.http.url)


def scrape(running: Running) -> Samples:
    status, text = get(base(running) + "/metrics", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def status_document(running: Running) -> dict[str, Any]:
    status, text = get(base(running) + "/api/v1/status", {"X-Dlfleet-Token": TOKEN})
    assert status == 200, text
    data: dict[str, Any] = json.loads(text)
    return data


def schema() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return data


def test_everything_but_healthz_needs_the_job_token(start_master: Callable[..., Running]) -> None:
    running = start_master(http=HttpSettings())
    url = base(running)
    assert get(url + "/healthz") == (200, "ok\n")
    for path in ("/", "/metrics", "/api/v1/status", "/api/v1/events"):
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"X-Dlfleet-Token": "wrong"},
            {"Cookie": "dlfleet_token=wrong"},
        ):
            status, text = get(url + path, headers)
            assert status == 401, (path, headers)
            assert "job token" in json.loads(text)["error"]
        assert get(url + path, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert get(url + path, {"X-Dlfleet-Token": TOKEN})[0] == 200


def test_login_sets_a_cookie_that_opens_the_other_endpoints(
    start_master: Callable[..., Running],
) -> None:
    running = start_master(http=HttpSettings())
    port = running.server.http.port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/login?token=wrong")
    refused = connection.getresponse()
    refused.read()
    assert refused.status == 401
    assert refused.getheader("Set-Cookie") is None
    connection.request("GET", f"/login?token={TOKEN}")
    answer = connection.getresponse()
    answer.read()
    assert answer.status == 302
    assert answer.getheader("Location") == "/"
    cookie = answer.getheader("Set-Cookie") or ""
    assert cookie.startswith(f"dlfleet_token={TOKEN};")
    assert "HttpOnly" in cookie
    connection.close()
    status, _ = get(base(running) + "/api/v1/status", {"Cookie": cookie.split(";")[0]})
    assert status == 200


def test_metrics_can_be_left_open_for_a_scraper(start_master: Callable[..., Running]) -> None:
    running = start_master(http=HttpSettings(open_metrics=True))
    assert get(base(running) + "/metrics")[0] == 200
    assert get(base(running) + "/api/v1/status")[0] == 401


def test_metrics_move_as_shards_are_leased_and_acknowledged(
    start_master: Callable[..., Running],
) -> None:
    running = start_master(http=HttpSettings())
    client = running.client
    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=40, batch_size=5, shard_size=10, epochs=1)
    )
    first = scrape(running)
    assert value(first, "dlfleet_dataset_records_expected", dataset="data") == 40
    assert value(first, "dlfleet_shards_done_total", dataset="data") == 0
    held: list[int] = []
    done = 0
    while True:
        resp = client.lease("data", node_id="n", rank=0, done=held)
        if resp.WhichOneof("outcome") != "shard":
            break
        done += len(held)
        held = [resp.shard.lease_id]
        samples = scrape(running)
        assert value(samples, "dlfleet_shards_done_total", dataset="data") == done
        assert value(samples, "dlfleet_dataset_leases_active", dataset="data") == 1
    last = scrape(running)
    assert value(last, "dlfleet_shards_done_total", dataset="data") == 4
    assert value(last, "dlfleet_dataset_records_done", dataset="data") == 40
    assert value(last, "dlfleet_rpc_requests_total", method="Lease", code="OK") == 5


def test_status_is_the_documented_job_status(start_master: Callable[..., Running]) -> None:
    running = start_master(http=HttpSettings())
    client = running.client
    empty = status_document(running)
    jsonschema.validate(empty, schema())
    assert empty["job_name"] == "job"
    assert empty["phase"] == "running"
    assert empty["nodes"] == []

    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=40, batch_size=5, shard_size=10, epochs=2)
    )
    node = client.register_node(
        job_name="job", node_name="node-a", local_world_size=1, host="127.0.0.1"
    )
    client.report_worker_failure(
        rendezvous_pb2.FailureReport(
            node_id=node.node_id, incarnation=node.incarnation, exit_code=1, message="boom"
        )
    )
    document = status_document(running)
    jsonschema.validate(document, schema())
    assert document["nodes"] == [
        {
            "name": "node-a",
            "state": "running",
            "pid": 0,
            "relaunches": 0,
            "node_id": node.node_id,
            "detail": "",
            "memory_bytes": 0,
            "ranks": [],
        }
    ]
    assert document["datasets"][0]["records_total"] == 80  # int64: a number, not "80"
    assert document["round"] == 0
    assert document["last_failure"]["message"] == "boom"
    assert value(scrape(running), "dlfleet_worker_failures_total", reason="exit") == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_tls_master_serves_https_with_its_certificate(
    tmp_path: Path, start_master: Callable[..., Running]
) -> None:
    from dlfleet.api.serving.tls import load_tls_pair

    cert, key = make_cert(tmp_path, "master")
    running = start_master(http=HttpSettings(), tls=load_tls_pair(cert, key))
    url = base(running)
    assert url.startswith("https://127.0.0.1:")
    verified = ssl.create_default_context(cafile=str(cert))
    assert get(url + "/healthz", context=verified) == (200, "ok\n")
    assert get(url + "/metrics", {"X-Dlfleet-Token": TOKEN}, context=verified)[0] == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP is refused
        get(url.replace("https", "http") + "/healthz")


def test_dlmaster_http_port_serves_and_prints_its_address_before_listening(
    tmp_path: Path,
) -> None:
    args = [sys.executable, "-m", "dlfleet.master", "--port", "0", "--http-port", "0"]
    args += ["--store", f"sqlite:///{tmp_path / 'm.db'}", "--log-level", "WARNING"]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DLFLEET_TOKEN": TOKEN},
    )
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        match = re.fullmatch(r"dlmaster: http on (http://127\.0\.0\.1:\d+)\n", first)
        assert match, first
        assert second.startswith("dlmaster: listening on 127.0.0.1:"), second
        url = match.group(1)
        assert get(url + "/healthz") == (200, "ok\n")
        assert get(url + "/metrics")[0] == 401
        status, text = get(url + "/metrics", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        assert "dlfleet_rendezvous_round 0.0" in text
    finally:
        proc.terminate()
        proc.wait(10)


def events(running: Running, query: str = "") -> dict[str, Any]:
    status, text = get(base(running) + "/api/v1/events" + query, {"X-Dlfleet-Token": TOKEN})
    assert status == 200, text
    data: dict[str, Any] = json.loads(text)
    return data


def test_events_are_a_timeline_of_rounds_failures_and_lost_nodes(
    start_master: Callable[..., Running],
) -> None:
    settings = MasterSettings(
        job_name="job", rendezvous=RendezvousSettings(min_nodes=1, max_nodes=1)
    )
    running = start_master(settings, http=HttpSettings())
    client = running.client
    assert events(running) == {"events": [], "last_seq": 0}
    node = client.register_node(job_name="job", node_name="node-a", local_world_size=2)
    joined = client.join_rendezvous(
        node_id=node.node_id,
        incarnation=node.incarnation,
        local_world_size=2,
        host="127.0.0.1",
        bootstrap_port=29500,
        timeout_s=20,
    )
    client.report_worker_failure(
        rendezvous_pb2.FailureReport(
            node_id=node.node_id,
            incarnation=node.incarnation,
            round=joined.round,
            exit_code=-9,
            signal="SIGKILL",
            message="Traceback ...\nKilled",
        )
    )
    client.deregister_node(node.node_id, node.incarnation)
    timeline = events(running)
    kinds = [(e["seq"], e["kind"]) for e in timeline["events"]]
    assert kinds == [
        (1, "node_registered"),
        (2, "round_formed"),
        (3, "worker_failed"),
        (4, "node_lost"),
        (5, "round_closed"),
    ]
    registered, formed, failed, lost, closed = timeline["events"]
    assert timeline["last_seq"] == 5
    assert registered["node_id"] == node.node_id
    assert formed["round"] == joined.round and formed["world_size"] == 2
    assert formed["nodes"] == [node.node_id]
    assert (failed["reason"], failed["signal"], failed["message"]) == (
        "SIGKILL",
        "SIGKILL",
        "Killed",
    )
    assert (lost["node_id"], lost["reason"]) == (node.node_id, "deregistered")
    assert closed["round"] == joined.round and closed["reason"]
    assert all(e["at_ms"] > 0 for e in timeline["events"])

    assert [e["seq"] for e in events(running, "?since=3")["events"]] == [4, 5]
    assert events(running, "?since=1&limit=2")["last_seq"] == 3
    assert events(running, "?since=5") == {"events": [], "last_seq": 5}
    status, _ = get(base(running) + "/api/v1/events?since=x", {"X-Dlfleet-Token": TOKEN})
    assert status == 400

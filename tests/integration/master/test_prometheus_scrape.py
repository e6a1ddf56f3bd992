"""A real Prometheus server (Debian's `prometheus`, which scripts/setup.sh
installs) scrapes a real job: `dlmaster --job-config` with a dlworker whose
training process leases shards, on 127.0.0.1. Prometheus authenticates with
the job token (`authorization: {credentials: ...}`) every second, and PromQL
through its HTTP API sees the job's records done grow and its world size."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import JobProcess, missing

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "prometheus-scrape-test-token-0123456789"

# A training process without torch: it leases a shard every 20 ms,
# acknowledging the last with the next request, until the test drops `stop`.
WORKER = textwrap.dedent(
    """
    import os, sys, time
    from dlfleet.api.client import MasterClient
    from dlfleet.api.v1 import shards_pb2
    from dlfleet.worker import progress
    stop, env = sys.argv[1], os.environ
    client = MasterClient(env["DLFLEET_MASTER"], token=env["DLFLEET_TOKEN"])
    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=1_000_000, batch_size=1, shard_size=10, epochs=1)
    )
    held = []
    while not os.path.exists(stop):
        resp = client.lease("data", node_id=env["DLFLEET_NODE_ID"], rank=0, done=held)
        held = [resp.shard.lease_id] if resp.WhichOneof("outcome") == "shard" else []
        time.sleep(0.02)
        progress.step(10)
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prometheus_binary() -> str:
    """The binary; a skip where it is truly absent, but never in CI."""
    found = shutil.which("prometheus")
    if found is None:
        missing("the prometheus binary is not installed (scripts/setup.sh installs it as root)")
    return found


class Prometheus:
    """`prometheus` on 127.0.0.1:`port` with a temporary config and storage."""

    def __init__(self, root: Path, target: str) -> None:
        self.port = free_port()
        self.log = root / "prometheus.log"
        config = root / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "dlfleet",
                            "scrape_interval": "1s",
                            "scrape_timeout": "1s",
                            "authorization": {"credentials": TOKEN},
                            "static_configs": [{"targets": [target]}],
                        }
                    ],
                }
            )
        )
        self.argv = [
            prometheus_binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of `promql` now (an empty list if none)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log.read_text()[-3000:]}")
            try:
                if predicate():
                    return
            except (OSError, urllib.error.URLError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout_s:g}s waiting for {what}; targets: {self.targets()}"
                )
            time.sleep(0.25)

    def targets(self) -> str:
        try:
            url = f"http://127.0.0.1:{self.port}/api/v1/targets"
            with urllib.request.urlopen(url, timeout=5) as answer:
                return str(answer.read()[:2000])
        except OSError as exc:
            return f"(unreadable: {exc})"


class ScrapedJob(JobProcess):
    """One node of one training process, its HTTP endpoint on a known port."""

    def __init__(self, root: Path) -> None:
        (root / "worker.py").write_text(WORKER)
        self.http_port = free_port()
        super().__init__(
            root,
            {
                "name": "scraped",
                "command": "worker.py",
                "args": [str(root / "stop")],
                "nodes": {"min": 1, "max": 1},
                "nproc_per_node": 1,
                "token": TOKEN,
                "display": "plain",
                "brain": {"mode": "off"},
                "rendezvous": {"last_call_timeout_s": 0.2},
                "heartbeat": {"interval_s": 0.5, "timeout_s": 5},
                "http": {"host": "127.0.0.1", "port": self.http_port},
            },
        )


@pytest.fixture
def job(tmp_path: Path) -> Iterator[ScrapedJob]:
    job = ScrapedJob(tmp_path)
    yield job
    job.kill()


@pytest.fixture
def prometheus(tmp_path: Path, job: ScrapedJob) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path, f"127.0.0.1:{job.http_port}")
    yield server
    server.stop()


def test_prometheus_scrapes_a_running_job_with_its_token(
    job: ScrapedJob, prometheus: Prometheus
) -> None:
    job.start()
    prometheus.start()

    def round_with_data() -> bool:
        status = job.status()
        return bool(status["world_size"] == 1 and status["datasets"])

    job.wait_for(round_with_data, "a round whose worker registered its dataset", 60)

    def up() -> bool:
        return prometheus.value('up{job="dlfleet"}') == 1

    prometheus.wait_for(up, "the job's master scraped with the token", 30)

    def records_done() -> bool:
        done = prometheus.value('sum(dlfleet_dataset_records_done{job="dlfleet"})')
        return done is not None and done > 0

    prometheus.wait_for(records_done, "records done > 0 through PromQL", 30)
    assert prometheus.value('dlfleet_world_size{job="dlfleet"}') == 1
    assert prometheus.value('dlfleet_nodes{job="dlfleet",state="in_round"}') == 1
    # Counters work as counters: the rate of acknowledged shards is positive.
    prometheus.wait_for(
        lambda: (
            (prometheus.value('sum(rate(dlfleet_shards_done_total{job="dlfleet"}[5s]))') or 0) > 0
        ),
        "a positive rate of shards done",
        30,
    )
    (job.root / "stop").write_text("")
    code, _, err = job.finish(timeout=60)
    assert code == 0, err[-3000:]

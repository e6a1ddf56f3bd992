"""`dlbrain` as a real subprocess: serve (health, persist, plan), stop on
SIGTERM, report (text and SVG), migrate, and clear errors for bad flags."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlfleet.brain.client import RemoteBrain
from dlfleet.brain.records import JobInfo, MetricsBatch, PlanKind, PlanRequest, RoundMetrics

pytestmark = pytest.mark.integration

# The installed entry point where there is one (an editable install), else the module.
_SCRIPT = Path(sys.executable).parent / "dlbrain"
DLBRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "dlfleet.brain.cli"]
JOB = JobInfo(name="cli-job", signature="sig", min_nodes=1, max_nodes=4)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DLBRAIN, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'brain.db'}"


@pytest.fixture
def service(tmp_path: Path, db_url: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    token_file = tmp_path / "token"
    token_file.write_text("cli-token\n")
    proc = subprocess.Popen(
        [*DLBRAIN, "--db", db_url, "--port", "0", "--token-file", str(token_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(r"listening on (\S+):(\d+)", line)
    if found is None:
        proc.kill()
        pytest.fail(f"dlbrain did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    yield proc, f"127.0.0.1:{found.group(2)}"
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def test_serve_persist_plan_report_and_stop(
    service: tuple[subprocess.Popen[str], str], db_url: str, tmp_path: Path
) -> None:
    proc, address = service
    t = time.time_ns() // 1_000_000
    with RemoteBrain(address, token="cli-token") as client:
        client.wait_ready(timeout_s=10)
        client.persist(
            MetricsBatch(
                JOB.name,
                JOB,
                [
                    RoundMetrics(1, 1, 2, t - 200_000, t - 100_000, 50.0),
                    RoundMetrics(2, 2, 4, t - 100_000, t, 98.0),
                ],
            )
        )
        plan = client.plan(PlanRequest(JOB, nodes=2))
        assert (plan.kind, plan.target_nodes) == (PlanKind.SCALE, 4)
        client.mark_applied(plan.id)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0

    svg = tmp_path / "chart.svg"
    done = run("report", JOB.name, "--db", db_url, "--svg", str(svg))
    assert done.returncode == 0, done.stderr
    assert "job cli-job (signature sig, running, nodes 1..4)" in done.stdout
    assert "     2      4       1         98.0       49.0        0.98" in done.stdout
    assert "scale 2 -> 4 nodes (applied" in done.stdout
    assert "scale up from 2 to 4 nodes" in done.stdout
    ET.parse(svg)


def test_report_of_an_unknown_job_fails_with_the_reason(db_url: str) -> None:
    done = run("report", "ghost", "--db", db_url)
    assert done.returncode == 1
    assert "no job 'ghost'" in done.stderr


def test_migrate_prints_the_revision(db_url: str) -> None:
    done = run("migrate", "--db", db_url)
    assert done.returncode == 0, done.stderr
    assert "schema at revision 0002" in done.stdout  # the newest migration


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "1"], "no token"),
        (["--port", "70000", "--token", "t"], "not a port"),
        (["--token", "t", "--token-file", "f"], "not both"),
        (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token"),
        (["--token", "t", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_bad_flags_exit_2_naming_the_problem(args: list[str], message: str) -> None:
    done = run(*args, env={"DLFLEET_BRAIN_TOKEN": ""})
    assert done.returncode == 2
    assert message in done.stderr


def test_an_unusable_database_exits_1_without_its_password() -> None:
    done = run("--db", "postgresql+psycopg://u:s3cret@127.0.0.1:1/x", "--token", "t", "--port", "0")
    assert done.returncode == 1
    assert "127.0.0.1:1" in done.stderr and "s3cret" not in done.stderr

"""`dlmaster`'s command line: bad flags, or a port in use, exit 2 naming the
problem; nothing starts. `dlmaster status|scale` at a master that cannot
answer them says why."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import MasterProcess

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-nodes", "3", "--max-nodes", "2"], "max_nodes (2) must be at least min_nodes (3)"),
        (["--node-unit", "2", "--min-nodes", "3", "--max-nodes", "3"], "no multiple of node_unit"),
        (["--heartbeat-interval", "5", "--heartbeat-timeout", "2"], "longer than"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--http-port", "-1"], "--http-port must be in 0..65535"),
        (["--lease-timeout", "0"], "must be > 0"),
        (["--token", ""], "no job token"),
        (["--min-nodes", "two"], "invalid int value"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DLFLEET_TOKEN"}
    token = [] if "--token" in flags else ["--token", "t"]
    store = ["--store", f"sqlite:///{tmp_path / 'm.db'}"]
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", *token, *store, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "m.db").exists(), "nothing may start on bad flags"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_port_in_use_exits_2_with_one_line_naming_the_port_and_its_flag(
    flag: str, taken_port: int, tmp_path: Path
) -> None:
    store = ["--store", f"sqlite:///{tmp_path / 'm.db'}"]
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", "--token", "t", *store, flag, str(taken_port)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr  # no traceback, no gRPC log line
    assert f"127.0.0.1:{taken_port}: the port is in use ({flag} {taken_port})" in done.stderr
    assert not (tmp_path / "m.db").exists(), "nothing may start on a port in use"


@pytest.mark.parametrize("command", [["status"], ["scale", "--nodes", "2"]])
def test_status_and_scale_at_a_master_started_alone_say_it_runs_no_job_supervisor(
    command: list[str], master_process: Callable[..., MasterProcess], tmp_path: Path
) -> None:
    master = master_process(f"sqlite:///{tmp_path / 'm.db'}")
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", *command, "--master", master.address],
        env={**os.environ, "DLFLEET_TOKEN": master.token},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"{master.address} is a master without a job supervisor" in done.stderr
    assert "dlmaster --job-config job.yaml" in done.stderr

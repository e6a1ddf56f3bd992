"""A node check's verdict is said once in a job's output: by the node's
agent, which acts on it. The master (which decides it) and the check process
(which receives it) say a healthy verdict only at DEBUG, so a job of two
nodes does not print each verdict three times.

A real master (in process), two registered nodes, and their agents' real
`run_check`: each starts a real check process (`python -m
dlfleet.worker.nodecheck`, torch on CPU), whose stderr is this process's."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import TOKEN, Running

from dlfleet.api.client import MasterClient
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.node_check import NodeCheckSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.state import MasterSettings
from dlfleet.worker.agent.node_check import CheckOutcome, run_check

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def settings() -> MasterSettings:
    return MasterSettings(
        job_name="job",
        rendezvous=RendezvousSettings(min_nodes=1, max_nodes=2, last_call_timeout_ms=100),
        liveness=LivenessSettings(heartbeat_interval_ms=200, heartbeat_timeout_ms=10_000),
        node_check=NodeCheckSettings(expected_nodes=2, step_timeout_ms=30_000),
    )


def check_node(address: str, name: str, log_dir: Path) -> CheckOutcome:
    client = MasterClient(address, token=TOKEN, timeout_s=30)
    registered = client.register_node(job_name="job", node_name=name, local_world_size=1)
    session = client.agent_session(registered.node_id, registered.incarnation, 0.2)
    try:
        outcome = run_check(
            client,
            token=TOKEN,
            node_id=registered.node_id,
            incarnation=registered.incarnation,
            host="127.0.0.1",
            log_dir=log_dir,
            stop=threading.Event(),
        )
    finally:
        session.close()
        client.close()
    assert outcome is not None
    return outcome


def test_each_healthy_verdict_is_said_once(
    start_master: Callable[..., Running],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    running = start_master(settings())
    caplog.set_level(logging.INFO)
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(check_node, running.address, name, tmp_path / name)
            for name in ("node-a", "node-b")
        ]
        outcomes = [f.result(timeout=100) for f in futures]
    assert all(o.healthy for o in outcomes), outcomes
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    said += capfd.readouterr().err.splitlines()  # the check processes' log lines
    for outcome in outcomes:
        saying = [line for line in said if outcome.reason in line]
        assert len(saying) == 1, saying
        assert saying[0].startswith("node check: healthy after "), saying

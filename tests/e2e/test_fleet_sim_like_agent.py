"""bench/fleet.py's simulated nodes speak to the master as real agents do: a
real `dlworker` runs a job to the end against one master, three simulated nodes
register, open their sessions, form a round and go against another, and each
master's own RPC counters (its Prometheus `/metrics`) say which methods were
called. Every method the simulator calls, the agent calls too; both register,
hold a session and join on it, and neither makes a `Join` call of its own."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import MasterProcess
from prometheus_client.parser import text_string_to_metric_families

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import fleet  # noqa: E402 - bench/ is not a package
from _common import ServerProcess, free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).parent / "scripts" / "allreduce_steps.py"
TOKEN = "test-token"


def methods_called(http_port: int, token: str) -> dict[str, float]:
    """RPCs the master answered, by method (status codes summed)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    calls: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dlfleet_rpc_requests_total":
                method = sample.labels["method"]
                calls[method] = calls.get(method, 0.0) + sample.value
    return {method: count for method, count in calls.items() if count > 0}


def test_the_simulators_nodes_call_only_what_a_real_agent_calls(
    tmp_path: Path, master_process: Callable[..., MasterProcess]
) -> None:
    # A real agent, its job run to the end.
    agent_http = free_port()
    master = master_process(
        f"sqlite:///{tmp_path / 'agent.db'}",
        "--min-nodes", "1", "--max-nodes", "1", "--last-call-timeout", "0.1",
        "--http-port", str(agent_http),
    )  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    argv = [
        sys.executable, "-m", "dlfleet.worker.agent.loop",
        "--nnodes", "1:1", "--nproc-per-node", "1", "--monitor-interval", "0.1",
        "--master", master.address, "--node-name", "real",
        "--log-dir", str(tmp_path / "logs"), str(SCRIPT), str(out), "2", "0.01",
    ]  # fmt: skip
    done = subprocess.run(
        argv, check=False, env={**os.environ, "DLFLEET_TOKEN": TOKEN},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 20
    while (agent := methods_called(agent_http, TOKEN)).get("Session", 0) < 1:
        assert time.monotonic() < deadline, f"the agent's session never counted: {agent}"
        time.sleep(0.1)

    # Three simulated nodes, formed into a round, then gone. Without the
    # bench's probes: their unary Heartbeat calls time the master's loop.
    sim_http = free_port()
    args = argparse.Namespace(
        procs=1, probes=0, interval=1.0, timeout=10.0, cap=60.0, settle=0, window=0,
        master_log_level="WARNING", profile=None,
    )  # fmt: skip
    sim = fleet.Fleet(args, tmp_path, "sqlite", 3)
    port = free_port()
    argv = fleet.master_argv(port, f"sqlite:///{tmp_path / 'sim.db'}", 3, args, sim.token)
    server = ServerProcess(
        "dlmaster",
        [*argv, "--http-port", str(sim_http)],
        tmp_path / "sim-master.log",
        f"listening on 127.0.0.1:{port}",
    )
    try:
        server.wait_ready(port, 60.0)
        fleet.start_fleet(sim, f"127.0.0.1:{port}", fleet.Level("sqlite", 3))
        fleet.form(sim, server, fleet.Level("sqlite", 3))  # validates the round
        for proc in sim.procs:
            proc.stop()  # their sessions end: a stream is counted when it ends
        deadline = time.monotonic() + 20
        while (simulated := methods_called(sim_http, sim.token)).get("Session", 0) < 3:
            assert time.monotonic() < deadline, f"sessions never counted: {simulated}"
            time.sleep(0.1)
    finally:
        for proc in sim.procs:
            proc.stop()
        server.stop()

    assert {"Register", "Session"} <= set(simulated), simulated
    assert set(simulated) <= set(agent), f"the simulator calls {simulated}, an agent {agent}"
    assert "Join" not in agent and "Join" not in simulated, (agent, simulated)

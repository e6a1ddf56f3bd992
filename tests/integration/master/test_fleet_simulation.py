"""A thousand simulated nodes (bench/fleet.py's simulator) against a real
`dlmaster` process on SQLite: the world forms with every rank once, 1% of the
nodes are SIGKILLed at once, and the survivors are told and form a new world.

Bounded for a 2-core CI machine: two simulator processes plus the 1% one, a
1 s heartbeat, every phase capped at 60 s (the whole test takes about 15 s
here). The simulated nodes speak through the real client (`MasterClient`,
`AgentSession`): the master cannot tell them from agents, which the last
check shows (each node's session carried its metrics, as an agent's does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import fleet  # noqa: E402 - bench/ is not a package
from _common import ServerProcess, free_port  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NODES = 1_000


def test_a_thousand_simulated_nodes_form_lose_one_percent_and_form_again(
    tmp_path: Path,
) -> None:
    from dlfleet.api.client import MasterClient

    args = argparse.Namespace(
        procs=2, probes=fleet.PROBES, interval=1.0, timeout=3.0, cap=60.0, settle=0, window=0,
        master_log_level="WARNING", profile=None,
    )  # fmt: skip
    level = fleet.Level("sqlite", NODES)
    sim = fleet.Fleet(args, tmp_path, "sqlite", NODES)
    port = free_port()
    url = f"sqlite:///{tmp_path / 'master.db'}"
    server = ServerProcess(
        "dlmaster",
        fleet.master_argv(port, url, NODES, args, sim.token),
        tmp_path / "master.log",
        f"listening on 127.0.0.1:{port}",
    )
    started = time.monotonic()
    try:
        server.wait_ready(port, 60.0)
        target = f"127.0.0.1:{port}"
        layout = fleet.start_fleet(sim, target, level)
        round_ = fleet.form(sim, server, level)  # validates: one round, N nodes, ranks 0..N-1
        with MasterClient(target, token=sim.token) as client:
            status = client.master_status()
            assert status.round == round_ and status.round_nodes == NODES
            # A node's metrics come with its next heartbeat after it trains:
            # within a few intervals of the round, every node's are in.
            deadline = time.monotonic() + 10 * args.interval
            while True:
                reporting = {n.node_id for n in status.nodes if n.metrics.samples_per_second > 0}
                if len(reporting) == NODES or time.monotonic() > deadline:
                    break
                time.sleep(args.interval / 2)
                status = client.master_status()
        assert len(reporting) == NODES

        lost = layout[-1][1]
        assert lost == NODES // 100
        killed = time.monotonic()
        sim.procs[-1].kill()
        new_round, pushed, reformed = sim.wait_reformed(round_, NODES - lost, args.cap)
    finally:
        for proc in sim.procs:
            proc.stop()
        server.stop()
    assert new_round > round_
    # A killed agent's stream breaks: no heartbeat timeout is waited for.
    assert pushed - killed < args.timeout
    assert reformed - pushed < 10.0
    assert time.monotonic() - started < 60.0

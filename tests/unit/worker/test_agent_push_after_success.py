"""An agent whose workers have all exited 0 when a re-rendezvous push comes
ends as succeeded instead of joining the next round (a replacement node that
arrives as the job ends would otherwise wait in a round whose leader left);
with its workers still running, the push makes it rejoin.

A real Agent and real worker processes (a script that exits 0 at once, or
sleeps); the master is `fakes.agent.FakeMasterClient`, whose session is where
the test puts the push, as AgentSession's reader puts what the master sends."""

from __future__ import annotations

import time
from pathlib import Path

from fakes.agent import FakeMasterClient, FakeSession

from dlfleet.worker.agent.config import HostProbe, parse_args
from dlfleet.worker.agent.env import RoundAssignment
from dlfleet.worker.agent.loop import Agent
from dlfleet.worker.agent.phases import Rejoining, Running, Succeeded
from dlfleet.worker.agent.workers import GroupStatus, WorkerGroup


def agent_with_workers(tmp_path: Path, seconds: float) -> tuple[Agent, FakeSession, Running]:
    script = tmp_path / "train.py"
    script.write_text(f"import time; time.sleep({seconds})\n")
    probe = HostProbe(hostname=lambda: "n", cpu_count=lambda: 2, accelerator_count=lambda: 0)
    config = parse_args(
        ["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script)],
        {"DLFLEET_MASTER": "127.0.0.1:1", "DLFLEET_TOKEN": "t"},
        probe,
    )
    client = FakeMasterClient()
    agent = Agent(config, client=client)
    session = agent.session = client.agent_session("n#1", 1, 0.1)
    session.round = 1
    agent.group = WorkerGroup()
    agent.group.start(config, [{}, {}], tmp_path / "logs", 1)
    assignment = RoundAssignment(
        round=1,
        group_rank=0,
        group_world_size=2,
        world_size=4,
        local_world_size=2,
        rank_offset=0,
        bootstrap_host="127.0.0.1",
        bootstrap_port=1,
    )
    return agent, session, Running(assignment, restart_count=0)


def test_workers_done_before_the_push_end_the_node_as_succeeded(tmp_path: Path) -> None:
    agent, session, running = agent_with_workers(tmp_path, 0)
    assert agent.group is not None
    deadline = time.monotonic() + 30
    while agent.group.poll().status is not GroupStatus.SUCCEEDED:
        assert time.monotonic() < deadline, "the workers did not exit"
        time.sleep(0.05)
    session.push(closed_round=1, reason="c is waiting")
    assert isinstance(agent._watch(running), Succeeded)
    agent.client.close()


def test_workers_still_running_rejoin_on_the_push(tmp_path: Path) -> None:
    agent, session, running = agent_with_workers(tmp_path, 60)
    session.push(closed_round=1, reason="c is waiting")
    try:
        assert isinstance(agent._watch(running), Rejoining)
    finally:
        agent._stop_workers()
        agent.client.close()

"""The agent keeps its time on the clock it is given and runs its workers in
the group its factory makes: a real Agent over `fakes` (a clock moved by
hand, a worker group without processes, a master answered from memory)."""

from __future__ import annotations

from pathlib import Path

from fakes.agent import FakeMasterClient, FakeSession
from fakes.clock import FakeClock
from fakes.workers import FakeWorkerGroup

from dlfleet.api.v1 import rendezvous_pb2
from dlfleet.worker.agent.config import HostProbe, parse_args
from dlfleet.worker.agent.env import RoundAssignment
from dlfleet.worker.agent.loop import MAX_REGISTRATIONS, Agent
from dlfleet.worker.agent.metrics import NodeSampler
from dlfleet.worker.agent.phases import EXIT_NODE_LOST, Dropped, Failed, Rejoining, Running

ASSIGNMENT = RoundAssignment(
    round=1,
    group_rank=0,
    group_world_size=1,
    world_size=2,
    local_world_size=2,
    rank_offset=0,
    bootstrap_host="127.0.0.1",
    bootstrap_port=1,
)


def running_agent(tmp_path: Path, clock: FakeClock) -> tuple[Agent, FakeSession, FakeWorkerGroup]:
    probe = HostProbe(hostname=lambda: "n", cpu_count=lambda: 2, accelerator_count=lambda: 0)
    config = parse_args(
        ["--nproc-per-node", "2", "--monitor-interval", "0.01", "--log-dir", str(tmp_path), "x.py"],
        {"DLFLEET_MASTER": "127.0.0.1:1", "DLFLEET_TOKEN": "t"},
        probe,
    )
    client = FakeMasterClient()
    agent = Agent(config, client=client, worker_group=FakeWorkerGroup, clock=clock)
    session = agent.session = client.agent_session("n#1", 1, heartbeat_interval_s=2.0)
    group = FakeWorkerGroup()
    group.start(config, [{}, {}], tmp_path, 1)
    agent.group = group
    agent.sampler = NodeSampler(tmp_path, group.pids)
    return agent, session, group


def test_the_workers_are_measured_once_a_heartbeat_on_the_agents_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    agent, session, _ = running_agent(tmp_path, clock)
    running = Running(ASSIGNMENT, restart_count=0)
    agent._watch(running)
    assert session.metrics is not None  # the first watch measures
    session.metrics = None
    clock.advance(1.9)
    agent._watch(running)
    assert session.metrics is None  # within the heartbeat: not again
    clock.advance(0.1)
    agent._watch(running)
    assert isinstance(session.metrics, rendezvous_pb2.NodeMetrics)
    agent.client.close()


def test_a_push_for_the_running_round_stops_its_workers_and_rejoins(tmp_path: Path) -> None:
    agent, session, group = running_agent(tmp_path, FakeClock())
    session.push(closed_round=1, reason="b left")
    phase = agent._watch(Running(ASSIGNMENT, restart_count=0))
    assert isinstance(phase, Rejoining) and phase.reason == "b left"
    assert group.stopped and agent.group is None
    # The stopped workers' final counts went out at once, as a fresh sample.
    assert len(session.beats) == 1
    assert isinstance(session.beats[0][1], rendezvous_pb2.NodeMetrics)
    agent.client.close()


def test_a_push_for_an_older_round_changes_nothing(tmp_path: Path) -> None:
    agent, session, group = running_agent(tmp_path, FakeClock())
    session.push(closed_round=0, reason="before this node joined")
    running = Running(ASSIGNMENT, restart_count=0)
    assert agent._watch(running) is running
    assert not group.stopped
    agent.client.close()


def primed_agent(tmp_path: Path, clock: FakeClock) -> tuple[Agent, FakeWorkerGroup]:
    """A running agent whose group has one primed spare, started just now."""
    agent, _, group = running_agent(tmp_path, clock)
    group.start_spare(agent.config, {}, tmp_path, primed=True)
    agent._primed_until = clock() + 60  # as a launch sets it (WARM_START_TIMEOUT_S)
    return agent, group


def test_primed_spares_run_the_script_once_the_workers_restart_in_place(tmp_path: Path) -> None:
    clock = FakeClock()
    agent, group = primed_agent(tmp_path, clock)
    running = Running(ASSIGNMENT, restart_count=0)
    agent._watch(running)
    assert len(group.primed_pids) == 1  # no word yet: the workers have not opted in
    agent.opted_in = True
    agent._watch(running)
    assert not group.primed_pids  # told to run the script
    assert len(group.spare_pids) == 1 and group.started_spares == 1  # it is the spare
    agent.client.close()


def test_primed_spares_unused_end_after_the_warm_start_timeout(tmp_path: Path) -> None:
    clock = FakeClock()
    agent, group = primed_agent(tmp_path, clock)
    running = Running(ASSIGNMENT, restart_count=0)
    clock.advance(59.9)
    agent._watch(running)
    assert len(group.primed_pids) == 1
    clock.advance(0.1)
    agent._watch(running)
    assert not group.primed_pids and not group.spare_pids
    agent.client.close()


def test_only_a_script_that_may_restart_in_place_gets_primed_spares(tmp_path: Path) -> None:
    probe = HostProbe(hostname=lambda: "n", cpu_count=lambda: 2, accelerator_count=lambda: 0)
    (tmp_path / "elastic.py").write_text("from dlfleet import ShardedDataLoader, elastic\n")
    (tmp_path / "plain.py").write_text("from dlfleet import ShardedDataLoader\n")
    wanted = {
        ("elastic.py",): True,
        ("plain.py",): False,
        ("--spares", "0", "elastic.py"): False,
        ("--no-python", "elastic.py"): False,
    }
    for args, primes in wanted.items():
        *flags, script = args
        config = parse_args(
            [*flags, "--log-dir", str(tmp_path), str(tmp_path / script)],
            {"DLFLEET_MASTER": "127.0.0.1:1", "DLFLEET_TOKEN": "t"},
            probe,
        )
        agent = Agent(config, client=FakeMasterClient(), worker_group=FakeWorkerGroup)
        assert agent._primes is primes, args
        agent.client.close()


def test_a_node_the_master_dropped_while_it_runs_is_registered_again(tmp_path: Path) -> None:
    agent, session, group = running_agent(tmp_path, FakeClock())
    session.closed_by_master.set()  # the master refused the session: it forgot the node
    phase = agent._watch(Running(ASSIGNMENT, restart_count=2))
    assert isinstance(phase, Dropped) and phase.restart_count == 2
    assert group.stopped  # its round is over
    agent._registrations = MAX_REGISTRATIONS  # it has registered again enough
    ended = agent.step(phase)
    assert isinstance(ended, Failed) and ended.exit_code == EXIT_NODE_LOST
    assert "giving the node up" in ended.reason
    agent.client.close()

"""How an agent's session ends when the master no longer knows its node.

An agent that leaves the rendezvous itself (its job ended, it failed, it
was asked to leave) expects the master to refuse its session afterwards:
that is said nowhere. A node the master dropped while the agent still runs
is an error, said in one line (the master's reason and the status code),
never as a raw `AioRpcError` dump over several lines."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
from harness import TOKEN, Running

from dlfleet.api.client import AgentSession, MasterClient
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class Node:
    def __init__(self, address: str) -> None:
        self.client = MasterClient(address, token=TOKEN, timeout_s=5)
        registered = self.client.register_node(job_name="job", node_name="n", local_world_size=1)
        self.node_id, self.incarnation = registered.node_id, registered.incarnation
        self.session: AgentSession = self.client.agent_session(self.node_id, self.incarnation, 0.1)

    def close(self) -> None:
        self.session.close()
        self.client.close()


@pytest.fixture
def node(start_master: Callable[..., Running]) -> Iterator[Node]:
    liveness = LivenessSettings(heartbeat_interval_ms=100, heartbeat_timeout_ms=5_000)
    running = start_master(MasterSettings(job_name="job", liveness=liveness))
    started = Node(running.address)
    yield started
    started.close()


def wait_closed(session: AgentSession) -> None:
    deadline = time.monotonic() + 10
    while not session.closed_by_master.is_set():
        assert time.monotonic() < deadline, "the master never refused the session"
        time.sleep(0.05)


def test_an_agent_that_left_hears_its_session_refused_silently(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="dlfleet.api.client")
    time.sleep(0.3)  # a few heartbeats
    node.session.leaving()
    node.client.leave_rendezvous(node.node_id, node.incarnation, "failed")
    wait_closed(node.session)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], [r.getMessage() for r in loud]


def test_a_node_dropped_under_a_running_agent_is_one_clear_line(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    time.sleep(0.3)
    # Someone else (the master, say) ends the node's registration.
    with MasterClient(node.client.target, token=TOKEN) as other:
        other.leave_rendezvous(node.node_id, node.incarnation, "dropped")
    wait_closed(node.session)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    (line,) = errors
    assert "\n" not in line and "AioRpcError" not in line, line
    assert f"the master refused the session of {node.node_id}" in line
    assert "is not registered" in line and "FAILED_PRECONDITION" in line, line

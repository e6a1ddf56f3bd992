"""Fakes for the job supervisor's collaborators (`dlfleet.master.job.wiring.Wiring`),
so a test runs a real `JobRunner` to its end in well under a second: a master
that is up at once, a client that answers what the test sets, and a platform
whose nodes are plain records that exit when the test says."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlfleet.api.v1 import job_pb2
from dlfleet.master.job.display import Display
from dlfleet.master.job.jobconfig import JobConfig
from dlfleet.master.job.platform import Node, NodeExit, NodeState, Platform
from dlfleet.master.job.runner import JobRunner
from dlfleet.master.job.wiring import MasterProcess, OnLine, Wiring


class FakeMaster:
    """Stands in for `SupervisedMaster` (the master as a child process): it
    listens at once and never exits unless `exit_code` is set."""

    def __init__(
        self, config: JobConfig, port: int, token: str, on_line: OnLine, http_port: int
    ) -> None:
        self.address = f"{config.master.host}:{port}"
        self.port = port
        self.pid = 0
        self.restarts = -1  # the first start is not a restart
        self.http_url = ""
        self.log_dir = config.work_dir / "logs"
        self.last_line = ""
        self.exit_code: int | None = None
        self.stopped = False

    def start(self, forget_nodes: bool = False) -> None:
        self.restarts += 1
        self.exit_code = None

    def wait_listening(self, timeout_s: float) -> bool:
        return True

    def wait_exit(self, timeout_s: float) -> int | None:
        return self.exit_code

    def poll(self) -> int | None:
        return self.exit_code

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopped = True


class FakeMasterClient:
    """Stands in for `MasterClient`: `master_status` answers the master's
    answers the test gives, one a call, the last one from then on; it keeps
    the supervisor's statuses."""

    def __init__(self, *views: job_pb2.MasterStatus) -> None:
        self.views = list(views) or [job_pb2.MasterStatus()]
        self.asked = 0
        self.heard: list[job_pb2.JobStatus] = []

    def master_status(
        self,
        supervisor: job_pb2.SupervisorTotals | None = None,
        job: job_pb2.JobStatus | None = None,
    ) -> job_pb2.MasterStatus:
        if job is not None:
            self.heard.append(job)
        self.asked += 1
        return self.views[min(self.asked, len(self.views)) - 1]

    def close(self) -> None:
        return None


class FakePlatform(Platform[Node]):
    """Stands in for `LocalPlatform` and `KubernetesPlatform`: nodes with no
    process, running as soon as they are added or relaunched. A node exits at
    the poll the test names (`end`), or at the next poll after it was asked
    to leave (SIGTERM); what the runner asked for is kept, for the test."""

    def __init__(self, log_dir: Path) -> None:
        self.nodes: list[Node] = []
        self.log_dir = log_dir
        self.polls = 0
        self.relaunched: list[tuple[str, float, int | None]] = []
        self.added: list[tuple[str, float]] = []
        self.stopped: list[str] = []
        self.shut_down = False
        self._exits: defaultdict[int, list[tuple[str, int, str]]] = defaultdict(list)

    def end(self, name: str, code: int, reason: str = "", at_poll: int = 1) -> None:
        """`name` exits with `code` (and the platform's `reason`) at poll `at_poll`."""
        self._exits[at_poll].append((name, code, reason))

    def add_node(self, delay_s: float = 0.0) -> Node:
        node = Node(name=f"node-{len(self.nodes)}", index=len(self.nodes))
        node.state = NodeState.RUNNING
        self.nodes.append(node)
        self.added.append((node.name, delay_s))
        return node

    def relaunch(self, node: Node, delay_s: float, memory_bytes: int | None = None) -> None:
        node.relaunches += 1
        node.state = NodeState.RUNNING
        node.exit_code = None
        self.relaunched.append((node.name, delay_s, memory_bytes))

    def stop_node(self, node: Node) -> None:
        node.state = NodeState.STOPPING
        self.stopped.append(node.name)
        self.end(node.name, -15, at_poll=self.polls + 1)

    def poll(self) -> list[NodeExit]:
        self.polls += 1
        by_name = {node.name: node for node in self.nodes}
        exits = []
        for name, code, reason in self._exits.pop(self.polls, []):
            node = by_name[name]
            if node.active:
                node.exit_code = code
                exits.append(NodeExit(node, code, reason))
        return exits

    def shutdown(self, grace_s: float) -> None:
        self.shut_down = True

    def log_hint(self, node: Node) -> str:
        return f"see {self.log_dir / (node.name + '.log')}"


class RecordingDisplay(Display):
    """Stands in for the terminal display (`PlainDisplay`, `LiveDisplay`):
    keeps every status the runner showed and every output line."""

    def __init__(self) -> None:
        self.statuses: list[job_pb2.JobStatus] = []
        self.lines: list[tuple[str, str]] = []

    def line(self, source: str, text: str) -> None:
        self.lines.append((source, text))

    def update(self, status: job_pb2.JobStatus) -> None:
        self.statuses.append(status)


class FakeResourceLink:
    """Stands in for `ResourceLink` (a DLFleetJob's status and spec through
    the API server): keeps what was published and the events recorded;
    `wanted_nodes` answers the spec's node counts the test gives, one a call,
    the last one from then on."""

    def __init__(self, *wanted: int | None) -> None:
        self.published: list[dict[str, Any]] = []
        self.events: list[tuple[bool, str, str]] = []
        self.wanted = list(wanted) or [None]
        self.asked = 0

    def publish(self, status: Mapping[str, Any]) -> None:
        self.published.append(dict(status))

    def event(self, warning: bool, reason: str, message: str) -> None:
        self.events.append((warning, reason, message))

    def wanted_nodes(self) -> int | None:
        self.asked += 1
        return self.wanted[min(self.asked, len(self.wanted)) - 1]


def fake_wiring(
    platform: FakePlatform, client: FakeMasterClient, link: FakeResourceLink | None = None
) -> Wiring:
    """The runner's collaborators as fakes; the brain link stays the real
    one (a job with `brain: {mode: off}` opens no brain)."""

    def master(
        config: JobConfig, port: int, token: str, on_line: OnLine, http_port: int
    ) -> MasterProcess:
        return FakeMaster(config, port, token, on_line, http_port)

    def the_client(address: str, token: str, tls_ca: bytes | None) -> FakeMasterClient:
        return client

    def the_platform(
        config: JobConfig, master: MasterProcess, token: str, on_line: OnLine
    ) -> FakePlatform:
        return platform

    def the_link(config: JobConfig, platform: Any) -> Any:
        return link

    return Wiring(master=master, client=the_client, platform=the_platform, resource=the_link)


def run_job(
    config: JobConfig,
    platform: FakePlatform,
    client: FakeMasterClient | None = None,
    display: Display | None = None,
    link: FakeResourceLink | None = None,
) -> JobRunner:
    """A real runner over the fakes, run to the job's end (polling every
    10 ms); the runner, for what it holds after."""
    runner = JobRunner(
        config,
        display or RecordingDisplay(),
        fake_wiring(platform, client or FakeMasterClient(), link),
        poll_s=0.01,
    )
    asyncio.run(runner.run())
    return runner

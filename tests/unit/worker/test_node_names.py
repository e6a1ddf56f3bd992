"""A node's default name: the hostname for the first `dlworker` of a job on a
host, numbered for each further one running beside it, and the same number
again for an agent started after its predecessor ended. The numbers are real
locks held by real processes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dlfleet.worker.agent.config import ConfigError, HostProbe, parse_args
from dlfleet.worker.agent.node_names import claim_number, numbered

ENV = {"DLFLEET_MASTER": "master.local:50051", "DLFLEET_TOKEN": "t"}


def host(number: int, claimed: list[str] | None = None) -> HostProbe:
    """Host `gpu7`, where the job's agent gets `number`; records each claim's job."""

    def claim(job: str) -> int:
        if claimed is None:
            raise AssertionError("no number may be taken")
        claimed.append(job)
        return number

    return HostProbe(
        hostname=lambda: "gpu7",
        cpu_count=lambda: 1,
        accelerator_count=lambda: 0,
        claim_name_number=claim,
    )


def test_the_first_agent_is_named_after_the_host_and_those_beside_it_are_numbered() -> None:
    claimed: list[str] = []
    assert parse_args(["t.py"], ENV, host(0, claimed)).node_name == "gpu7"
    assert parse_args(["--job-name", "bert", "t.py"], ENV, host(2, claimed)).node_name == "gpu7_2"
    assert claimed == ["job", "bert"]  # numbers are kept per job


def test_a_given_node_name_wins_and_takes_no_number() -> None:
    assert parse_args(["--node-name", "n1", "t.py"], ENV, host(3)).node_name == "n1"
    env = {**ENV, "DLFLEET_NODE_NAME": "n2"}
    assert parse_args(["t.py"], env, host(3)).node_name == "n2"


def test_a_config_error_takes_no_number() -> None:
    with pytest.raises(ConfigError, match="--nnodes"):
        parse_args(["--nnodes", "2:1", "t.py"], ENV, host(3))


def test_numbered_names_cannot_be_another_hosts_name() -> None:
    assert numbered("node", 0) == "node"
    assert numbered("node", 1) == "node_1"  # a host may be called node-1, never node_1


class Agent:
    """A process that takes a number for `job` in `directory` and holds it
    until killed; it prints the number, and again after asking twice."""

    def __init__(self, job: str, directory: Path) -> None:
        code = (
            "import sys; from pathlib import Path\n"
            "from dlfleet.worker.agent.node_names import claim_number\n"
            "d = Path(sys.argv[2])\n"
            "print(claim_number(sys.argv[1], d), claim_number(sys.argv[1], d), flush=True)\n"
            "sys.stdin.read()\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, job, str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        first, again = self.proc.stdout.readline().split()
        assert first == again, "asked again, a process gets the number it holds"
        self.number = int(first)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[[str], Agent]]:
    agents: list[Agent] = []

    def start(job: str) -> Agent:
        agents.append(Agent(job, tmp_path / "locks"))
        return agents[-1]

    yield start
    for agent in agents:
        if agent.proc.poll() is None:
            agent.kill()


def test_agents_side_by_side_hold_distinct_numbers_and_a_restarted_one_takes_its_back(
    start_agent: Callable[[str], Agent],
) -> None:
    first, second, third = start_agent("job"), start_agent("job"), start_agent("job")
    assert (first.number, second.number, third.number) == (0, 1, 2)
    assert start_agent("other-job").number == 0
    second.kill()  # SIGKILL: the kernel lets go of its lock
    assert start_agent("job").number == 1
    assert start_agent("job").number == 3


def test_locks_that_cannot_be_kept_leave_the_hostname_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with caplog.at_level(logging.WARNING):
        assert claim_number("job", not_a_folder / "locks") == 0
    assert "pass --node-name" in caplog.text
    assert os.listdir(tmp_path) == ["file"]

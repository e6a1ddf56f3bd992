"""`dlworker --nnodes` against a master of another node range, as a user runs
it: a real agent process and a real master (min 2, max 2). A range the
master's can never meet ends the agent at registration with the master's
reason; a range that differs is a warning in the agent's log naming both,
and the agent goes on to join."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import TOKEN, Running

from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.state import MasterSettings
from dlfleet.worker.agent.phases import EXIT_NODE_LOST

pytestmark = pytest.mark.integration

TWO = MasterSettings(job_name="job", rendezvous=RendezvousSettings(min_nodes=2, max_nodes=2))


def dlworker(running: Running, tmp_path: Path, nnodes: str) -> subprocess.Popen[str]:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    argv = [sys.executable, "-m", "dlfleet.worker.agent.loop", "--master", running.address]
    argv += ["--nnodes", nnodes, "--node-name", "a", str(script)]
    env = {**os.environ, "DLFLEET_TOKEN": TOKEN}
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def test_dlworker_nnodes_3_against_a_master_of_2_ends_at_registration_saying_why(
    start_master: Callable[..., Running], tmp_path: Path
) -> None:
    running = start_master(TWO)
    agent = dlworker(running, tmp_path, "3")
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == EXIT_NODE_LOST, err
    assert "cannot register with the master" in err
    assert "--nnodes 3 cannot be met" in err
    assert "start the node with --nnodes 2 (or the master with --max-nodes 3)" in err


def test_dlworker_nnodes_that_differs_warns_naming_both_ranges_and_joins(
    start_master: Callable[..., Running], tmp_path: Path
) -> None:
    running = start_master(TWO)
    agent = dlworker(running, tmp_path, "1:3")
    try:
        assert agent.stderr is not None
        lines: list[str] = []
        for line in agent.stderr:
            lines.append(line)
            if "--nnodes" in line:
                break
        assert "WARNING --nnodes 1:3 is not the master's node range" in lines[-1], lines
        assert "--min-nodes 2 --max-nodes 2 decide the world size" in lines[-1]
        assert agent.poll() is None  # it goes on: registered, on to its join
    finally:
        agent.kill()
        agent.wait(10)

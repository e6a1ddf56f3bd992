"""Two ranks in two processes with a real gloo process group, reading through
ShardedDataLoader from a real master: lockstep, and a partition of the data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import TOKEN, Running

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("loader_ddp_rank.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("size", [13, 16])  # 13: the tail is smaller than the world
def test_two_gloo_ranks_run_the_same_steps_and_partition_every_epoch(
    start_master: Callable[..., Running], tmp_path: Path, size: int
) -> None:
    running = start_master()
    world, epochs, port = 2, 2, free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "DLFLEET_MASTER": running.address,
            "DLFLEET_TOKEN": TOKEN,
            "DLFLEET_ROUND": "1",
            "DLFLEET_NODE_ID": f"node{rank}",
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        args = [sys.executable, str(SCRIPT), str(tmp_path / f"rank{rank}.json"), str(size)]
        procs.append(subprocess.Popen([*args, "2", str(epochs)], env=env))
    try:
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * world
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert results[0]["steps"] == results[1]["steps"] == [results[0]["len"]] * epochs
    for epoch in range(epochs):
        union = results[0]["seen"][epoch] + results[1]["seen"][epoch]
        assert sorted(union) == list(range(size))
    assert running.client.dataset_status("ddp-records").finished

"""The last step of a job is persisted at `Checkpointer.close()` on every
rank; rank 0 finishes the folder once every rank's part is there. A rank
whose part comes a little later than rank 0's close (it closes later: a
slower rank, a longer teardown) must not make the last step "not persisted":
rank 0 waits for it, within its bound.

Two real processes in a gloo group, one node (no location check), no agent.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dlfleet.worker.checkpoint import persist

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from dlfleet import Checkpointer

    persist_dir, late_s = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = Checkpointer(persist_every=1000, persist_dir=persist_dir)
    for step in range(1, 4):
        ckpt.save(step, {"w": torch.full((3,), float(step)), "rank": rank})
    dist.barrier()
    if rank == 1:
        time.sleep(late_s)  # this rank's part of the last step comes late
    ckpt.close()
    dist.destroy_process_group()
    os._exit(0)  # torch's C++ threads may outlive the group at teardown
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(persist_dir: Path, late_s: float) -> list[str]:
    """Both ranks to their end; each one's stderr."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
        }
        argv = [sys.executable, "-c", SCRIPT, str(persist_dir), str(late_s)]
        procs.append(subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True))
    errors = []
    for proc in procs:
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-3000:]
        errors.append(err)
    return errors


def test_the_last_step_waits_for_a_rank_whose_part_comes_after_rank_0_closed(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "ckpt"
    errors = run_ranks(disk, late_s=2.0)
    newest = persist.newest_persisted(disk)
    assert newest is not None and newest[0] == 3, errors[0][-3000:]
    assert persist.load_persisted_full(newest[1])["w"].tolist() == [3.0, 3.0, 3.0]
    assert "is not persisted" not in errors[0], errors[0][-3000:]

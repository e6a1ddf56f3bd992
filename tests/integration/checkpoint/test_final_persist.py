"""The last step of a job is persisted at `Checkpointer.close()` on every
rank; rank 0 finishes the folder once every rank's part is there. A rank
whose part comes a little later than rank 0's close (it closes later: a
slower rank, a longer teardown) must not make the last step "not persisted":
rank 0 waits for it, within its bound. A last step that was due anyway (a
multiple of persist_every) is persisted once, not again at close().

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


def run_ranks(persist_dir: Path, late_s: float, script: str = SCRIPT) -> list[str]:
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
        argv = [sys.executable, "-c", script, str(persist_dir), str(late_s)]
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


# Step 200 is due (persist_every=100) and is the last: both ranks close at
# once. The files order the ranks (no sleeps): rank 1 closes right after its
# part of step 200 is written, while rank 0's part is still to come (rank 0
# writes it once rank 1 closed, or once rank 1 is writing step 200 again);
# a second write of step 200 on rank 1 is held, before its part file, until
# rank 0 has finished the folder: two writes of one step crossing.
CLOSE_AT_ONCE = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from dlfleet import Checkpointer
    from dlfleet.worker.checkpoint import persist

    root, signals = Path(sys.argv[1]), Path(sys.argv[1] + "-signals")
    signals.mkdir(exist_ok=True)
    STEP = 200
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    real_write_part, real_encode_header = persist.write_part, persist.encode_header
    writes, written = [], threading.Event()

    def wait_for(*paths):
        while not any(p.exists() for p in paths):
            time.sleep(0.005)

    def write_part(source, folder_root, **kw):
        writes.append(source.header.step)
        if rank == 0:
            wait_for(signals / "closed", signals / "writing-again")
        try:
            return real_write_part(source, folder_root, **kw)
        finally:
            written.set()

    def encode_header(header):  # right before a part file is written
        if rank == 1 and len(writes) > 1:
            (signals / "writing-again").touch()
            wait_for(persist.step_folder(root, STEP) / persist.METADATA)
        return real_encode_header(header)

    persist.write_part, persist.encode_header = write_part, encode_header
    ckpt = Checkpointer(persist_every=100, persist_dir=root)
    ckpt.save(STEP, {"w": torch.full((3,), 2.0), "rank": rank})
    if rank == 1:  # its part written and its persister idle again: then close
        written.wait()
        while ckpt._persisting is not None:
            time.sleep(0.001)
    ckpt.close()
    if rank == 1:
        (signals / "closed").touch()
    print("writes", writes, file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
    """
)


def test_a_due_last_step_is_persisted_once_when_close_follows_at_once(tmp_path: Path) -> None:
    disk = tmp_path / "ckpt"
    errors = run_ranks(disk, late_s=0.0, script=CLOSE_AT_ONCE)
    for rank, err in enumerate(errors):
        assert "failed" not in err and "is not persisted" not in err, (rank, err[-3000:])
        assert "writes [200]\n" in err, (rank, err[-3000:])  # each rank's part once
    newest = persist.newest_persisted(disk)
    assert newest is not None and newest[0] == 200
    persist.verify_folder(newest[1])
    assert persist.load_persisted_full(newest[1])["w"].tolist() == [2.0, 2.0, 2.0]
    assert sorted(p.name for p in disk.iterdir()) == [newest[1].name]  # no .partial left

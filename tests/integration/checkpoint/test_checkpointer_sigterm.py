"""A preempted training process (SIGTERM) persists its newest in-memory step
before it exits, so a job stopped everywhere loses nothing it had saved."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlfleet.api.env import CHECKPOINT_DIR_ENV, ROUND_ENV
from dlfleet.worker.checkpoint import files, persist, presence

pytestmark = pytest.mark.integration


def wait_saved(procs: list[subprocess.Popen[str]]) -> None:
    """Until every process printed "saved" (within 60 s, none ended)."""
    deadline = time.monotonic() + 60
    for proc in procs:
        assert proc.stdout is not None
        while proc.stdout.readline().strip() != "saved":
            assert time.monotonic() < deadline and proc.poll() is None, "a rank did not save"


def start_saved(script: str, tmp_path: Path, **popen: Any) -> subprocess.Popen[str]:
    """`script` alone (persisting to `tmp_path/disk`), once it saved."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "disk")],
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DLFLEET_WORKDIR": str(tmp_path)},
        **popen,
    )
    wait_saved([proc])
    return proc


SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from dlfleet import Checkpointer
    ckpt = Checkpointer(persist_every=1000, persist_dir=sys.argv[1])
    model = torch.nn.Linear(4, 4)
    for step in range(1, 4):
        ckpt.save(step, {"model": model.state_dict(), "step": step})
    print("saved", flush=True)
    time.sleep(60)
    """
)


def test_a_terminated_process_persists_its_newest_step_first(tmp_path: Path) -> None:
    proc = start_saved(SCRIPT, tmp_path)
    assert persist.newest_persisted(tmp_path / "disk") is None  # nothing was due yet
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    newest = persist.newest_persisted(tmp_path / "disk")
    assert newest is not None and newest[0] == 3
    assert persist.load_persisted_full(newest[1])["step"] == 3


RANKED = textwrap.dedent(
    """
    import sys, time, torch
    from dlfleet import Checkpointer
    ckpt = Checkpointer(persist_every=1000, persist_dir=sys.argv[1])
    model = torch.nn.Linear(4, 4)
    for step in range(1, int(sys.argv[2]) + 1):
        ckpt.save(step, {"model": model.state_dict(), "step": step})
    print("saved", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("ahead", [0, 1])
def test_ranks_terminated_a_save_apart_persist_the_newest_step_they_all_hold(
    tmp_path: Path, ahead: int
) -> None:
    """The ranks of a round are stopped one by one: one may have saved the
    step the other had not reached yet. Each persists the images it holds
    (its newest and the one before), so the newest step every rank holds is
    whole on disk, whichever rank is ahead."""
    disk = tmp_path / "disk"
    procs = []
    for rank in (0, 1):
        last = 3 + (1 if rank == ahead else 0)
        env = {
            "PATH": "/usr/bin:/bin",
            "DLFLEET_WORKDIR": str(tmp_path / f"rank{rank}"),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANKED, str(disk), str(last)],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    wait_saved(procs)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(30) == 128 + signal.SIGTERM
    newest = persist.newest_persisted(disk)
    assert newest is not None and newest[0] == 3, newest


BLOCKED = textwrap.dedent(
    """
    import sys, time, torch
    import torch.distributed as dist
    from dlfleet import Checkpointer
    rank = int(sys.argv[3])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    ckpt = Checkpointer(persist_every=1000, persist_dir=sys.argv[1])
    model = torch.nn.Linear(4, 4)
    for step in range(1, 4):
        ckpt.save(step, {"model": model.state_dict(), "step": step})
    dist.barrier()
    print("saved", flush=True)
    if rank == 1:
        dist.all_reduce(torch.ones(1))  # rank 0 never comes: blocked in C
    time.sleep(60)
    """
)


def test_a_rank_blocked_in_a_collective_persists_its_part_when_terminated(
    tmp_path: Path,
) -> None:
    """Rank 1 waits in an all_reduce that rank 0 (stopped first) never joins:
    Python's handler cannot run on its main thread, yet its part is written
    at once, so rank 0 finishes the step."""
    disk = tmp_path / "disk"
    procs = []
    for rank in (0, 1):
        env = {
            "PATH": "/usr/bin:/bin",
            "DLFLEET_WORKDIR": str(tmp_path / f"rank{rank}"),
            "MASTER_ADDR": "127.0.0.1",
        }
        argv = [sys.executable, "-c", BLOCKED, str(disk), str(tmp_path / "store"), str(rank)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env))
    try:
        wait_saved(procs)
        time.sleep(0.5)  # rank 1 into its all_reduce
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert procs[0].wait(30) == 128 + signal.SIGTERM
        newest = persist.newest_persisted(disk)
        assert newest is not None and newest[0] == 3, newest
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# As under dlworker: the ranks of one node write their images into the node's
# folder (the agent's, in shared memory), where each can read the others'.
NODE = textwrap.dedent(
    """
    import sys, time, torch
    from dlfleet import Checkpointer
    ckpt = Checkpointer(persist_every=1000, persist_dir=sys.argv[1])
    model = torch.nn.Linear(4, 4)
    last = int(sys.argv[2])
    for step in range(1, last + 1):
        ckpt.save(step, {"model": model.state_dict(), "step": step})
    while ckpt.image_times(last) is None:  # its image finished (written in the background)
        time.sleep(0.01)
    print("saved", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize(("killed_at", "persisted"), [(3, 3), (2, 2)])
def test_a_rank_whose_peer_was_killed_persists_at_once_from_the_peers_image(
    tmp_path: Path, killed_at: int, persisted: int
) -> None:
    """Rank 1 is SIGKILLed (after step 3, or before it), then rank 0 is
    terminated: rank 1's part will never come, but its image is in the
    node's folder. Rank 0 writes that part itself and finishes the newest
    step both hold, well within the 5 s it would have waited for rank 1."""
    disk = tmp_path / "disk"
    procs = []
    for rank, last in ((0, 3), (1, killed_at)):
        env = {
            "PATH": "/usr/bin:/bin",
            "DLFLEET_WORKDIR": str(tmp_path / f"rank{rank}"),
            CHECKPOINT_DIR_ENV: str(tmp_path / "node-images"),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }
        argv = [sys.executable, "-c", NODE, str(disk), str(last)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env))
    try:
        wait_saved(procs)
        procs[1].kill()
        assert procs[1].wait(10) == -signal.SIGKILL
        terminated = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(30) == 128 + signal.SIGTERM
        took = time.monotonic() - terminated
        assert took < 2.5, f"rank 0 took {took:.1f}s to persist and exit"
        newest = persist.newest_persisted(disk)
        assert newest is not None and newest[0] == persisted, newest
        persist.verify_folder(newest[1])
        assert persist.load_persisted_full(newest[1])["step"] == persisted
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def dead_node(tmp_path: Path, script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """Rank 0 of this node, saving steps 1..3; rank 1 lived on another node,
    and wrote into what is, on this node, that node's replica folder
    (`<root>/replicas/node-b`). Once both saved, rank 1 is killed and the
    agent's word is written: rank 1 of round 3 died with its node (the
    master's, see `presence`). Yields rank 0, still running."""
    root = tmp_path / "node-a"
    procs = []
    for rank, folder in ((0, root / "own"), (1, root / files.REPLICAS / "node-b")):
        env = {
            "PATH": "/usr/bin:/bin",
            "DLFLEET_WORKDIR": str(tmp_path / f"rank{rank}"),
            CHECKPOINT_DIR_ENV: str(folder),
            ROUND_ENV: "3",
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
        argv = [sys.executable, "-c", script, *args]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env))
    try:
        wait_saved(procs)
        procs[1].kill()
        assert procs[1].wait(10) == -signal.SIGKILL
        presence.mark_gone(root / "own", 3, [1])
        yield procs[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def assert_step_3_persisted(disk: Path) -> None:
    newest = persist.newest_persisted(disk)
    assert newest is not None and newest[0] == 3, newest
    persist.verify_folder(newest[1])
    assert persist.load_persisted_full(newest[1])["step"] == 3


def test_a_rank_whose_node_died_is_written_from_its_replica_at_once(tmp_path: Path) -> None:
    """Rank 0 is terminated: it finishes step 3 with rank 1's part from the
    replica, instead of waiting 5 s for a part that never comes."""
    disk = tmp_path / "disk"
    with dead_node(tmp_path, NODE, str(disk), "3") as rank0:
        terminated = time.monotonic()
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(30) == 128 + signal.SIGTERM
        took = time.monotonic() - terminated
    assert took < 2.5, f"rank 0 took {took:.1f}s to persist and exit"
    assert_step_3_persisted(disk)


# Closed rather than terminated (the training failed on the dead peer, and the
# script's handler closes its Checkpointer): close() persists the last step.
CLOSING = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from dlfleet import Checkpointer
    ckpt = Checkpointer(persist_every=1000, persist_dir=sys.argv[1])
    model = torch.nn.Linear(4, 4)
    for step in range(1, 4):
        ckpt.save(step, {"model": model.state_dict(), "step": step})
    while ckpt.image_times(3) is None:
        time.sleep(0.01)
    print("saved", flush=True)
    while not Path(sys.argv[2]).exists():
        time.sleep(0.01)
    ckpt.close()
    """
)


def test_a_closing_rank_writes_a_dead_nodes_part_from_its_replica(tmp_path: Path) -> None:
    """As above, but rank 0 closes its Checkpointer: the last step's folder
    is finished with rank 1's part from the replica, not waited for (60 s)."""
    disk, go = tmp_path / "disk", tmp_path / "go"
    with dead_node(tmp_path, CLOSING, str(disk), str(go)) as rank0:
        closed = time.monotonic()
        go.touch()
        assert rank0.wait(30) == 0
        took = time.monotonic() - closed
    assert took < 2.5, f"rank 0 took {took:.1f}s to close"
    assert_step_3_persisted(disk)


# Another handler of SIGTERM, installed after the Checkpointer's, raises
# (Lightning's broadcasts the signal to the peers, and fails when one is
# dead): the main thread leaves while TermWatch's thread persists. A large
# state makes the persist outlast the interpreter's exit.
RAISING = textwrap.dedent(
    """
    import signal, sys, time, torch
    from dlfleet import Checkpointer
    ckpt = Checkpointer(persist_every=1000, persist_dir=sys.argv[1])
    state = {"w": torch.rand(64 << 20 >> 2), "step": 1}
    ckpt.save(1, state)
    while ckpt.image_times(1) is None:
        time.sleep(0.01)

    def peer_gone(signum, frame):
        raise RuntimeError("Connection closed by peer")

    signal.signal(signal.SIGTERM, peer_gone)
    print("saved", flush=True)
    time.sleep(60)
    """
)


def test_a_process_leaving_on_another_handlers_error_still_persists(tmp_path: Path) -> None:
    proc = start_saved(RAISING, tmp_path, stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "Connection closed by peer" in err, err[-2000:]
    newest = persist.newest_persisted(tmp_path / "disk")
    assert newest is not None and newest[0] == 1, err[-2000:]
    persist.verify_folder(newest[1])

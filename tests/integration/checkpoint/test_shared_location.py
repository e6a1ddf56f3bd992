"""Ranks on different hosts persist into one location only when it is shared
storage: a round whose nodes do not all see it fails at its start, on every
rank, naming the location and the nodes; a shared one persists, and a node
replaced on a new host restores from it.

Each "node" is a process of a real two-rank gloo group with its own
GROUP_RANK and its own TMPDIR (a host's private /tmp). Unshared disks are
either two folders, or one path backed by a tmpfs of each node's own in a
mount namespace of its own (as root): the same path, two disks, as on two
machines.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dlfleet.worker.checkpoint import location, persist

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from dlfleet import Checkpointer
    from dlfleet.worker.checkpoint.errors import PersistError

    persist_dir, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = Checkpointer(persist_every=2, persist_dir=persist_dir)
    try:
        restored = ckpt.load()
        for step in range(1, steps + 1):
            ckpt.save(step, {"w": torch.full((3,), float(step)), "rank": rank})
        ckpt.close()
        out = {"step": restored.step, "source": restored.source,
               "w": restored.state["w"].tolist()} if restored else {"step": None}
        code = 0
    except PersistError as exc:
        out, code = {"error": type(exc).__name__, "message": str(exc)}, 3
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    os._exit(code)  # torch's C++ threads may outlive the group at teardown
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_nodes(
    tmp: Path,
    persist_dirs: list[Path],
    *,
    steps: int,
    hosts: list[str],
    own_disk: bool = False,
    one_node: bool = False,
) -> list[tuple[int, dict[str, Any]]]:
    """Run one rank per node (two nodes; with `one_node`, both ranks on one),
    each with `persist_dirs[rank]`; with `own_disk`, in a mount namespace of
    its own where a fresh tmpfs holds that path. Returns each rank's exit
    code and answer."""
    port = free_port()
    procs = []
    for rank, folder in enumerate(persist_dirs):
        host_tmp = tmp / hosts[rank]
        host_tmp.mkdir(exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "TMPDIR": str(host_tmp),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank) if one_node else "0",
            "LOCAL_WORLD_SIZE": "2" if one_node else "1",
            "GROUP_RANK": "0" if one_node else str(rank),
            "GROUP_WORLD_SIZE": "1" if one_node else "2",
        }
        argv = [sys.executable, "-c", SCRIPT, str(folder), str(steps)]
        if own_disk:  # sh's $0: the host; $1: the folder; then the command
            folder.mkdir(parents=True, exist_ok=True)
            mount = 'mount -t tmpfs "dlfleet-$0" "$1" && shift && exec "$@"'
            namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
            argv = [*namespace, hosts[rank], str(folder), *argv]
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        lines = out.decode().strip().splitlines()
        assert lines, f"no answer (exit {proc.returncode}): {err.decode()[-2000:]}"
        results.append((proc.returncode, json.loads(lines[-1])))
    return results


def assert_unshared_error(answer: dict[str, Any], folder: Path) -> None:
    assert answer["error"] == "UnsharedLocationError", answer
    message = answer["message"]
    assert f"persist location {folder} is not shared by every host" in message
    assert "that rank 0 (node 0 on host " in message  # who wrote the marker
    assert "cannot be seen from node 1 on host " in message  # who cannot see it
    assert "(rank 1: no such file)" in message
    assert "shared or network file system" in message  # what to do


def test_nodes_persisting_to_folders_the_others_cannot_see_fail_at_start(
    tmp_path: Path,
) -> None:
    disks = [tmp_path / "host-a-disk" / "ckpt", tmp_path / "host-b-disk" / "ckpt"]
    results = run_nodes(tmp_path, disks, steps=2, hosts=["host-a", "host-b"])
    for rank, (code, answer) in enumerate(results):
        assert code == 3, answer  # every rank, before training
        assert_unshared_error(answer, disks[rank])
    for disk in disks:  # nothing persisted anywhere, and no marker left behind
        assert not disk.exists() or not any(disk.iterdir())


def test_the_ranks_of_a_one_node_round_are_not_checked(tmp_path: Path) -> None:
    """They share their node's file system: no marker, no collective (the
    two folders here would fail a check, so none ran)."""
    disks = [tmp_path / "disk-0", tmp_path / "disk-1"]
    results = run_nodes(tmp_path, disks, steps=0, hosts=["host-a", "host-a"], one_node=True)
    assert results == [(0, {"step": None}), (0, {"step": None})]
    assert not disks[0].exists() and not disks[1].exists()


def _can_mount_in_a_namespace_of_its_own() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "t", "/mnt"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


@pytest.mark.skipif(
    not _can_mount_in_a_namespace_of_its_own(), reason="needs root and unshare --mount"
)
def test_one_path_on_each_hosts_own_disk_fails_at_start(tmp_path: Path) -> None:
    same_path = tmp_path / "mnt" / "ckpt"
    results = run_nodes(
        tmp_path, [same_path, same_path], steps=2, hosts=["host-a", "host-b"], own_disk=True
    )
    for code, answer in results:
        assert code == 3, answer
        assert_unshared_error(answer, same_path)


def test_a_shared_location_persists_and_a_node_replaced_on_a_new_host_restores_from_it(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "nfs" / "ckpt"
    first = run_nodes(tmp_path, [shared, shared], steps=3, hosts=["host-a", "host-b"])
    assert [code for code, _ in first] == [0, 0], first
    assert [answer["step"] for _, answer in first] == [None, None]  # a fresh start
    newest = persist.newest_persisted(shared)
    assert newest is not None and newest[0] == 3  # step 2, then step 3 at close()
    assert not list(shared.glob(f"{location.MARKER_PREFIX}*"))

    # Node 1 is replaced by one on host c: nothing of the job in its memory
    # or its /tmp; both ranks restore the newest step from the shared folder.
    again = run_nodes(tmp_path, [shared, shared], steps=0, hosts=["host-a", "host-c"])
    for code, answer in again:
        assert code == 0, answer
        assert answer == {"step": 3, "source": "disk", "w": [3.0, 3.0, 3.0]}

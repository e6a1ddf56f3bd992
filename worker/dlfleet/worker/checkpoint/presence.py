"""Whether the rank of an image in this node's folder still lives.

On SIGTERM, rank 0 finishes the newest step whose parts every rank writes
(see `Checkpointer._on_sigterm`). A rank killed before (SIGKILL: the OOM
killer, a crash) never writes its part, yet its image stays in the node's
folder, which the agent owns. Rank 0 may write that part itself from the
image, but only if the rank is gone: two writers of one rank's part would
write the same files at once.

Each Checkpointer that writes images into the node's folder holds a shared
`flock` on `rank-<rank>.alive` there for as long as it writes that rank's
images. The kernel releases it when the process ends, however it ends, so a
rank is gone exactly when no process holds it. A rank with no such file in
the folder was never on this node (or wrote its images elsewhere): nothing
is known of it.

A rank of another node leaves no lock here. When that node dies (killed,
powered off: the master saw its session break or its beats stop), the master
tells the round's survivors which ranks died with it, and their agent writes
them down here (`round-<round>.gone`) before it stops its workers: rank 0
then writes those ranks' parts from their replicas on this node, or gives
up on steps that have none, instead of waiting for parts that never come.
A node that only left (preempted: its workers persist their own parts) is
not written down.

Invariants: the probe never blocks and leaves no lock behind; a lock file is
never removed (removing it could part a holder from a file that a probe then
finds unlocked), it goes with the folder. A gone file is written whole (by
rename) before the workers are stopped, and names ranks of its round only.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path


class RankState(enum.Enum):
    ALIVE = "alive"  # a process of this node writes the rank's images
    GONE = "gone"  # it did, and has ended (or closed its Checkpointer)
    UNKNOWN = "unknown"  # no process of this node ever wrote them here


def presence_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.alive"


class Presence:
    """Held by the process that writes `rank`'s images into `directory`."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.rank = rank
        self._fd: int | None = os.open(
            presence_path(directory, rank), os.O_RDWR | os.O_CREAT, 0o600
        )
        # Shared: a probe holds the lock exclusively only for an instant.
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def rank_state(directory: Path, rank: int) -> RankState:
    """Whether a process of this node holds `rank`'s presence now."""
    try:
        fd = os.open(presence_path(directory, rank), os.O_RDWR)
    except FileNotFoundError:
        return RankState.UNKNOWN
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return RankState.ALIVE
    finally:
        os.close(fd)  # releases the probe's lock, if it got it
    return RankState.GONE


def gone_path(directory: Path, round_: int) -> Path:
    return directory / f"round-{round_:06d}.gone"


def mark_gone(directory: Path, round_: int, ranks: Iterable[int]) -> None:
    """The agent's word, before it stops its workers: `ranks` of round
    `round_` died with their node (see the module's docstring)."""
    path = gone_path(directory, round_)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(sorted(set(ranks))))
    tmp.replace(path)


def gone_ranks(directory: Path, round_: int) -> frozenset[int]:
    """The ranks of round `round_` the agent wrote down as dead."""
    try:
        return frozenset(int(rank) for rank in json.loads(gone_path(directory, round_).read_text()))
    except FileNotFoundError:
        return frozenset()

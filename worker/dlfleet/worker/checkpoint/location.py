"""Whether the persist location is one place for every host of a round.

A persisted step's folder is written by every rank (each its own part) and
completed by rank 0 once every part is there: it is whole only on storage
that every host shares (a network file system mounted at the same path on
each). Separate machines share no /tmp and no /dev/shm: a path on a local
disk gives each host a folder of its own, none of which ever completes, and
the job would train on for hours persisting nothing it could restore.

So, before a round's first load or save, rank 0 writes a marker file with
a random name and content into the location, the name goes to every rank,
each rank looks for it, and the answers are gathered: when some host cannot
see it, every rank of the round fails together, with one error naming the
location and the hosts that cannot see it. Rank 0 removes the marker.

Cost: one small file (written once, read once per rank, removed) and two
small collectives (the name out, the answers back), once per round.
`judge` (the decision) is pure; `check_shared` does the I/O and collectives.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dlfleet.api.env import WORKDIR_ENV
from dlfleet.worker.checkpoint.errors import PersistError, UnsharedLocationError

MARKER_PREFIX = ".dlfleet-shared-"
# How long a rank looks for the marker before it answers that it cannot see
# it (a network file system may show a new file a moment late); only a
# location that is not shared pays it.
VISIBLE_WAIT_S = 1.0
_POLL_S = 0.1
_NAMED_NODES = 8  # an error names this many of the nodes that cannot see it, then counts


@dataclass(frozen=True)
class Sighting:
    """What one rank saw of the marker (rank 0: whether it could write it)."""

    rank: int
    node: str  # the host, as an error names it
    seen: bool
    why: str = ""  # when not seen: what the file system said


def marker_path(root: Path, token: str) -> Path:
    return root / f"{MARKER_PREFIX}{token}"


def write_marker(root: Path) -> str:
    """Write a new marker into `root` (made if missing); return its token."""
    token = secrets.token_hex(16)
    root.mkdir(parents=True, exist_ok=True)
    marker_path(root, token).write_text(token)
    return token


def look_for_marker(
    root: Path,
    token: str,
    *,
    wait_s: float = VISIBLE_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """'' when the marker `token` is in `root`, else why it is not seen."""
    deadline = clock() + wait_s
    while True:
        try:
            if marker_path(root, token).read_text() == token:
                return ""
            why = "a file of that name holds something else"
        except FileNotFoundError:
            why = "no such file"
        except OSError as exc:
            return f"cannot read it: {exc}"  # e.g. a permission: waiting changes nothing
        if clock() >= deadline:
            return why
        sleep(_POLL_S)


def judge(location: str, sightings: Sequence[Sighting]) -> PersistError | None:
    """The error every rank raises for these answers (by rank), or None when
    every rank saw the marker rank 0 wrote."""
    writer = sightings[0]
    if not writer.seen:
        return PersistError(
            f"rank 0 ({writer.node}) cannot write to the checkpoint persist location "
            f"{location}: {writer.why}"
        )
    missing: dict[str, list[Sighting]] = {}
    for sighting in sightings[1:]:
        if not sighting.seen:
            missing.setdefault(sighting.node, []).append(sighting)
    if not missing:
        return None
    named = list(missing.items())[:_NAMED_NODES]
    blind = ", ".join(f"{node} ({_ranks(group)}: {group[0].why})" for node, group in named)
    if len(missing) > len(named):
        blind += f" and {len(missing) - len(named)} other nodes"
    return UnsharedLocationError(
        f"the checkpoint persist location {location} is not shared by every host of the "
        f"job: a marker file that rank 0 ({writer.node}) wrote there cannot be seen from "
        f"{blind}. Every rank writes its part of a persisted step there and rank 0 "
        "completes the folder, so no step persisted there could ever be restored whole. "
        f"Put persist_dir (by default ${WORKDIR_ENV}/checkpoints) on a shared or network "
        "file system (NFS, Lustre, a cloud file store) mounted at the same path on every host."
    )


def check_shared(root: Path, *, node: str, wait_s: float = VISIBLE_WAIT_S) -> None:
    """Raise `judge`'s error on every rank when some rank cannot see a marker
    that rank 0 writes into `root`. Every rank of the default process group
    calls it, together; `node` names this rank's host in the error."""
    import torch.distributed as dist

    rank = dist.get_rank()
    token: str | None = None  # None: rank 0 could not write a marker
    if rank == 0:
        try:
            token = write_marker(root)
            mine = Sighting(0, node, True)
        except OSError as exc:
            mine = Sighting(0, node, False, str(exc))
    offer = [token]
    dist.broadcast_object_list(offer, src=0)
    token = offer[0]
    if rank != 0:
        why = look_for_marker(root, token, wait_s=wait_s) if token else "rank 0 wrote no marker"
        mine = Sighting(rank, node, not why, why)
    sightings: list[Sighting | None] = [None] * dist.get_world_size()
    dist.all_gather_object(sightings, mine)
    if rank == 0 and token is not None:
        with contextlib.suppress(OSError):  # a marker left behind is a small hidden file
            marker_path(root, token).unlink()
    gathered = [s for s in sightings if s is not None]
    assert len(gathered) == len(sightings)  # all_gather_object filled every slot
    error = judge(str(root.absolute()), gathered)
    if error is not None:
        raise error


def _ranks(group: Sequence[Sighting]) -> str:
    ranks = ", ".join(str(s.rank) for s in group)
    return f"rank {ranks}" if len(group) == 1 else f"ranks {ranks}"

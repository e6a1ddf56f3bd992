"""Where a loader runs: the master, the round, and this process's rank.

Read once, when the loader is built, from what `dlworker` or torchrun with
dlfleet's rendezvous (DLFLEET_MASTER, DLFLEET_TOKEN, DLFLEET_ROUND,
DLFLEET_NODE_ID; `launcher_variables`) and torchrun (RANK, WORLD_SIZE) put in
the environment. The rank and world size of an initialised
torch.distributed process group win over the variables. Tests build one
directly, so that several "ranks" can live in one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from dlfleet.api.env import MASTER_ENV, NODE_ID_ENV, ROUND_ENV, TOKEN_ENV
from dlfleet.api.errors import InvalidArgument


class LoaderMode(Enum):
    SYNC = "sync"  # shards leased to the round; lockstep across ranks
    ASYNC = "async"  # shards leased to each rank; fast ranks take more
    LOCAL = "local"  # no master: rank-based slicing of the seeded permutation


@dataclass(frozen=True)
class LoaderEnvironment:
    master: str | None  # host:port, None without dlfleet (plain torchrun)
    token: str = ""
    round: int = 0
    node_id: str = ""
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InvalidArgument(f"rank {self.rank} is outside a world of {self.world_size}")

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> LoaderEnvironment:
        env = os.environ if environ is None else environ
        rank, world = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        return cls(
            master=env.get(MASTER_ENV) or None,
            token=env.get(TOKEN_ENV, ""),
            round=_int(env, ROUND_ENV, 0),
            node_id=env.get(NODE_ID_ENV, ""),
            rank=rank,
            world_size=world,
        )


def launcher_variables(master: str, token: str, round: int, node_id: str) -> dict[str, str]:
    """What a launcher that joins rounds on a master gives its workers, so
    that their loaders lease from it (`LoaderEnvironment.detect` reads them)."""
    return {
        MASTER_ENV: master,
        TOKEN_ENV: token,
        ROUND_ENV: str(round),
        NODE_ID_ENV: node_id,
    }


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"{name} must be an integer, got {text!r}") from None

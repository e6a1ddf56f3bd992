"""Each local worker's environment for one rendezvous round: torchrun's
variables, so that a script written for `torchrun` runs unchanged, plus the
dlfleet master's address and the round for the ShardedDataLoader, and a
PYTHONPATH whose first folder makes every worker's Python record an uncaught
exception in its error file (`worker_site`).

Invariants (torchrun's rules, `LocalElasticAgent._start_workers`):
- global RANK = sum of the local world sizes of the lower group ranks + LOCAL_RANK;
  WORLD_SIZE = sum of all local world sizes. With one role, ROLE_RANK = RANK and
  ROLE_WORLD_SIZE = WORLD_SIZE.
- Every node of a round computes the same ranks from the same `RoundAssignment`,
  so the global ranks of a round are exactly 0..WORLD_SIZE-1, each once.
- The result holds only the variables the agent sets; the worker inherits the
  rest of the agent's environment. This module is pure: the agent's own
  environment is an argument.

The process group bootstraps on a fresh endpoint per round (SPEC section 3),
which worker rank 0 hosts itself: TORCHELASTIC_USE_AGENT_STORE is "False", so
`init_process_group("env://")` starts the TCPStore at MASTER_ADDR:MASTER_PORT
on global rank 0 instead of reusing a store of the agent's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dlfleet.api.env import MASTER_ENV, ROUND_ENV
from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.agent.config import AgentConfig
from dlfleet.worker.agent.worker_site import worker_pythonpath

ERROR_FILE_NAME = "error.json"


@dataclass(frozen=True)
class RoundAssignment:
    """This node's part of a completed rendezvous round, as the master sent it."""

    round: int
    group_rank: int
    group_world_size: int  # nodes in the round
    world_size: int  # processes in the round
    local_world_size: int  # this node's processes
    rank_offset: int  # the global rank of this node's local rank 0
    bootstrap_host: str
    bootstrap_port: int

    def __post_init__(self) -> None:
        if self.round < 0:
            raise InvalidArgument(f"round must be >= 0, got {self.round}")
        if not 0 <= self.group_rank < self.group_world_size:
            raise InvalidArgument(
                f"group rank {self.group_rank} is not in 0..{self.group_world_size - 1}"
            )
        if self.local_world_size < 1:
            raise InvalidArgument(f"local world size must be >= 1, got {self.local_world_size}")
        # Every other node has at least one process, and as many come before
        # this node's as it has predecessors.
        others = self.group_world_size - 1
        if not self.group_rank <= self.rank_offset <= self.world_size - self.local_world_size:
            raise InvalidArgument(
                f"rank offset {self.rank_offset} is not possible for group rank "
                f"{self.group_rank} of a world of {self.world_size} processes"
            )
        if self.world_size - self.local_world_size < others:
            raise InvalidArgument(
                f"a world of {self.world_size} processes cannot hold {self.local_world_size} "
                f"here and {others} other nodes"
            )
        if not self.bootstrap_host or not 0 < self.bootstrap_port < 65536:
            raise InvalidArgument(
                f"bad bootstrap endpoint {self.bootstrap_host!r}:{self.bootstrap_port}"
            )


def error_file_path(error_file_dir: Path, local_rank: int) -> Path:
    """Where local rank `local_rank` writes its `@record` error file; torchrun's
    layout (`<dir>/<local_rank>/error.json`), next to its log files."""
    return error_file_dir / str(local_rank) / ERROR_FILE_NAME


def worker_environments(
    config: AgentConfig,
    assignment: RoundAssignment,
    restart_count: int,
    error_file_dir: Path,
    master_address: str,
    *,
    agent_environ: Mapping[str, str],
    extra: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """The variables to set for each local rank (index = local rank).

    `agent_environ` is the agent's own environment: like torchrun, a value the
    user set there for OMP_NUM_THREADS, TORCH_NCCL_ASYNC_ERROR_HANDLING or
    CUDA_VISIBLE_DEVICES is kept. `extra` (e.g. the node id) is merged in; it may
    not redefine a variable computed here.
    """
    if assignment.local_world_size != config.nproc_per_node:
        raise InvalidArgument(
            f"the round gives this node {assignment.local_world_size} processes, but "
            f"--nproc-per-node is {config.nproc_per_node}"
        )
    if restart_count < 0:
        raise InvalidArgument(f"restart count must be >= 0, got {restart_count}")
    shared = {
        "WORLD_SIZE": str(assignment.world_size),
        "LOCAL_WORLD_SIZE": str(assignment.local_world_size),
        "GROUP_RANK": str(assignment.group_rank),
        "GROUP_WORLD_SIZE": str(assignment.group_world_size),
        "ROLE_WORLD_SIZE": str(assignment.world_size),
        "ROLE_NAME": config.role,
        "MASTER_ADDR": assignment.bootstrap_host,
        "MASTER_PORT": str(assignment.bootstrap_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": agent_environ.get(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
        ),
        MASTER_ENV: master_address,
        ROUND_ENV: str(assignment.round),
        # Its sitecustomize writes the error file of a script without @record.
        "PYTHONPATH": worker_pythonpath(agent_environ.get("PYTHONPATH")),
    }
    # torchrun: one thread per process when several share a node, unless the
    # user chose a number.
    if "OMP_NUM_THREADS" in agent_environ:
        shared["OMP_NUM_THREADS"] = agent_environ["OMP_NUM_THREADS"]
    elif config.nproc_per_node > 1:
        shared["OMP_NUM_THREADS"] = "1"
    if "CUDA_VISIBLE_DEVICES" in agent_environ:
        shared["CUDA_VISIBLE_DEVICES"] = agent_environ["CUDA_VISIBLE_DEVICES"]

    envs = []
    for local_rank in range(assignment.local_world_size):
        rank = assignment.rank_offset + local_rank
        env = {
            **shared,
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "ROLE_RANK": str(rank),
            "TORCHELASTIC_ERROR_FILE": str(error_file_path(error_file_dir, local_rank)),
        }
        clashes = sorted(set(env) & set(extra or {}))
        if clashes:
            raise InvalidArgument(f"extra variables may not redefine {', '.join(clashes)}")
        env.update(extra or {})
        envs.append(env)
    return envs

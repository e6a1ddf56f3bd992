"""Worker environments follow torchrun's rules: global rank is the prefix sum of
the local world sizes of lower group ranks plus the local rank, and every
variable torchrun's agent exports is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.agent.config import AgentConfig
from dlfleet.worker.agent.env import RoundAssignment, error_file_path, worker_environments

# Exactly what LocalElasticAgent._start_workers sets (no virtual local rank, no
# CUDA_VISIBLE_DEVICES in the agent), plus TORCHELASTIC_ERROR_FILE from its
# LogsSpecs and OMP_NUM_THREADS from torchrun's config, plus dlfleet's two.
TORCHRUN_KEYS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
}
DLFLEET_KEYS = {"DLFLEET_MASTER", "DLFLEET_ROUND", "PYTHONPATH"}
SIZES = (2, 1, 3)


def config(nproc: int, **kw: object) -> AgentConfig:
    return AgentConfig(
        training_script="t.py",
        master="m:1",
        token="t",
        nproc_per_node=nproc,
        **kw,  # type: ignore[arg-type]
    )


def assignment(
    group_rank: int, sizes: tuple[int, ...] = SIZES, round_id: int = 4
) -> RoundAssignment:
    return RoundAssignment(
        round=round_id,
        group_rank=group_rank,
        group_world_size=len(sizes),
        world_size=sum(sizes),
        local_world_size=sizes[group_rank],
        rank_offset=sum(sizes[:group_rank]),
        bootstrap_host="10.0.0.9",
        bootstrap_port=29511,
    )


def envs_of(group_rank: int, sizes: tuple[int, ...] = SIZES, **kw: object) -> list[dict[str, str]]:
    agent_environ = kw.pop("agent_environ", {})
    return worker_environments(
        config(sizes[group_rank], **kw),
        assignment(group_rank, sizes),
        restart_count=2,
        error_file_dir=Path("/logs/4"),
        master_address="master:50051",
        agent_environ=agent_environ,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("group_rank", range(len(SIZES)))
def test_global_ranks_are_prefix_sums_of_lower_group_ranks(group_rank: int) -> None:
    envs = envs_of(group_rank)
    offset = sum(SIZES[:group_rank])
    assert [e["RANK"] for e in envs] == [str(offset + r) for r in range(SIZES[group_rank])]
    assert [e["LOCAL_RANK"] for e in envs] == [str(r) for r in range(SIZES[group_rank])]
    for env in envs:
        assert env["WORLD_SIZE"] == "6"
        assert env["LOCAL_WORLD_SIZE"] == str(SIZES[group_rank])
        assert env["GROUP_RANK"] == str(group_rank)
        assert env["GROUP_WORLD_SIZE"] == "3"
        assert env["ROLE_RANK"] == env["RANK"]
        assert env["ROLE_WORLD_SIZE"] == "6"


def test_the_nodes_of_a_round_cover_every_global_rank_once() -> None:
    ranks = [int(e["RANK"]) for g in range(len(SIZES)) for e in envs_of(g)]
    assert sorted(ranks) == list(range(sum(SIZES)))


def test_every_torchrun_variable_is_set_and_nothing_else() -> None:
    for env in envs_of(2):
        assert set(env) == TORCHRUN_KEYS | DLFLEET_KEYS


def test_the_shared_variables_come_from_the_config_and_the_round() -> None:
    env = envs_of(0, role="trainer", run_id="exp", max_restarts=5)[1]
    assert env["ROLE_NAME"] == "trainer"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.9", "29511")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "5"
    assert env["TORCHELASTIC_RUN_ID"] == "exp"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert (env["DLFLEET_MASTER"], env["DLFLEET_ROUND"]) == ("master:50051", "4")


def test_each_local_rank_has_its_own_error_file() -> None:
    files = [e["TORCHELASTIC_ERROR_FILE"] for e in envs_of(2)]
    assert files == [str(error_file_path(Path("/logs/4"), r)) for r in range(3)]
    assert files[0] == "/logs/4/0/error.json"


def test_omp_threads_is_one_when_several_processes_share_the_node() -> None:
    assert envs_of(0)[0]["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in envs_of(1)[0]  # a single process keeps the default


def test_the_users_own_settings_in_the_agents_environment_are_kept() -> None:
    agent_environ = {
        "OMP_NUM_THREADS": "4",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    env = envs_of(0, agent_environ=agent_environ)[0]
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_extra_variables_are_merged_but_cannot_redefine_torchruns() -> None:
    args = (config(1), assignment(1), 0, Path("/l"), "m:1")
    envs = worker_environments(*args, agent_environ={}, extra={"DLFLEET_NODE_ID": "n#1"})
    assert envs[0]["DLFLEET_NODE_ID"] == "n#1"
    with pytest.raises(InvalidArgument, match="RANK"):
        worker_environments(*args, agent_environ={}, extra={"RANK": "0"})


def test_a_round_that_disagrees_with_nproc_per_node_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="--nproc-per-node is 2"):
        worker_environments(config(2), assignment(1), 0, Path("/l"), "m:1", agent_environ={})


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"group_rank": 3}, "group rank 3"),
        ({"local_world_size": 0}, ">= 1"),
        ({"rank_offset": 5}, "rank offset 5"),
        ({"group_rank": 2, "rank_offset": 1}, "rank offset 1"),
        ({"world_size": 3}, "cannot hold 2 here and 2 other nodes"),
        ({"bootstrap_port": 0}, "bootstrap"),
        ({"round": -1}, "round"),
    ],
)
def test_a_malformed_assignment_is_rejected(changes: dict[str, object], words: str) -> None:
    fields: dict[str, object] = {
        "round": 1,
        "group_rank": 0,
        "group_world_size": 3,
        "world_size": 6,
        "local_world_size": 2,
        "rank_offset": 0,
        "bootstrap_host": "h",
        "bootstrap_port": 1,
    }
    with pytest.raises(InvalidArgument, match=words):
        RoundAssignment(**{**fields, **changes})  # type: ignore[arg-type]


def test_an_assignment_knows_its_world() -> None:
    a = assignment(2)
    assert (a.world_size, a.local_world_size, a.rank_offset) == (6, 3, 3)

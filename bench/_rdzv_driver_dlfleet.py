"""Rendezvous-benchmark driver for dlfleet's master, run by bench/_rdzv_harness.py.

The server: `python -m dlfleet.master` on a fresh SQLite store, its rendezvous
set to min_nodes = max_nodes = N (the round closes the moment the N-th node has
joined, the same rule the c10d side runs under).

One agent is what one dlfleet agent does to join a world. `setup()`, not
timed, is the agent's start-up: it builds its `MasterClient` on a channel of
its own, waits for that channel to connect and registers the node
(`register_node`, once in an agent's life, however many rounds follow); the
c10d agent's setup likewise connects its own TCPStore client and builds its
handler, whose backend writes its first state key to the store. `join()`, timed,
is one `join_rendezvous`, which returns once the round has its N nodes: the
counterpart of c10d's timed `next_rendezvous()`.

Each agent's channel gets its own TCP connection (`grpc.use_local_subchannel_pool`),
as a real node would have; otherwise gRPC would multiplex every agent of one
harness process onto one connection, which the c10d agents, one TCPStore client
and socket each, do not get.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlfleet.api.client import MasterClient

JOB_NAME = "job"
CONNECT_TIMEOUT_S = 30.0


def server_command(
    python: str, port: int, nodes: int, workdir: Path, options: dict[str, str]
) -> tuple[list[str], str]:
    """The argv of the master process, and the text it prints once it serves."""
    argv = [
        python,
        "-m",
        "dlfleet.master",
        "--port",
        str(port),
        "--store",
        f"sqlite:///{workdir / f'rdzv-{nodes}-{port}.db'}",
        "--token",
        options["token"],
        "--job-name",
        JOB_NAME,
        "--min-nodes",
        str(nodes),
        "--max-nodes",
        str(nodes),
        "--join-timeout",
        options.get("timeout_s", "120"),
        # torch's rendezvous logs at INFO into no handler; nor do we log per join.
        "--log-level",
        "WARNING",
    ]
    return argv, f"listening on 127.0.0.1:{port}"


class DlfleetAgent:
    def __init__(
        self, target: str, nodes: int, run_id: str, index: int, options: dict[str, str]
    ) -> None:
        self.index = index
        self._target = target
        self._nodes = nodes
        self._node_name = f"{run_id}-agent-{index}"
        self._token = options["token"]
        self._timeout_s = float(options.get("timeout_s", "120"))
        self._client: MasterClient | None = None

    def setup(self) -> None:
        import grpc

        from dlfleet.api.client import MasterClient

        # MasterClient's own channel options, plus a connection of our own.
        channel = grpc.insecure_channel(
            self._target,
            options=[
                ("grpc.enable_retries", 0),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        self._client = MasterClient(self._target, token=self._token, channel=channel)
        self._registration = self._client.register_node(
            job_name=JOB_NAME, node_name=self._node_name, local_world_size=1
        )

    def join(self) -> dict[str, Any]:
        client = self._client
        assert client is not None, "setup() first"
        reg = self._registration
        started = time.monotonic()
        result = client.join_rendezvous(
            node_id=reg.node_id,
            incarnation=reg.incarnation,
            local_world_size=1,
            host="127.0.0.1",
            bootstrap_port=0,
            timeout_s=self._timeout_s,
        )
        world = result.group_world_size
        if not 0 <= result.group_rank < world:
            raise RuntimeError(f"rank {result.group_rank} of {world}")
        # Nodes of one process each: the global ranks are the group ranks.
        place = (result.world_size, result.local_world_size, result.rank_offset)
        if place != (world, 1, result.group_rank):
            raise RuntimeError(
                f"world {result.world_size}, local {result.local_world_size}, offset "
                f"{result.rank_offset} for group rank {result.group_rank} of {world} nodes of 1"
            )
        return {
            "round": int(result.round),
            "rank": int(result.group_rank),
            "world_size": int(world),
            # The bootstrap endpoint, which every member must see alike (the
            # answer no longer lists the members: the ranks are checked distinct).
            "group": f"{result.bootstrap_host}:{result.bootstrap_port}",
            "join_s": time.monotonic() - started,
        }

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def make_agent(
    target: str, nodes: int, run_id: str, index: int, options: dict[str, str]
) -> DlfleetAgent:
    return DlfleetAgent(target, nodes, run_id, index, options)


if __name__ == "__main__":
    sys.exit("run by bench/_rdzv_harness.py, not directly")

"""Stock torchrun as a dlfleet client:

    torchrun --rdzv-backend=dlfleet --rdzv-endpoint=MASTER_HOST:PORT \\
             --nnodes=1:4 --nproc-per-node=2 train.py

Registered under the `torchrun.handlers` entry-point group. torchrun's own
agent keeps launching and restarting the workers; the world is formed by the
dlfleet master: each `next_rendezvous()` is one join on the node's session
(with a spare port, so that the master joins the node into the next round
itself when a round closes, like dlfleet's own agent). Every round gets
a fresh TCPStore for torchrun's control plane, hosted by group rank 0 on the
port it offered at join, so no key of an earlier round is ever read again (the
failure mode of torchrun's c10d backend after a crashed rank). The master's
re-rendezvous push, not polling, is what `num_nodes_waiting()` reports.

The job token comes from `--rdzv-conf token=...` or $DLFLEET_TOKEN; the job
name from `--rdzv-conf job_name=...` (default "job", dlmaster's default).

The workers' ShardedDataLoader leases from the master as under dlworker: torchrun
starts (and restarts) the workers from this process's environment right after
each `next_rendezvous()` (`SimpleElasticAgent._initialize_workers`), so that
is where the master's address, the token, the node id and the new round go.

The node's checkpoint images live here too, as under dlworker: this process
runs the node's keeper (`dlfleet.worker.agent.keeper`: the images in shared
memory, reported to the master, copied to the next node of the round, served
to whoever restores) and tells the workers where it is. torchrun restarts
its workers cold, but the images outlive them: a restarted worker's
`Checkpointer.load()` restores the newest committed step from this node's
memory or a peer's replica. They go when torchrun exits (`shutdown`).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from datetime import timedelta

from torch.distributed import (  # type: ignore[attr-defined]  # exported at run time only
    Store,
    TCPStore,
)
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from dlfleet.api.client import AgentSession, MasterClient, join_request
from dlfleet.api.env import CHECKPOINT_DIR_ENV, KEEPER_ENV, MAX_NODES_ENV, TOKEN_ENV
from dlfleet.api.errors import DlfleetError, Unavailable
from dlfleet.worker.address import interface_environment, observe_and_choose
from dlfleet.worker.agent.keeper import ImageKeeper
from dlfleet.worker.agent.keeper_server import AgentServer, start_keeper
from dlfleet.worker.agent.processes import free_ports
from dlfleet.worker.loader.environment import launcher_variables

_log = logging.getLogger(__name__)

BACKEND = "dlfleet"
STORE_TIMEOUT = timedelta(seconds=120)
# The keeper's server threads: each worker's Saved call holds one while its
# step commits (bounded), peers' replicas and fetches another each.
KEEPER_THREADS = 64


class DlfleetRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters) -> None:
        token = str(params.config.get("token") or os.environ.get(TOKEN_ENV, ""))
        if not token:
            raise RendezvousError(f"dlfleet rendezvous needs the job token: ${TOKEN_ENV}")
        self._params = params
        self._token = token
        self._host = ""  # chosen at registration, as dlworker's (`dlfleet.worker.address`)
        self._bind = ""
        self._client = MasterClient(params.endpoint, token=token)
        self._job = str(params.config.get("job_name", "job"))
        self._name = f"{socket.gethostname()}-{os.getpid()}"
        self._node_id = ""
        self._incarnation = 0
        self._session: AgentSession | None = None
        self._server: AgentServer | None = None
        self._keeper: ImageKeeper | None = None
        self._round = 0
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError()
        try:
            if self._session is None:
                self._register()
            assert self._session is not None
            self._session.drop_pushes()
            # The spare port lets the master join this node into the next
            # round itself when this one closes, as it does the agent's: the
            # next round forms while torchrun restarts its workers.
            port, spare = free_ports(self._bind, 2)
            joined = self._session.join(
                join_request(
                    self._node_id, self._incarnation, 1, self._host, port,
                    keeper_address=self._server.peer_address if self._server else "",
                    next_bootstrap_port=spare,
                )
            )  # fmt: skip
        except Unavailable as error:
            raise RendezvousConnectionError(str(error)) from error
        except DlfleetError as error:
            raise RendezvousError(str(error)) from error
        self._round = joined.round
        self._session.round = joined.round
        if self._keeper is not None:
            self._keeper.set_peer(joined.keeper_peer or None)
        # Read by torchrun when it starts this round's workers, next.
        os.environ.update(
            launcher_variables(self._params.endpoint, self._token, joined.round, self._node_id)
        )
        if self._server is not None and self._keeper is not None:
            os.environ[KEEPER_ENV] = self._server.local_address
            os.environ[CHECKPOINT_DIR_ENV] = str(self._keeper.own_dir)
        store: Store = TCPStore(
            joined.bootstrap_host,
            joined.bootstrap_port,
            world_size=joined.group_world_size,
            is_master=joined.group_rank == 0,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
        )
        bootstrap = RendezvousStoreInfo.build(joined.group_rank, store, self._host)
        _log.info(
            "dlfleet round %d: group rank %d of %d", joined.round, joined.group_rank,
            joined.group_world_size,
        )  # fmt: skip
        return RendezvousInfo(store, joined.group_rank, joined.group_world_size, bootstrap)

    def _register(self) -> None:
        try:
            self._choose_address(None)
            registered = self._client.register_node(
                job_name=self._job, node_name=self._name, local_world_size=1, host=self._host
            )
            self._choose_address(registered.observed_host or None)
        except (LookupError, OSError, ValueError) as error:
            raise RendezvousError(str(error)) from error
        self._node_id, self._incarnation = registered.node_id, registered.incarnation
        if registered.max_nodes > 0:  # the workers inherit torchrun's environment
            os.environ[MAX_NODES_ENV] = str(registered.max_nodes)
        interval = max(registered.heartbeat_interval_ms, 100) / 1000
        self._session = self._client.agent_session(self._node_id, self._incarnation, interval)
        self._start_keeper()

    def _start_keeper(self) -> None:
        """The node's image keeper and its server (see the module's doc)."""
        self._server, self._keeper = start_keeper(
            None,
            client=self._client,
            token=self._token,
            node_id=self._node_id,
            incarnation=self._incarnation,
            name=f"torchrun-{os.getpid()}-{secrets.token_hex(3)}",
            host=self._bind,
            published=self._host,
            threads=KEEPER_THREADS,
            session=self._session,
        )

    def _choose_address(self, master_saw: str | None) -> None:
        """The node's address, as dlworker chooses it (torchrun's --local-addr
        wins); the workers, started by torchrun from this process's
        environment, get the interface's GLOO/NCCL/TP_SOCKET_IFNAME where
        the user set none."""
        choice = observe_and_choose(
            self._params.local_addr, os.environ, self._params.endpoint, master_saw
        )
        if choice.bind:
            free_ports(choice.bind, 1)  # a local address: fail here, not in the workers
        self._host, self._bind = choice.address, choice.bind
        if master_saw is None:
            return
        for warning in choice.warnings:
            _log.warning("%s", warning)
        interface_env = interface_environment(choice, os.environ)
        os.environ.update(interface_env)
        _log.info(
            "this node's address: %s (%s; interface %s)%s", choice.address, choice.reason,
            choice.interface or "none",
            "; the workers get " + " ".join(f"{k}={v}" for k, v in interface_env.items())
            if interface_env else "",
        )  # fmt: skip

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        """Non-zero once the master pushed a re-rendezvous for our round:
        torchrun's agent then restarts its workers and joins again."""
        session = self._session
        if session is None:
            return 0
        pushes = session.waiting_pushes()
        return int(any(push.closed_round >= self._round for push in pushes))

    def get_run_id(self) -> str:
        return self._params.run_id

    def shutdown(self) -> bool:
        if self._session is not None:
            try:
                self._client.leave_rendezvous(self._node_id, self._incarnation, "succeeded")
            except DlfleetError as error:
                _log.warning("leaving the dlfleet rendezvous failed: %s", error)
            self._session.close()
            self._session = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._keeper is not None:
            self._keeper.close()  # the images go with the job's last workers
            self._keeper = None
        self._client.close()
        return True


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return DlfleetRendezvousHandler(params)


def handler_creator() -> object:
    """The `torchrun.handlers` entry point: torch calls it once and registers
    what it returns as the creator of `--rdzv-backend=dlfleet` handlers."""
    return create_handler

"""The agent's gRPC server: the `Keeper` service, for this node's workers (on
a Unix socket) and its peers (on TCP).

On Linux the workers' socket is an abstract one (`worker_endpoint`): it is
gone with the agent however the agent ends, where a socket file in /tmp
outlives an agent that is killed.

Workers attach here for in-process restarts (`orders.py`) and announce their
checkpoint images; peer agents replicate and fetch images. Every call carries
the job token, checked as on the master (`dlfleet.api.serving.tokens`).
"""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Protocol

import grpc

from dlfleet.api.addresses import with_port
from dlfleet.api.client import AgentSession, MasterClient
from dlfleet.api.errors import InvalidArgument, NotFound, Unimplemented
from dlfleet.api.serving.answers import answer, answer_stream
from dlfleet.api.serving.tokens import TokenCheck
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from dlfleet.worker.agent.keeper import ImageKeeper
from dlfleet.worker.agent.orders import WorkerOrders
from dlfleet.worker.checkpoint.errors import CheckpointError, ImageChangedError

_log = logging.getLogger(__name__)


class Images(Protocol):
    """What the agent does with checkpoint images (keeper.py)."""

    def saved(self, notice: checkpoint_pb2.SavedNotice) -> checkpoint_pb2.SavedAck: ...

    def receive(
        self, pieces: Iterator[checkpoint_pb2.ImagePiece]
    ) -> checkpoint_pb2.ReplicateAck: ...

    def send(self, request: checkpoint_pb2.FetchRequest) -> Iterator[checkpoint_pb2.ImagePiece]: ...


class KeeperService(checkpoint_pb2_grpc.KeeperServicer):
    """Handlers raise domain errors; `answer` and `answer_stream` give them
    their status by the one table (`dlfleet.api.status`), as the master's
    and the brain's services do."""

    def __init__(self, orders: WorkerOrders | None, images: Images | None = None) -> None:
        """`orders`: None where nothing restarts the workers in place (the
        torchrun rendezvous handler's keeper): `Attach` is refused."""
        self.orders = orders
        self.images = images

    @answer_stream
    def Attach(
        self, request: checkpoint_pb2.AttachRequest, context: grpc.ServicerContext
    ) -> Iterator[checkpoint_pb2.WorkerOrder]:
        orders = self.orders
        if orders is None:
            raise Unimplemented(
                "this node restarts its workers cold (torchrun): no in-place restarts"
            )
        line = orders.open_line(request.pid, request.spare)
        _log.info("process %d attached%s", request.pid, " as a spare" if request.spare else "")
        # A process that dies cancels its stream: end the generator's wait.
        context.add_callback(lambda: orders.close_line(line))
        try:
            yield from orders.orders_of(line)
        finally:
            orders.close_line(line)

    def Report(
        self, request: checkpoint_pb2.WorkerState, context: grpc.ServicerContext
    ) -> checkpoint_pb2.WorkerStateAck:
        if self.orders is not None:
            self.orders.report(request.pid, request.round, request.state, request.detail)
        return checkpoint_pb2.WorkerStateAck()

    @answer
    def Saved(
        self, request: checkpoint_pb2.SavedNotice, context: grpc.ServicerContext
    ) -> checkpoint_pb2.SavedAck:
        images = self._images()
        try:
            return images.saved(request)
        except CheckpointError as exc:
            raise InvalidArgument(str(exc)) from exc

    @answer
    def Replicate(
        self, request_iterator: Iterator[checkpoint_pb2.ImagePiece], context: grpc.ServicerContext
    ) -> checkpoint_pb2.ReplicateAck:
        images = self._images()
        try:
            return images.receive(request_iterator)
        except CheckpointError as exc:
            raise InvalidArgument(str(exc)) from exc

    @answer_stream
    def Fetch(
        self, request: checkpoint_pb2.FetchRequest, context: grpc.ServicerContext
    ) -> Iterator[checkpoint_pb2.ImagePiece]:
        images = self._images()
        try:
            yield from images.send(request)
        except ImageChangedError as exc:
            raise NotFound(f"overwritten while read: {exc}") from exc
        except CheckpointError as exc:
            raise NotFound(str(exc)) from exc

    def _images(self) -> Images:
        if self.images is None:
            raise Unimplemented("this agent keeps no checkpoint images")
        return self.images


def worker_endpoint(name: str) -> str:
    """Where this node's workers reach the agent: the abstract Unix socket
    `name` on Linux (no file: it vanishes with the agent's process, even
    killed), elsewhere a socket file `name.sock` in the temp folder."""
    if sys.platform.startswith("linux"):
        return f"unix-abstract:{name}"
    return f"unix:{Path(tempfile.gettempdir()) / f'{name}.sock'}"


class AgentServer:
    """Serves `service` on `local_address` (a Unix socket: `unix:<path>` or
    `unix-abstract:<name>`) and on `<host>:0` (TCP); the other nodes dial
    `published` (the node's address: `host` unless NATed)."""

    def __init__(
        self,
        service: KeeperService,
        *,
        token: str,
        local_address: str,
        host: str,
        threads: int,
        published: str | None = None,
    ) -> None:
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="keeper"),
            interceptors=[TokenCheck(token)],
            options=[
                ("grpc.so_reuseport", 0),
                # Image pieces: 2 MiB of body, plus the header in the first.
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        checkpoint_pb2_grpc.add_KeeperServicer_to_server(service, self._server)
        # A socket file (not an abstract socket) is made here and removed at stop.
        path = local_address.removeprefix("unix:")
        self._socket_path = Path(path) if path != local_address else None
        if self._socket_path is not None:
            self._socket_path.parent.mkdir(parents=True, exist_ok=True)
            self._socket_path.unlink(missing_ok=True)
        self.local_address = local_address
        self._server.add_insecure_port(self.local_address)
        port = self._server.add_insecure_port(with_port(host or "0.0.0.0", 0))
        self.peer_address = with_port(published or host, port)

    def start(self) -> None:
        self._server.start()
        _log.info("keeper listening on %s and %s", self.local_address, self.peer_address)

    def stop(self) -> None:
        self._server.stop(grace=0.5).wait(2.0)
        if self._socket_path is not None:
            self._socket_path.unlink(missing_ok=True)


def start_keeper(
    orders: WorkerOrders | None,
    *,
    client: MasterClient,
    token: str,
    node_id: str,
    incarnation: int,
    name: str,
    host: str,
    published: str,
    threads: int,
    session: AgentSession | None = None,
) -> tuple[AgentServer, ImageKeeper]:
    """A node's image keeper and the server its workers and peers reach it
    on (the workers at `worker_endpoint(name)`), started: dlworker's agent
    and torchrun's dlfleet rendezvous handler each run one. The node's
    `session` brings the keeper the checkpoint progress the master pushes."""
    service = KeeperService(orders)
    server = AgentServer(
        service,
        token=token,
        local_address=worker_endpoint(name),
        host=host,
        published=published,
        threads=threads,
    )
    keeper = ImageKeeper.create(
        client=client,
        token=token,
        node_id=node_id,
        incarnation=incarnation,
        address=server.peer_address,
    )
    service.images = keeper
    if session is not None:
        session.on_checkpoint_progress = keeper.heard_progress
    server.start()
    return server, keeper

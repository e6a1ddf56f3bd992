"""The agent's checkpoint images: kept in shared memory, reported to the
master, copied to one peer node, served to whoever restores.

The node's workers write their images (see `dlfleet.worker.checkpoint.files`)
into `<root>/own`, a folder in /dev/shm that this agent creates and removes:
the images outlive the worker processes, not the agent. After each save a
worker tells the agent (`Keeper.Saved`); the agent then

- reports the image to the master, which commits a step once every rank of
  the round reported it (one report per step for all local ranks that saved
  it), and answers the newest committed step back to the workers;
- copies the newest image of each local rank to the next node of the round
  (a ring over the group ranks), newest first and skipping steps it has no
  time for: a replica may lag, it is never half-written. The peer keeps it in
  `<root>/replicas/<node>` (two slots per rank) and reports it as a replica;
- answers the worker once the step is committed and *replicated* (every
  rank's image of it, on every node, has a copy on a second node; the master
  keeps that count too), bounded in time. The worker's next save waits for
  that answer, so a rank that finished step s+1 knows the loss of any one
  node loses no image of step s: a failure costs at most one step.

`Fetch` serves any image this node holds, own or replica. Images are shipped
as opaque bytes: the agent imports no torch.

Invariants:
- a replica's header is written after its body, by rename, so a reader never
  sees half a replica; the slot holding the newest replica of a rank is never
  the one overwritten;
- reports and replication happen off the workers' path: `saved` only queues.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.env import SHM_DIR_ENV
from dlfleet.api.errors import DlfleetError, Unavailable
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.errors import CheckpointError

_log = logging.getLogger(__name__)

PIECE_BYTES = 2 << 20  # under gRPC's default 4 MiB message limit, header included
REPLICA_SLOTS = 2
COMMIT_WAIT_S = 1.0  # how long `Saved` waits for its step's commit before answering
REPLICA_WAIT_S = 1.0  # and then for every rank's copy on a second node
REPLICA_POLL_S = 0.05  # asking the master, once this node's own copies are out
# A master that has not answered a report for this long is taken as away (it
# restarts, or is cut off): saves then stop waiting for it, see `saved`.
MASTER_SLOW_S = 0.5
REPORT_TIMEOUT_S = 2.0  # one attempt of an own report; then it is sent again
REPORT_RETRY_S = 0.1  # how soon, while the master is away
_WAIT_SLICE_S = 0.05
_OWNER_FILE = "owner"
_FOLDER = re.compile(r"^dlworker-(\d+)-[0-9a-f]+$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def shm_base() -> Path:
    base = os.environ.get(SHM_DIR_ENV)
    if base:
        return Path(base)
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def remove_stale_folders(base: Path) -> list[Path]:
    """Folders of agents that died without cleaning up (SIGKILL, a lost node
    whose machine lived on): their images are nobody's now."""
    removed = []
    for path in base.glob("dlworker-*"):
        match = _FOLDER.match(path.name)
        if match is None or not path.is_dir():
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # its agent lives
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@dataclass(frozen=True)
class _Held:
    header_path: Path
    header: files.ImageHeader


class ImageKeeper:
    def __init__(
        self,
        root: Path,
        *,
        client: MasterClient,
        token: str,
        node_id: str,
        incarnation: int,
        address: str,
    ) -> None:
        self.root = root
        self.own_dir = root / "own"
        self.replica_dir = root / "replicas"
        self.own_dir.mkdir(parents=True, exist_ok=True)
        self.replica_dir.mkdir(parents=True, exist_ok=True)
        (root / _OWNER_FILE).write_text(str(os.getpid()))
        self._client = client
        # For the status polls a save waits on: one short attempt each.
        self._quick = client.sharing_channel(timeout_s=0.5, retry=RetryPolicy(attempts=1))
        self._quick_reports = client.sharing_channel(
            timeout_s=REPORT_TIMEOUT_S, retry=RetryPolicy(attempts=1)
        )
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self.node_id = node_id
        self.incarnation = incarnation
        self.address = address
        self._lock = threading.Lock()
        self._commits = threading.Condition(self._lock)
        self._committed = -1
        self._replicated_step = -1  # the master's word, as last heard
        self._report_since: float | None = None  # a report in flight since (monotonic)
        self._master_away = False  # the last call to the master failed
        self._own: dict[int, _Held] = {}  # newest own image per rank
        self._peer: str | None = None
        self._channel: tuple[str, grpc.Channel] | None = None  # to the peer, reused
        self._reports: queue.Queue[_Held | None] = queue.Queue()
        self._replicate = threading.Event()
        self._replicated: dict[tuple[str, int], int] = {}  # (peer, rank) -> step sent
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._report_loop, name="keeper-report", daemon=True),
            threading.Thread(target=self._replicate_loop, name="keeper-replicate", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def create(
        cls, *, client: MasterClient, token: str, node_id: str, incarnation: int, address: str
    ) -> ImageKeeper:
        base = shm_base()
        for path in remove_stale_folders(base):
            _log.info("removed the checkpoint images of a dead agent: %s", path)
        root = base / f"dlworker-{os.getpid()}-{os.urandom(3).hex()}"
        return cls(
            root,
            client=client,
            token=token,
            node_id=node_id,
            incarnation=incarnation,
            address=address,
        )

    @property
    def committed(self) -> int:
        with self._lock:
            return self._committed

    def bytes_held(self) -> int:
        total = 0
        for path in self.root.rglob("*.body"):
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    def set_peer(self, address: str | None) -> None:
        """The node this one copies its images to (None: no peer, alone)."""
        with self._lock:
            changed = address != self._peer
            self._peer = address or None
        if changed and address:
            self._replicate.set()

    # ------------------------------------------------------------ workers

    def saved(self, notice: checkpoint_pb2.SavedNotice) -> checkpoint_pb2.SavedAck:
        path = Path(notice.path)
        if path.parent.resolve() != self.own_dir.resolve():
            raise CheckpointError(f"{path} is not in this agent's folder {self.own_dir}")
        try:
            header = files.read_header(path)
        except (OSError, CheckpointError) as exc:
            _log.warning("an announced image cannot be read: %s", exc)
            return checkpoint_pb2.SavedAck(committed_step=self.committed)
        held = _Held(path, header)
        with self._lock:
            self._own[header.rank] = held
        self._reports.put(held)
        self._replicate.set()
        # The worker's next save waits for this answer (in the background of
        # its training step): answer once the step is committed (at most
        # COMMIT_WAIT_S) and replicated, so that losing any one node loses at
        # most the next step (at most REPLICA_WAIT_S more: a large image
        # replicates at the network's pace, and training must not).
        # Only the master can say either, so while it is away (a restart
        # takes seconds) waiting gains nothing: training goes on, and the
        # steps commit once it answers again. Losing a node in that window
        # too can lose the steps since the last commit.
        deadline = time.monotonic() + COMMIT_WAIT_S
        with self._commits:
            while self._committed < header.step and not self._master_away_locked():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._commits.wait(min(left, _WAIT_SLICE_S))
        self._wait_replicated(header.step, time.monotonic() + REPLICA_WAIT_S)
        return checkpoint_pb2.SavedAck(committed_step=self.committed)

    def _master_away_locked(self) -> bool:
        """The last call to the master failed, or a report has been in
        flight for MASTER_SLOW_S (its retries ride out a restart)."""
        since = self._report_since
        return self._master_away or (since is not None and time.monotonic() - since > MASTER_SLOW_S)

    @property
    def master_away(self) -> bool:
        with self._lock:
            return self._master_away_locked()

    def _wait_replicated(self, step: int, deadline: float) -> None:
        """Until the master counts `step` replicated, or `deadline`. The
        answers this node hears anyway (its reports, the replicas it receives,
        the acks of those it sends) usually tell; once this node's own copies
        are out and the word is still missing (another node's report came
        last), the master is asked every REPLICA_POLL_S."""
        while True:
            with self._commits:
                if self._peer is None or self._replicated_step >= step:
                    return
                left = deadline - time.monotonic()
                if left <= 0 or self._master_away_locked():
                    return
                self._commits.wait_for(
                    lambda: self._peer is None or self._replicated_step >= step,
                    min(left, REPLICA_POLL_S),
                )
                ask = self._replicated_step < step and self._own_copies_out(step)
            if ask and time.monotonic() < deadline:
                try:  # one quick attempt: the next poll is the retry
                    heard = self._quick.checkpoint_status().replicated_step
                except DlfleetError as exc:
                    _log.debug("checkpoint status not answered: %s", exc)
                    with self._commits:
                        self._master_away = self._master_away or isinstance(exc, Unavailable)
                    continue
                self._heard(heard)

    def _own_copies_out(self, step: int) -> bool:
        """This node's images of `step` (or newer) are all on the peer."""
        peer = self._peer
        return peer is not None and all(
            self._replicated.get((peer, rank), -1) >= step
            for rank, held in self._own.items()
            if held.header.step >= step
        )

    def _heard(self, replicated_step: int) -> None:
        """The master's word on the newest replicated step (not a maximum: a
        restore abandons the steps after it)."""
        with self._commits:
            self._master_away = False
            self._replicated_step = replicated_step
            self._commits.notify_all()

    def _report_loop(self) -> None:
        """Report what this node's ranks saved, newest first in line. A report
        the master did not take for being away is sent again every
        REPORT_RETRY_S (unless a newer image of its rank came), one attempt
        each, so the first attempt after the master is back is within that,
        not after a back-off of up to a second."""
        unsent: list[_Held] = []
        while True:
            try:
                first = self._reports.get(timeout=REPORT_RETRY_S if unsent else None)
            except queue.Empty:
                first = unsent.pop()
            if first is None:
                return
            batch = [*unsent, first]
            unsent = []
            while True:  # the other local ranks' saves of the step, if already in
                try:
                    more = self._reports.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._reports.put(None)
                    break
                batch.append(more)
            # Only each rank's newest image is worth a report: the master
            # commits the newest step every rank holds, and the older ones
            # are about to be dropped. After a master outage the backlog is
            # then one report per step still open, not one per step missed,
            # and the saves waiting for the current step's commit wait less.
            newest: dict[int, _Held] = {}
            for held in batch:
                h = held.header
                kept = newest.get(h.rank)
                if kept is None or (h.round, h.step) >= (kept.header.round, kept.header.step):
                    newest[h.rank] = held
            by_step: dict[tuple[int, int, int], list[_Held]] = {}
            for held in newest.values():
                h = held.header
                by_step.setdefault((h.step, h.round, h.world_size), []).append(held)
            for (step, round_, world), images in sorted(by_step.items()):
                if self._report(step, round_, world, images, replica=False) is None:
                    unsent += images if self.master_away else []

    def _report(
        self, step: int, round_: int, world: int, images: list[_Held], *, replica: bool
    ) -> int | None:
        """Tell the master; the newest replicated step it answers (-1: none;
        None: not taken). An own report makes one attempt (the report loop
        sends it again); a replica's rides out a master restart."""
        copies = [
            checkpoint_pb2.ImageCopy(
                rank=held.header.rank,
                node_id=self.node_id,
                address=self.address,
                replica=replica,
                bytes=held.header.body_nbytes,
            )
            for held in images
        ]
        report = checkpoint_pb2.CheckpointReport(
            node_id=self.node_id,
            incarnation=self.incarnation,
            step=step,
            round=round_,
            world_size=world,
            copies=copies,
            dropped_below=self._oldest_held(),
        )
        if not replica:
            with self._commits:
                self._report_since = time.monotonic()
        try:
            client = self._client if replica else self._quick_reports
            answer = client.report_checkpoint(report)
        except DlfleetError as exc:
            away = isinstance(exc, Unavailable)
            if away:
                _log.debug("checkpoint report of step %d not taken: %s", step, exc)
            else:
                _log.warning("checkpoint report of step %d not taken: %s", step, exc)
            with self._commits:
                if not replica:
                    self._report_since = None
                self._master_away = self._master_away or away
                self._commits.notify_all()
            return None
        with self._commits:
            if not replica:
                self._report_since = None
            self._master_away = False
            # The master's word, not a maximum: a restore abandons the steps after
            # it, and the commits of the round that failed go with them.
            self._committed = answer.committed_step
            self._replicated_step = answer.replicated_step
            self._commits.notify_all()
        return answer.replicated_step

    def _oldest_held(self) -> int:
        steps = [image.header.step for image in files.list_images(self.own_dir)]
        for folder in self.replica_dir.iterdir():
            steps += [image.header.step for image in files.list_images(folder)]
        return min(steps, default=0)

    # ------------------------------------------------------- replication

    def _replicate_loop(self) -> None:
        while not self._closed.is_set():
            self._replicate.wait()
            self._replicate.clear()
            if self._closed.is_set():
                return
            with self._lock:
                peer = self._peer
                todo = [
                    held
                    for rank, held in sorted(self._own.items())
                    if peer is not None
                    and self._replicated.get((peer, rank), -1) < held.header.step
                ]
            if peer is None:
                continue
            for held in todo:
                ack = self._send_replica(peer, held)
                if ack is None:
                    continue
                with self._commits:
                    self._replicated[(peer, held.header.rank)] = held.header.step
                    self._commits.notify_all()
                if ack.replicated_step >= 0:
                    self._heard(ack.replicated_step)

    def _peer_channel(self, peer: str) -> grpc.Channel:
        """One channel per peer, kept while the peer stays (a connection per
        replica cost more than a small image's copy)."""
        with self._lock:
            current = self._channel
            if current is not None and current[0] == peer:
                return current[1]
            channel = grpc.insecure_channel(peer)
            self._channel = (peer, channel)
        if current is not None:
            current[1].close()
        return channel

    def _send_replica(self, peer: str, held: _Held) -> checkpoint_pb2.ReplicateAck | None:
        try:
            header, body = files.read_image_bytes(held.header_path)
        except (OSError, CheckpointError) as exc:
            # Overwritten by a newer save meanwhile: that one is queued next.
            _log.debug("image of rank %d not replicated: %s", held.header.rank, exc)
            return None
        decoded = files.decode_header(header)
        stub = checkpoint_pb2_grpc.KeeperStub(self._peer_channel(peer))
        try:
            ack: checkpoint_pb2.ReplicateAck = stub.Replicate(
                _pieces(decoded, header, body, self.node_id),
                metadata=self._metadata,
                timeout=max(30.0, len(body) / 50e6),
            )
        except grpc.RpcError as exc:
            _log.warning(
                "replica of rank %d step %d to %s failed: %s",
                decoded.rank,
                decoded.step,
                peer,
                exc.code().name,
            )
            return None
        return ack

    def receive(self, pieces: Iterator[checkpoint_pb2.ImagePiece]) -> checkpoint_pb2.ReplicateAck:
        first = next(pieces, None)
        if first is None or not first.header:
            raise CheckpointError("a replica stream must start with the image's header")
        header = files.decode_header(first.header)
        origin = _UNSAFE.sub("_", first.origin_node) or "unknown"
        folder = self.replica_dir / origin
        folder.mkdir(parents=True, exist_ok=True)
        slot = self._replica_slot(folder, header.rank)
        header_path = folder / files.header_name(header.rank, slot)
        body_path = folder / files.body_name(header.rank, slot)
        header_path.unlink(missing_ok=True)
        received = 0
        with body_path.open("wb") as body:
            for piece in _chain(first, pieces):
                if piece.offset != received:
                    raise CheckpointError(f"replica piece at {piece.offset}, expected {received}")
                body.write(piece.data)
                received += len(piece.data)
        if received != first.total_bytes:
            body_path.unlink(missing_ok=True)
            raise CheckpointError(f"replica ended after {received} of {first.total_bytes} bytes")
        renamed = files.ImageHeader(**{**header.__dict__, "body_name": body_path.name})
        tmp = header_path.with_name(header_path.name + ".tmp")
        tmp.write_bytes(files.encode_header(renamed))
        tmp.replace(header_path)
        replicated_step = self._report(
            header.step,
            header.round,
            header.world_size,
            [_Held(header_path, renamed)],
            replica=True,
        )
        return checkpoint_pb2.ReplicateAck(
            bytes=received, replicated_step=-1 if replicated_step is None else replicated_step
        )

    @staticmethod
    def _replica_slot(folder: Path, rank: int) -> int:
        held = {
            int(image.header_path.name.split(".slot-")[1].split(".")[0]): image.header.step
            for image in files.list_images(folder, rank)
        }
        free = [slot for slot in range(REPLICA_SLOTS) if slot not in held]
        if free:
            return free[0]
        return min(held, key=lambda slot: held[slot])  # the older of the two

    # ------------------------------------------------------------ fetches

    def find(self, step: int, rank: int) -> Path | None:
        for folder in [self.own_dir, *sorted(self.replica_dir.iterdir())]:
            for image in files.list_images(folder, rank):
                if image.header.step == step:
                    return image.header_path
        return None

    def send(self, request: checkpoint_pb2.FetchRequest) -> Iterator[checkpoint_pb2.ImagePiece]:
        path = self.find(request.step, request.rank)
        if path is None:
            raise CheckpointError(f"no image of rank {request.rank} step {request.step} here")
        header, body = files.read_image_bytes(path)
        yield from _pieces(files.decode_header(header), header, body, self.node_id)

    # ------------------------------------------------------------ the end

    def close(self, *, remove: bool = True) -> None:
        self._closed.set()
        self._reports.put(None)
        self._replicate.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel[1].close()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def _pieces(
    header: files.ImageHeader, raw_header: bytes, body: bytes, origin: str
) -> Iterator[checkpoint_pb2.ImagePiece]:
    for offset in range(0, max(len(body), 1), PIECE_BYTES):
        yield checkpoint_pb2.ImagePiece(
            step=header.step,
            rank=header.rank,
            round=header.round,
            world_size=header.world_size,
            origin_node=origin,
            header=raw_header if offset == 0 else b"",
            total_bytes=len(body) if offset == 0 else 0,
            offset=offset,
            data=body[offset : offset + PIECE_BYTES],
        )


def _chain(
    first: checkpoint_pb2.ImagePiece, rest: Iterator[checkpoint_pb2.ImagePiece]
) -> Iterator[checkpoint_pb2.ImagePiece]:
    yield first
    yield from rest

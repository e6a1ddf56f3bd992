"""The agent's checkpoint images: kept in shared memory, reported to the
master, copied to one peer node, served to whoever restores.

The node's workers write their images (see `dlfleet.worker.checkpoint.files`)
into `<root>/own`, a folder in /dev/shm that this agent creates and removes:
the images outlive the worker processes, not the agent. A worker tells the
agent of its newest image (`Keeper.Saved`) after a save, at most every
`ANNOUNCE_INTERVAL_S` of the Checkpointer (saves in between are history by
then); the agent then

- reports the image to the master, which commits a step once every rank of
  the round reported it (one report per step for all local ranks that saved
  it), and answers the newest committed step back to the workers;
- copies its local ranks' images to the next node of the round (a ring over
  the group ranks). A step counts as replicated once every rank's image of
  it has a copy on a second node, so the nodes copy the same steps: first
  the step the master chose for all (`replica_step`), then the step this
  node last received from its own predecessor in the ring (following it,
  which carries one step around the ring), else its newest, at most every
  LEAD_INTERVAL_S; steps it has no time for are skipped (a copy that fails,
  the peer down, is tried again after RETRY_FIRST_S, doubling to
  RETRY_MOST_S, until one succeeds or the peer changes). So the replicated
  step trails the saves by about that interval and a copy, whether the
  master answers or not. A replica may lag, it is never half-written. The
  peer keeps it in `<root>/replicas/<node>` (in slots kept as the writers
  keep theirs, see `dlfleet.worker.checkpoint.slots`) and reports it as a
  replica;
- answers the worker once the step is committed and *replicated* (every
  rank's image of it, on every node, has a copy on a second node; the master
  keeps that count too), bounded in time. The worker keeps that step's image
  and every newer one (in its slots, see `dlfleet.worker.checkpoint.slots`)
  and waits for an answer only when its slots are full: the answers run
  behind the saves, off the training step. A killed worker costs at most
  the step it was saving (a new round first tells the master the images it
  had not heard of, see `set_peer`); a lost node, at most the steps its
  peer had not yet replicated: about LEAD_INTERVAL_S and a copy's time of
  training (the slots bound it where copies cannot keep up).

`Fetch` serves any image this node holds, own or replica. Images are shipped
as opaque bytes: the agent imports no torch.

While the master is away (it restarts: seconds), only it could commit or
count replicas, so saves do not wait for it. The agent keeps the evidence
instead, so that losing a node in that window too loses no committed step:

- replicas still flow: a node receiving one reports it to the master only
  when the master answers, else later, and acks at once, so the sender's
  newer images keep coming;
- a save is answered once this node holds every rank's image of its step,
  its own ranks' and its peer's replicas (`_wait_whole`, bounded): the node
  alone could restore that step, and its workers are told it is committed,
  so they keep their images of it (the writer never overwrites the committed
  step) while the agent keeps the replicas of it (`_replica_slot`);
- when the master answers again, the agent reports every image it holds,
  own and replica, step by step (`_reconcile`); the master counts a replica
  as its rank's save, so a step held whole here is committed and restorable
  even if the other node was lost before it could report anything. A new
  round waits for that (`set_peer`, bounded), so its restore sees it.

In a ring of more than two nodes no node holds every rank's image: saves then
answer at once, as before, with the master's word.

Invariants:
- a replica's header is written after its body, by rename, so a reader never
  sees half a replica; the slot overwritten is never the one holding the
  step the master counts replicated (or one held whole in its absence), nor
  a newer one while a slot is left;
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
from collections import deque
from collections.abc import Callable, Iterator
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
from dlfleet.worker.checkpoint.slots import Held, choose, slot_count

_log = logging.getLogger(__name__)

PIECE_BYTES = 2 << 20  # under gRPC's default 4 MiB message limit, header included
# Slots per rank of a peer's replicas, allocated as first needed, and the
# memory beyond which fewer are used (never fewer than two).
REPLICA_SLOTS = 8
REPLICA_MEMORY_BYTES = 1 << 30
MAX_EARLIER_STEPS = 32  # earlier steps a report names, the newest
# The fastest pace of reports (so of commits, and of the replicas, which
# follow the master's choice of step): a save of every few milliseconds then
# costs the node's CPU a report per interval, not one per step.
REPORT_INTERVAL_S = 0.05
# The fastest pace at which a node copies its newest images of its own accord
# (the master's step and the predecessor's step go at once): the lag of the
# replicas behind fast saves, so what a lost node loses, for a copy (and the
# peer's report) each interval, not one per step.
LEAD_INTERVAL_S = 0.1
SENT_KEPT = 16  # (round, step)s remembered as sent, per peer and rank
ANSWER_WAIT_S = 2.0  # how long `Saved` waits for news before answering what it has
ASK_AFTER_S = 0.25  # a save answered nothing new this long asks the master again
# After a copy to the peer failed (it is down, or gone before the master said
# so), the next try waits this long, doubling to the most: not a retry per wake.
RETRY_FIRST_S, RETRY_MOST_S = 0.05, 1.0
SLOW_ANSWER_S = 0.5  # a save's answer slower than this is logged, with why
RECONCILE_WAIT_S = 2.0  # how long a new round waits for the master to hear this node's images
# A master that has not answered a report for this long is taken as away (it
# restarts, or is cut off): saves then stop waiting for it, see `saved`.
MASTER_SLOW_S = 0.5
REPORT_TIMEOUT_S = 2.0  # one attempt of an own report; then it is sent again
REPORT_RETRY_S = 0.1  # how soon, while the master is away
_WAIT_SLICE_S = 0.05
_NONE_SENT = (-1, -1)  # (round, step) sent to a peer: nothing yet
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


class _Wake:
    """Queued to the report loop: something is owed to the master (see `set_peer`)."""


@dataclass(frozen=True)
class _Held:
    header_path: Path
    header: files.ImageSummary
    replica: bool = False  # a peer's image, kept here

    @property
    def key(self) -> tuple[bool, int]:
        return (self.replica, self.header.rank)


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
        self.replica_dir = root / files.REPLICAS
        self.own_dir.mkdir(parents=True, exist_ok=True)
        self.replica_dir.mkdir(parents=True, exist_ok=True)
        (root / _OWNER_FILE).write_text(str(os.getpid()))
        self._client = client
        # For its own reports: one attempt each (the loop sends them again).
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
        self._replica_step = -1  # the step the master chose for every node to copy next
        self._report_since: float | None = None  # a report in flight since (monotonic)
        self._master_away = False  # the last call to the master failed
        # The newest (round, step) whose every rank's image this node held
        # while the master was away, told to the workers as committed.
        self._whole: tuple[int, int] | None = None
        self._answered: dict[int, tuple[int, int]] = {}  # rank -> (round, step) last told
        self._headers = files.HeaderCache()  # read by the report and replicate threads
        # The master may not know every image this node holds (it missed
        # reports, or a round starts with saves not yet reported): tell it
        # those of steps above `_reconcile_above` (-1: all).
        self._unreconciled = False
        self._reconcile_above = -1
        self._own: dict[int, _Held] = {}  # newest own image per rank
        self._peer: str | None = None
        self._channel: tuple[str, grpc.Channel] | None = None  # to the peer, reused
        self._reports: queue.Queue[_Held | _Wake | None] = queue.Queue()
        self._replicate = threading.Event()
        self._peer_set = threading.Event()  # wakes a wait to retry a failed copy
        self._retry: tuple[str, float] = ("", 0.0)  # peer, the last wait after a failed copy
        # (peer, rank) -> (round, step) of the newest image sent there, and
        # the last SENT_KEPT sent. By round too: after a restore the round's
        # steps repeat those of the round that failed, whose images the peer
        # got, and must go again.
        self._replicated: dict[tuple[str, int], tuple[int, int]] = {}
        self._sent: dict[tuple[str, int], deque[tuple[int, int]]] = {}
        self._received: tuple[int, int] | None = None  # newest (round, step) a peer sent here
        self._led_at = -LEAD_INTERVAL_S  # when this node last copied its newest (monotonic)
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
        """The node this one copies its images to (None: no peer, alone), set
        as a round starts. Its restore asks the master for the newest step
        every rank holds, so first the master hears every image this node
        holds that it may not know: those saved after the newest commit this
        node heard (their reports trail the saves, and a killed worker never
        sent its last), and after an outage every image held meanwhile
        (bounded by RECONCILE_WAIT_S)."""
        with self._lock:
            changed = address != self._peer
            self._peer = address or None
            self._owe_locked(self._committed)
        self._reports.put(_Wake())
        if changed and address:
            self._replicate.set()
            self._peer_set.set()
        self.wait_reconciled(RECONCILE_WAIT_S)

    def wait_reconciled(self, timeout_s: float) -> bool:
        """Until the master has heard every image this node held while it
        was away (True), or `timeout_s`."""
        with self._commits:
            return self._commits.wait_for(lambda: not self._unreconciled, timeout_s)

    # ------------------------------------------------------------ workers

    def saved(self, notice: checkpoint_pb2.SavedNotice) -> checkpoint_pb2.SavedAck:
        path = Path(notice.path)
        if path.parent.resolve() != self.own_dir.resolve():
            raise CheckpointError(f"{path} is not in this agent's folder {self.own_dir}")
        try:
            header = self._headers.read(path)
        except (OSError, CheckpointError) as exc:
            _log.warning("an announced image cannot be read: %s", exc)
            return checkpoint_pb2.SavedAck(committed_step=self.committed)
        held = _Held(path, header)
        with self._lock:
            self._own[header.rank] = held
        self._reports.put(held)
        self._replicate.set()
        # The worker frees its images older than the step it is answered
        # (see `_told`), so the answer goes once that step moved past what
        # this rank was last told, or reached this save's step (bounded:
        # the worker's notices wait for it, not its training). Only the
        # master can move it, so while it is away (a restart takes seconds)
        # the answer waits for this node to hold every rank's image of the
        # step instead (see the module's docstring): losing a node in that
        # window too then loses no step the workers were told is committed.
        started = time.monotonic()
        deadline = started + ANSWER_WAIT_S
        key = header.rank
        with self._commits:
            last_round, last = self._answered.get(key, (header.round, -1))
            if last_round != header.round:
                last = -1
            asked = started
            while not self._master_away_locked():
                told = self._told_locked(header.round)
                now = time.monotonic()
                left = deadline - now
                if told > last or told >= header.step or left <= 0:
                    break
                if now - asked >= ASK_AFTER_S:
                    # The master's word comes with the answers to this
                    # node's reports, the peer's acks and the master's
                    # pushes; a push may be lost (a session reconnects), and
                    # a replica reported late answers only the node that
                    # got it: ask again, with the rank's newest report.
                    asked = now
                    newest = self._own.get(key)
                    if newest is not None:
                        self._reports.put(newest)
                self._commits.wait(min(left, _WAIT_SLICE_S))
        if self.master_away:
            self._wait_whole(header, deadline)
        with self._commits:
            told = self._told_locked(header.round)
            self._answered[key] = (header.round, told)
        if time.monotonic() - started > SLOW_ANSWER_S:
            self._say_slow(header, started, told)
        return checkpoint_pb2.SavedAck(committed_step=told)

    def _say_slow(self, header: files.ImageSummary, started: float, told: int) -> None:
        """A save's answer took long (its worker's notices wait for it, and
        its slots fill meanwhile): what this node had heard by then."""
        with self._lock:
            committed, replicated = self._committed, self._replicated_step
            away, peer, target = self._master_away, self._peer, self._replica_step
            sent = {rank: self._replicated.get((peer or "", rank)) for rank in self._own}
        _log.warning(
            "the save of step %d (round %d, rank %d) was answered after %.2fs with step %d: "
            "the master counts step %d committed, step %d replicated, step %d to copy next "
            "(sent to %s as (round, step): %s)%s",
            header.step,
            header.round,
            header.rank,
            time.monotonic() - started,
            told,
            committed,
            replicated,
            target,
            peer,
            sent,
            "; the master is away" if away else "",
        )

    def _told_locked(self, round_: int) -> int:
        """The committed step a save of `round_` is answered: the master's
        word (with a peer, the newest step both committed and replicated:
        the one a lost node falls back to, whose images the workers keep),
        or a newer step of that round this node held whole while the
        master was away."""
        whole, committed = self._whole, self._committed
        if self._peer is not None:
            committed = min(committed, self._replicated_step)
        if whole is not None and whole[0] == round_:
            return max(committed, whole[1])
        return committed

    def _wait_whole(self, header: files.ImageSummary, deadline: float) -> None:
        """Until this node holds every rank's image of `header`'s step (its
        own ranks' and replicas), or `deadline`. Not at all where it never
        held every rank of the round (a ring of more than two nodes)."""
        ranks = set(range(header.world_size))
        if not _ranks_held(self._held_images(), header.round, None) >= ranks:
            return
        while True:
            if _ranks_held(self._held_images(), header.round, header.step) >= ranks:
                with self._commits:
                    if self._whole is None or self._whole < (header.round, header.step):
                        self._whole = (header.round, header.step)
                    self._owe_locked(-1)
                return
            with self._commits:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._commits.wait(min(left, _WAIT_SLICE_S))

    def _master_away_locked(self) -> bool:
        """The last call to the master failed, or a report has been in
        flight for MASTER_SLOW_S (its retries ride out a restart)."""
        since = self._report_since
        return self._master_away or (since is not None and time.monotonic() - since > MASTER_SLOW_S)

    @property
    def master_away(self) -> bool:
        with self._lock:
            return self._master_away_locked()

    def heard_progress(self, committed_step: int, replicated_step: int, replica_step: int) -> None:
        """The master pushed the current round's newest committed and
        replicated steps and the step to copy next (another node's report
        moved them): the saves waiting for them are answered now, the copy
        starts now. Only ever forward: the answers to this node's own
        reports carry the master's word after a restore."""
        with self._commits:
            self._master_away = False
            self._committed = max(self._committed, committed_step)
            self._replicated_step = max(self._replicated_step, replicated_step)
            self._set_replica_step_locked(replica_step)
            self._commits.notify_all()

    def _heard(self, replicated_step: int, replica_step: int) -> None:
        """The master's word on the newest replicated step and the step to
        copy next, as the peer heard it when it acked a replica. Only ever
        forward: both nodes copy at once, and the peer's word may be older
        than the answer to this node's own report of the replica it got
        meanwhile. (After a restore the answers to this node's own reports
        set it back; a save is told no more than the committed step those
        set, see `_told_locked`.)"""
        with self._commits:
            self._master_away = False
            self._replicated_step = max(self._replicated_step, replicated_step)
            self._set_replica_step_locked(replica_step)
            self._commits.notify_all()

    def _set_replica_step_locked(self, step: int) -> None:
        if step != self._replica_step:
            self._replica_step = step
            self._replicate.set()

    def _report_loop(self) -> None:
        """Report what this node's ranks saved and the replicas it received,
        newest first in line. A report the master did not take for being
        away is sent again every REPORT_RETRY_S (unless a newer image of its
        rank came), one attempt each, so the first attempt after the master
        is back is within that, not after a back-off of up to a second; then
        the master hears every image held here (`_reconcile`)."""
        unsent: list[_Held] = []
        while True:
            batch = self._next_batch(unsent)
            if batch is None:
                return
            sent_at = time.monotonic()
            unsent = []
            # Only each rank's newest image is worth a report: the master
            # commits the newest step every rank holds, and the older ones
            # are about to be dropped. After a master outage the backlog is
            # then one report per step still open, not one per step missed,
            # and the saves waiting for the current step's commit wait less.
            held = self._held_images()
            for (step, round_, world), images in _by_step(_newest(batch)):
                earlier = self._earlier_steps(step, round_, world, images, held)
                taken = self._report(step, round_, world, images, held=held, earlier=earlier)
                if taken is None and self.master_away:
                    unsent += images
            if not unsent and self._reconcile_due():
                self._reconcile()
            # At most one report a REPORT_INTERVAL_S: saves faster than that
            # gather in the queue meanwhile, and the next report names them all.
            left = sent_at + REPORT_INTERVAL_S - time.monotonic()
            if batch and left > 0 and not self._reconcile_due():
                self._closed.wait(left)

    def _next_batch(self, unsent: list[_Held]) -> list[_Held] | None:
        """The reports queued, after those not taken yet (None: closed). While
        some are owed to the master, it waits at most REPORT_RETRY_S."""
        owed = bool(unsent) or self._reconcile_due()
        try:
            first = self._reports.get(timeout=REPORT_RETRY_S if owed else None)
        except queue.Empty:
            return list(unsent)
        if first is None:
            return None
        batch = [*unsent] if isinstance(first, _Wake) else [*unsent, first]
        while True:  # the other local ranks' saves of the step, if already in
            try:
                more = self._reports.get_nowait()
            except queue.Empty:
                return batch
            if more is None:
                self._reports.put(None)
                return batch
            if not isinstance(more, _Wake):
                batch.append(more)

    def _owe_locked(self, above: int) -> None:
        """The master is to hear the images of steps above `above`."""
        if self._unreconciled:
            above = min(above, self._reconcile_above)
        self._unreconciled, self._reconcile_above = True, above

    def _reconcile_due(self) -> bool:
        with self._lock:
            return self._unreconciled

    def _reconcile(self) -> None:
        """Report every image this node holds, own and replica, oldest step
        first: after an outage the master may know none of the steps saved
        meanwhile, and a node lost in it cannot report its own. Done once
        the master took every report; the next try is the loop's next turn."""
        with self._lock:
            above = self._reconcile_above
        held = self._held_images()
        owed = [h for h in held if h.header.step > above]
        for (step, round_, world), images in _by_step(owed):
            # `held`, all of it: a report says which steps below it the node
            # no longer holds.
            if self._report(step, round_, world, images, held=held) is None and self.master_away:
                return
        with self._commits:
            self._unreconciled = False
            self._commits.notify_all()

    def _earlier_steps(
        self, step: int, round_: int, world: int, images: list[_Held], held: list[_Held]
    ) -> list[int]:
        """The steps before `step` (and after the newest this node heard
        committed) at which this node holds the own images of every rank
        of `images` too: a report carries only each rank's newest image,
        and the other nodes' newest may be any of these."""
        ranks = {h.header.rank for h in images}
        if not ranks or any(h.replica for h in images):
            return []
        with self._lock:
            floor = self._committed
        by_step: dict[int, set[int]] = {}
        for h in held:
            if (
                not h.replica
                and h.header.rank in ranks
                and (h.header.round, h.header.world_size) == (round_, world)
                and floor < h.header.step < step
            ):
                by_step.setdefault(h.header.step, set()).add(h.header.rank)
        return sorted(s for s, r in by_step.items() if r == ranks)[-MAX_EARLIER_STEPS:]

    def _report(
        self,
        step: int,
        round_: int,
        world: int,
        images: list[_Held],
        *,
        queued: bool = True,
        held: list[_Held] | None = None,
        earlier: list[int] | None = None,
    ) -> int | None:
        """Tell the master, in one attempt; the newest replicated step it
        answers (-1: none; None: not taken). A `queued` report is the report
        loop's (it sends it again); a replica's report as it arrives is not,
        and the loop sends it if it was not taken."""
        copies = [
            checkpoint_pb2.ImageCopy(
                rank=held.header.rank,
                node_id=self.node_id,
                address=self.address,
                replica=held.replica,
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
            dropped_below=min(self._oldest_held(held), step),
            earlier_steps=earlier or [],
        )
        if queued:
            with self._commits:
                self._report_since = time.monotonic()
        try:
            answer = self._quick_reports.report_checkpoint(report)
        except DlfleetError as exc:
            away = isinstance(exc, Unavailable)
            if away:
                _log.debug("checkpoint report of step %d not taken: %s", step, exc)
            else:
                _log.warning("checkpoint report of step %d not taken: %s", step, exc)
            with self._commits:
                if queued:
                    self._report_since = None
                self._master_away = self._master_away or away
                if away:
                    self._owe_locked(-1)
                self._commits.notify_all()
            return None
        with self._commits:
            if queued:
                self._report_since = None
            self._master_away = False
            # The master's word, not a maximum: a restore abandons the steps after
            # it, and the commits of the round that failed go with them.
            self._committed = answer.committed_step
            self._replicated_step = answer.replicated_step
            self._set_replica_step_locked(answer.replica_step)
            self._commits.notify_all()
        return answer.replicated_step

    def _held_images(self) -> list[_Held]:
        """Every complete image in this node's memory, own and replicas."""
        own = files.list_summaries(self.own_dir, cache=self._headers)
        held = [_Held(i.header_path, i.header) for i in own]
        for folder in sorted(self.replica_dir.iterdir()):
            held += [
                _Held(i.header_path, i.header, replica=True)
                for i in files.list_summaries(folder, cache=self._headers)
            ]
        return held

    def _oldest_held(self, held: list[_Held] | None = None) -> int:
        images = self._held_images() if held is None else held
        return min((h.header.step for h in images), default=0)

    # ------------------------------------------------------- replication

    def _replicate_loop(self) -> None:
        while not self._closed.is_set():
            # Woken by a new image, a new step to copy or a replica received;
            # while a newer image is not sent, also when the next lead is due.
            self._replicate.wait(self._lead_due_in())
            self._replicate.clear()
            if self._closed.is_set():
                return
            with self._lock:
                peer = self._peer
            if peer is None:
                continue
            failing: bool | None = None  # None: nothing was sent
            for held in self._to_replicate(peer):
                ack = self._send_replica(peer, held)
                if ack is None:
                    failing = True
                    continue
                failing = bool(failing)
                sent = (held.header.round, held.header.step)
                with self._commits:
                    key = (peer, held.header.rank)
                    self._replicated[key] = max(self._replicated.get(key, _NONE_SENT), sent)
                    self._sent.setdefault(key, deque(maxlen=SENT_KEPT)).append(sent)
                    self._commits.notify_all()
                if ack.replicated_step >= 0:
                    self._heard(ack.replicated_step, ack.replica_step)
            retry = self._retry_after(peer, failing)
            if retry:
                self._peer_set.wait(retry)  # a new peer is tried at once
                self._peer_set.clear()
                self._replicate.set()

    def _retry_after(self, peer: str, failing: bool | None) -> float:
        """How long to wait before copying to `peer` again: 0 once a copy
        succeeds (`failing` False) or when nothing was sent (None); after
        failures, RETRY_FIRST_S doubling to RETRY_MOST_S."""
        if failing is None:
            return 0.0
        if not failing:
            self._retry = (peer, 0.0)
            return 0.0
        last = self._retry[1] if self._retry[0] == peer else 0.0
        wait = min(max(2 * last, RETRY_FIRST_S), RETRY_MOST_S)
        self._retry = (peer, wait)
        return wait

    def _lead_due_in(self) -> float | None:
        """Seconds until this node may copy its newest images of its own
        accord, if some are not sent (None: nothing to send)."""
        with self._lock:
            peer = self._peer
            if peer is None or not any(
                self._replicated.get((peer, rank), _NONE_SENT)
                < (held.header.round, held.header.step)
                for rank, held in self._own.items()
            ):
                return None
            return max(0.0, self._led_at + LEAD_INTERVAL_S - time.monotonic())

    def _to_replicate(self, peer: str) -> list[_Held]:
        """Each local rank's image to copy to `peer` now, if not sent yet:
        of the step the master chose for every node, else of the step the
        predecessor in the ring sent here last, else (at most every
        LEAD_INTERVAL_S) the newest. The first two make every node copy the
        same step (every rank's replica of one step: it then counts as
        replicated); the master's choice alone would take a round trip to
        the master per step replicated, and none while it is away."""
        with self._lock:
            newest = sorted(self._own.items())
            target = -1 if self._master_away_locked() else self._replica_step
            received = self._received
            sent = {rank: set(self._sent.get((peer, rank), ())) for rank, _ in newest}
            lead_due = time.monotonic() >= self._led_at + LEAD_INTERVAL_S
        if not newest:
            return []
        rounds = {rank: held.header.round for rank, held in newest}
        # The folder is listed only when a step is owed (most wakes owe none).
        if target >= 0 and any((rounds[rank], target) not in sent[rank] for rank in rounds):
            own = files.list_summaries(self.own_dir, cache=self._headers)
            chosen = _unsent(own, sent, lambda h: h.step == target and rounds[h.rank] == h.round)
            if chosen:
                return chosen
        if received is not None and any(received not in sent[rank] for rank in rounds):
            own = files.list_summaries(self.own_dir, cache=self._headers)
            chosen = _unsent(own, sent, lambda h: (h.round, h.step) == received)
            if chosen:
                return chosen
        if not lead_due:
            return []
        chosen = [
            held for rank, held in newest if (held.header.round, held.header.step) not in sent[rank]
        ]
        if chosen:
            with self._lock:
                self._led_at = time.monotonic()
        return chosen

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
            header, decoded, body = files.read_image(held.header_path)
        except (OSError, CheckpointError) as exc:
            # Overwritten by a newer save meanwhile: that one is queued next.
            _log.debug("image of rank %d not replicated: %s", held.header.rank, exc)
            return None
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
        slot = self._replica_slot(folder, header)
        header_path = folder / files.header_name(header.rank, slot)
        body_path = folder / files.body_name(header.rank, slot)
        header_path.unlink(missing_ok=True)
        received = 0
        # Verified as it arrives: a replica damaged on the way (or sent from a
        # damaged image) is refused, not kept to be restored from later.
        verifier = files.BodyVerifier(header)
        try:
            with body_path.open("wb") as body:
                for piece in _chain(first, pieces):
                    if piece.offset != received:
                        raise CheckpointError(
                            f"replica piece at {piece.offset}, expected {received}"
                        )
                    verifier.feed(piece.data)
                    body.write(piece.data)
                    received += len(piece.data)
            if received != first.total_bytes:
                raise CheckpointError(
                    f"replica ended after {received} of {first.total_bytes} bytes"
                )
            verifier.finish()
        except CheckpointError as error:
            body_path.unlink(missing_ok=True)
            _log.warning("refused a replica from %s: %s", origin, error)
            raise
        renamed = files.ImageHeader(**{**header.__dict__, "body_name": body_path.name})
        tmp = header_path.with_name(header_path.name + ".tmp")
        tmp.write_bytes(files.encode_header(renamed))
        tmp.replace(header_path)
        self._headers.remember(header_path, renamed.summary())  # listed at the next report
        replica = _Held(header_path, renamed, replica=True)
        with self._commits:
            self._commits.notify_all()  # a save may wait for this node to hold its step whole
            if self._received is None or self._received < (header.round, header.step):
                self._received = (header.round, header.step)
                self._replicate.set()  # this node copies the same step next
        replicated_step = None
        if not self.master_away:  # else the sender's next images would wait for it
            replicated_step = self._report(
                header.step, header.round, header.world_size, [replica], queued=False
            )
        if replicated_step is None:
            self._reports.put(replica)
        with self._lock:
            replica_step = self._replica_step
        return checkpoint_pb2.ReplicateAck(
            bytes=received,
            replicated_step=-1 if replicated_step is None else replicated_step,
            replica_step=replica_step,
        )

    def _replica_slot(self, folder: Path, header: files.ImageHeader) -> int:
        """The slot for a replica, by the writers' own policy (see
        `dlfleet.worker.checkpoint.slots`): the step the master counts
        replicated (or one held whole in its absence) and every newer one
        are kept while there is room. The master's replicated step only
        moves forward within a round, so a replica older than it is never
        needed again; the sender's saves wait for room on their side, so
        the replicas they send never outrun these slots."""
        held = []
        for image in files.list_summaries(folder, header.rank, cache=self._headers):
            parsed = files.parse_name(image.header_path.name)
            if parsed is not None:
                held.append(Held(parsed[1], image.header.round, image.header.step))
        with self._lock:
            whole, keep_from = self._whole, self._replicated_step
        if whole is not None:
            keep_from = min(keep_from, whole[1])
        count = slot_count(REPLICA_SLOTS, REPLICA_MEMORY_BYTES, header.body_nbytes)
        return choose(held, count, step=header.step, keep_from=keep_from)[0]

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
        self._peer_set.set()
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


def _unsent(
    images: list[files.StoredSummary],
    sent: dict[int, set[tuple[int, int]]],
    wanted: Callable[[files.ImageSummary], bool],
) -> list[_Held]:
    """The `wanted` images of `images` of the ranks in `sent`, not sent yet."""
    return [
        _Held(i.header_path, i.header)
        for i in images
        if i.header.rank in sent
        and wanted(i.header)
        and (i.header.round, i.header.step) not in sent[i.header.rank]
    ]


def _newest(batch: list[_Held]) -> list[_Held]:
    """Each rank's newest image in `batch`, own and replica apart."""
    newest: dict[tuple[bool, int], _Held] = {}
    for held in batch:
        kept = newest.get(held.key)
        h = held.header
        if kept is None or (h.round, h.step) >= (kept.header.round, kept.header.step):
            newest[held.key] = held
    return list(newest.values())


def _by_step(images: list[_Held]) -> list[tuple[tuple[int, int, int], list[_Held]]]:
    """`images` as one report each per (step, round, world size), oldest step
    first, one copy per rank and kind (own or replica)."""
    by_step: dict[tuple[int, int, int], dict[tuple[bool, int], _Held]] = {}
    for held in images:
        h = held.header
        by_step.setdefault((h.step, h.round, h.world_size), {}).setdefault(held.key, held)
    return [(key, list(copies.values())) for key, copies in sorted(by_step.items())]


def _ranks_held(images: list[_Held], round_: int, step: int | None) -> set[int]:
    """The ranks of `round_` with an image in `images` (of `step`, or any)."""
    return {
        held.header.rank
        for held in images
        if held.header.round == round_ and (step is None or held.header.step == step)
    }

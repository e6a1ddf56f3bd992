"""`Checkpointer`: in-memory checkpoints, from the training script's side.

    ckpt = Checkpointer(persist_every=100)
    restored = ckpt.load()                      # newest step every rank holds
    if restored:
        model.load_state_dict(restored.state["model"]) ...
    for batch in loader:
        ... # one training step
        ckpt.save(step, {"model": ..., "optimizer": ..., "loader": loader.state_dict()})

`save` copies the state into this rank's image in the node agent's shared
memory (the only part the step waits for) and tells the agent in the
background (of the newest image, at most every ANNOUNCE_INTERVAL_S: saves of
every step cost the agent, the master and the peer a handling per interval);
the agent reports it to the master and copies it to a peer node.
A step is *committed* once every rank of the round saved it. The agent's
answers name the newest step committed and replicated; the rank keeps that
step's image and every newer one, in up to IMAGE_SLOTS slots (fewer for a
large state, see `slots`), and a save waits only when they are full. `load` restores
the newest committed step whose images still exist somewhere (this node's
memory, a peer's replica), else the newest step persisted to disk, else
returns None. Every rank restores the same step: rank 0 chooses it and the
others follow (a collective when a process group is up); if some rank cannot
read it, all fall back to an older one together.

Restoring into another world size works like torch.distributed.checkpoint: a
replicated state (DDP) comes from any one image, a sharded one (FSDP2
DTensors) is resharded from the images of every saving rank, fetched from
other nodes when needed; pass a template (`load(state)`) for sharded state.

Striping (`stripe_replicated`, on by default): under an agent, a large plain
tensor (replicated, as with DDP) is cut by rows among the ranks of a node, each
rank copying one part: a save blocks 1/n as long with n ranks per node, and
the node's memory holds one copy of the replicated state instead of n. The
node's images together (and the peer's replica of them) hold it whole.

How often: `every=k` saves the steps that are multiples of k (the others
return at once; `due(step)` says which, so a script can skip building the
state). `every="auto"` saves every step of a round's first AUTO_SAMPLES,
then twice AUTO_PROBE_EVERY steps apart (to time steps without a save), then
every k steps, k the smallest that keeps what saves cost the training under
AUTO_TARGET of it (1 on long steps). A save's cost: how much slower a step
with a save trains than one without, at least the save's blocking (on a
busy host its background copy, checksums and messages take CPU from the
training too). The ranks agree on the largest k any of them needs (one
all-reduce, at the same step on every rank), and rank 0 logs what was
chosen and why. A failure then loses at most k steps.

Persistence: at the saves of steps that are multiples of `persist_every`
and at `close()` (each step once: a due last step is not written again), a
background thread writes the image into `persist_dir/step-<N>/` in the
torch.distributed.checkpoint format (readable by `dcp.load`). While a step is
being persisted its image is the protected one. On SIGTERM (a preemption:
the agent stops its workers so, then SIGKILLs them after a grace period) the
newest image is persisted first, if it is not on disk yet. Every host must
see the same `persist_dir` (a shared file system): at a round's first load or
save, a round of several nodes checks that it does (location.py) and every
rank fails at once, naming the hosts that do not see it.

Without a dlworker agent (plain torchrun) the images live in a private
folder of this process and nothing is committed: `load` reads only what was
persisted.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import queue
import shutil
import signal
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from dlfleet.api.client import MasterClient
from dlfleet.api.env import (
    AGENT_ENV,
    CHECKPOINT_DIR_ENV,
    KEEPER_ENV,
    MASTER_ENV,
    NODE_ID_ENV,
    ROUND_ENV,
    TOKEN_ENV,
    WORKDIR_ENV,
)
from dlfleet.api.errors import DlfleetError
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from dlfleet.worker import elastic
from dlfleet.worker.checkpoint import files, location, persist
from dlfleet.worker.checkpoint.errors import (
    CheckpointError,
    ImageCorruptError,
    PersistCorruptError,
)
from dlfleet.worker.checkpoint.image import (
    BytesImage,
    ImageFile,
    ImageSource,
    ImageWriter,
    LocalImage,
    PendingImage,
)
from dlfleet.worker.checkpoint.ladder import (
    Candidate,
    Rejected,
    Rung,
    Skip,
    Verification,
    Verified,
    descend,
)
from dlfleet.worker.checkpoint.overlap import StepGuard, deferrable
from dlfleet.worker.checkpoint.plan import Stripe
from dlfleet.worker.checkpoint.remote import fetch_image
from dlfleet.worker.checkpoint.restore import load_full, restore_into
from dlfleet.worker.checkpoint.term_watch import TermWatch

_log = logging.getLogger("dlfleet.checkpoint")

# Sources of a restore, as `Restored.source` names them.
MEMORY, PEER, DISK = "memory", "peer", "disk"
_ATTEMPTS = 4  # steps tried, newest first, before falling back to disk
PERSIST_TIMEOUT_S = 60.0  # rank 0 waits this long for the other ranks' parts
# On SIGTERM, within the agent's grace period (10 s) before its SIGKILL.
SIGTERM_PERSIST_S = 5.0
TERM_HANDLER_WAIT_S = 0.5  # then SIGTERM is sent to the main thread itself (see TermWatch)
_WAIT_SLICE_S = 0.05  # how often a waiting save looks whether the round ended
AUTO_SAMPLES = 16  # saves measured at the start of each round by every="auto"
AUTO_TARGET = 0.01  # the share of training time every="auto" lets saves cost
AUTO_PROBE_EVERY = 16  # then every="auto" saves this far apart, twice, to time plain steps
AUTO_MAX_EVERY = 10_000
_CALL_TIMEOUT_S = 10.0
# The fastest pace of a rank's announcements to its agent (the newest image
# each time): saves of every few milliseconds cost the agent, the master and
# the peer an image's handling per interval, not per step. The agent's
# answers trail the saves by about this much more; the slots cover it.
ANNOUNCE_INTERVAL_S = 0.1
# Slots of a rank's images under an agent: the agent's answers may trail the
# saves by this many less two before a save waits (see `_wait_for_room`), and
# they take at most this much memory where fewer slots would not (never
# fewer than two). They are allocated as first needed.
IMAGE_SLOTS = 64
# An image this small is copied, summed and finished in save() itself: the
# copy takes less than handing it to the background threads (a state of a
# few thousand parameters: tens of microseconds against hundreds).
INLINE_IMAGE_BYTES = 1 << 20
IMAGE_MEMORY_BYTES = 1 << 30
_PRIVATE_SLOTS = 3  # the newest image, the one being persisted, the one being written
_TIMES_KEPT = 16  # images whose times image_times() still knows
_CLAIMS_KEPT = 16  # the newest steps this rank wrote, or handed to its persister
# Every optimizer of the process waits here for the copy of an overlapped save.
_GUARD = StepGuard()


@dataclass(frozen=True)
class Restored:
    step: int
    state: dict[str, Any]
    source: str  # "memory" (this node), "peer" (fetched from another node) or "disk"


@dataclass(frozen=True)
class ImageTimes:
    """How long the newest finished image took, from the start of its copy."""

    step: int
    copied_s: float  # until every tensor of the training state was read (it may change)
    ready_s: float  # until its checksums and header were written: the image exists


class Checkpointer:
    # every="auto": (blocked s, step s) of this round's measured saves.
    _auto_samples: list[tuple[float, float]]
    # every="auto": "sample" (a save every step), "probe" (saves AUTO_PROBE_EVERY
    # apart), "chosen"; the (start, step, blocked s) of the last save; the probe
    # saves made.
    _auto_phase: str
    _auto_last: tuple[float, int, float] | None
    _auto_probes: int

    def __init__(
        self,
        *,
        persist_every: int = 0,
        persist_dir: str | Path | None = None,
        keep_persisted: int = 2,
        commit_wait_s: float = 3.0,
        stripe_replicated: bool = True,
        overlap: bool = True,
        every: int | str = 1,
    ) -> None:
        self._set_cadence(every, persist_every, keep_persisted)
        self.persist_every = persist_every
        default_root = Path(os.environ.get(WORKDIR_ENV, ".")) / "checkpoints"
        self.persist_dir = Path(persist_dir) if persist_dir is not None else default_root
        self.keep_persisted = keep_persisted
        self.commit_wait_s = commit_wait_s
        self.stripe_replicated = stripe_replicated
        self.overlap = overlap
        self.saves = 0
        # Time saves kept training waiting, in total: in save(), and in an
        # optimizer step held for an overlapped copy.
        self.blocked_s = 0.0
        self._held_seen = _GUARD.held_s
        shared = os.environ.get(CHECKPOINT_DIR_ENV)
        self._private = not shared
        self.image_dir = (
            Path(shared) if shared else Path(tempfile.mkdtemp(prefix="dlfleet-images-"))
        )
        self._writer: ImageWriter | None = None
        self._token = os.environ.get(TOKEN_ENV, "")
        # dlworker's agent, or the keeper torchrun's dlfleet rendezvous
        # handler runs: the same service for the images.
        agent = os.environ.get(AGENT_ENV) or os.environ.get(KEEPER_ENV, "")
        self._agent: checkpoint_pb2_grpc.KeeperStub | None = None
        self._agent_channel: grpc.Channel | None = None
        if agent and not self._private:
            self._agent_channel = grpc.insecure_channel(agent)
            self._agent = checkpoint_pb2_grpc.KeeperStub(self._agent_channel)
        # Reentrant: the SIGTERM handler may run while the main thread holds it.
        self._lock = threading.RLock()
        self._acked = threading.Condition(self._lock)
        self._committed = -1
        self._announced = -1  # the newest step the agent answered for
        self._round = int(os.environ.get(ROUND_ENV, "0") or 0)  # of the lineage
        self._last_saved = -1
        self._location_round: int | None = None  # the round whose location check passed
        self._persisting: int | None = None
        # (round, step) of the images whose part this rank wrote or handed to
        # its persister (see `_claim`): each is written once.
        self._claimed: collections.deque[tuple[int, int]] = collections.deque(maxlen=_CLAIMS_KEPT)
        # The newest step rank 0 handed to the finisher: an older one still
        # waiting for parts is superseded by it (the close sentinel is not).
        self._finish_due = -1
        self._last_image: ImageFile | None = None
        self._times: collections.deque[ImageTimes] = collections.deque(maxlen=_TIMES_KEPT)
        # The image being finished in the background (its copy, its checksums,
        # its header), whether its step is due to be persisted; a finish that
        # failed, for the next save to raise.
        self._sealing: PendingImage | None = None
        self._seals: queue.Queue[tuple[PendingImage, bool] | None] = queue.Queue()
        self._seal_error: CheckpointError | None = None
        self._notices: queue.Queue[ImageFile | None] = queue.Queue()
        self._closing = threading.Event()
        self._persists: queue.Queue[ImageFile | None] = queue.Queue()
        self._finishes: queue.Queue[tuple[ImageFile, Path] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._seal_loop, name="dlfleet-ckpt-seal", daemon=True),
            threading.Thread(target=self._notify_loop, name="dlfleet-ckpt-notify", daemon=True),
            threading.Thread(target=self._persist_loop, name="dlfleet-ckpt-persist", daemon=True),
            threading.Thread(target=self._finish_loop, name="dlfleet-ckpt-finish", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self._previous_sigterm: Any = None
        self._term_watch: TermWatch | None = None
        self._term_lock, self._term_done = threading.Lock(), False
        self._term_handled = threading.Event()  # the main thread's handler ran
        if persist_every:
            self._watch_sigterm()

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        overlap: Sequence[Any] = (),
        force: bool = False,
    ) -> None:
        """Checkpoint `state` as of `step` (call it between steps, on every rank).

        `force`: save the step even when it is not due (the last step of a
        run, so that the model it ends with is the one kept; every rank at
        the same step); a step already saved is not saved again.

        `state` may be a function that returns it: it is called only when
        the step is due (see `every`), and the time it takes counts as the
        save's (what every="auto" weighs against the step's).

        What the step waits for: the copy of what may change before the next
        optimizer step. The parameters of the modules and the state of the
        optimizers that `state` holds as objects (`{"model": model, "optim":
        optimizer}`), or that `overlap` names when `state` holds their state
        dicts (`overlap=(model, optimizer)`), are copied in the background
        while the next forward and backward run (unless the Checkpointer was
        made with `overlap=False`); that step's `optimizer.step()` waits for
        their copy if it is not done yet. Everything else (buffers, plain
        tensors, the loader's state, extras) is copied here. The checksums
        and the image's header follow in the background; the image exists
        (and is told to the agent) once they are written. A small state
        (an image of at most 1 MiB) is copied, summed and finished here,
        all of it: handing it to the background threads would cost the
        training more than the copy. Make the
        Checkpointer with `overlap=False` when the script
        changes parameters outside `optimizer.step()` (an EMA written into
        the model, weights clipped in place).

        The time training waited (here, and in an optimizer step held for
        the copy) and the step go to the progress file too: the master
        counts that time as checkpoint blocking, and the step tells it how
        many steps a restore rolls back."""
        from dlfleet.worker import progress

        elastic.check()
        started = time.perf_counter()
        rank, world, round_ = _context()
        self._enter(round_)
        if not (step != self._last_saved if force else self.due(step)):
            return
        if callable(state):
            state = state()
        self._check_location(round_)
        self._settle()
        writer = self._writer_for(rank)
        persist_due = bool(self.persist_every) and self._persist_due(step)
        if persist_due:  # every rank persists the same steps: the previous one first
            self._wait(lambda: self._persisting is None, None)
        self._wait_for_room(writer, step)
        with self._lock:
            protect = self._protected()
        pending = writer.begin(
            step,
            state,
            round=round_,
            world_size=world,
            protect=protect,
            stripe=self._stripe(rank, world),
            defer=deferrable(state, overlap) if self.overlap else None,
            sum_later=True,
            inline_bytes=INLINE_IMAGE_BYTES,
        )
        if not pending.copied:
            _GUARD.hold(pending)
        with self._acked:
            self._sealing = pending
        if pending.background:
            self._seals.put((pending, persist_due))
        else:  # a small image: its header now, not after two hand-offs between threads
            self._seal(pending, persist_due)
        self._last_saved = step
        self.saves += 1
        held, self._held_seen = _GUARD.held_s - self._held_seen, _GUARD.held_s
        blocked = time.perf_counter() - started + held
        self.blocked_s += blocked
        progress.saved(step, blocked)
        if self.auto:
            self._measure(blocked, started, step, rank)

    def _set_cadence(self, every: int | str, persist_every: int, keep_persisted: int) -> None:
        if persist_every < 0:
            raise ValueError(f"persist_every must be >= 0 (0: never), got {persist_every}")
        if keep_persisted < 1:
            raise ValueError(f"keep_persisted must be >= 1, got {keep_persisted}")
        if every != "auto" and not (isinstance(every, int) and every >= 1):
            raise ValueError(f'every must be a step count >= 1 or "auto", got {every!r}')
        self.auto = every == "auto"
        # The save interval in steps (under "auto": 1 until chosen in a round).
        self.every = 1 if isinstance(every, str) else every
        self._auto_samples = []
        self._auto_phase, self._auto_last, self._auto_probes = "sample", None, 0

    def due(self, step: int) -> bool:
        """Whether `save(step, ...)` saves (every rank answers the same: a
        new round starts every rank's interval afresh, whether it called
        `load` or `save` first or only this)."""
        self._enter(_context()[2])
        return step % self.every == 0

    def _enter(self, round_: int) -> None:
        """A new round that did not load(): its answers count, and
        every="auto" measures again."""
        if round_ != self._round:
            with self._acked:
                self._round = round_
            self._start_auto()

    def _persist_due(self, step: int) -> bool:
        """Every rank persists the same saves: each one that reaches a new
        multiple of `persist_every` (with `every` 1, the multiples themselves)."""
        if self.every == 1 or self._last_saved < 0:
            return step % self.persist_every == 0
        return step // self.persist_every > self._last_saved // self.persist_every

    def _start_auto(self) -> None:
        """A new round measures again: its ranks start together."""
        if self.auto:
            self.every = 1
            self._auto_samples = []
            self._auto_phase, self._auto_last, self._auto_probes = "sample", None, 0

    def _measure(self, blocked_s: float, started: float, step: int, rank: int) -> None:
        """every="auto", at each save: first AUTO_SAMPLES saves at every step
        (each interval a step and a save), then two saves AUTO_PROBE_EVERY
        steps apart (the steps between them train without saves); then
        choose the interval with the other ranks. Every rank saves the same
        steps throughout (the phases change at the same save on each)."""
        last, self._auto_last = self._auto_last, (started, step, blocked_s)
        if self._auto_phase == "chosen" or last is None or step <= last[1]:
            return
        if self._auto_phase == "sample":
            self._auto_samples.append((blocked_s, (started - last[0]) / (step - last[1])))
            if len(self._auto_samples) >= AUTO_SAMPLES:
                self._auto_phase, self.every = "probe", AUTO_PROBE_EVERY
            return
        self._auto_probes += 1
        if self._auto_probes < 2:  # the first probe save follows the sampled ones
            return
        # The steps since the last save, less that save's own blocking.
        plain = max((started - last[0] - last[2]) / (step - last[1]), 1e-6)
        blocked = statistics.median_high(b for b, _ in self._auto_samples)
        with_save = statistics.median_high(t for _, t in self._auto_samples)
        # What a save costs the training: the step it is made after trains
        # this much slower (the blocking, and on a busy host the background
        # copy, checksums and messages taking CPU from the training).
        cost = max(with_save - plain, blocked)
        needed = math.ceil(cost / (AUTO_TARGET * plain))
        every = _agreed_max(min(max(needed, 1), AUTO_MAX_EVERY))
        self.every, self._auto_phase = every, "chosen"
        if rank == 0:  # shown without any logging set up: it bounds what a failure loses
            _log.warning(
                'every="auto": saving every %d step(s) from step %d on: a save cost %.2f ms of '
                "training (blocked %.2f ms; a step trains %.2f ms without a save, %.2f ms with "
                "one each step; medians); at most %.0f%% of the time goes to saves, a failure "
                "loses at most %d step(s)",
                every,
                step,
                cost * 1000,
                blocked * 1000,
                plain * 1000,
                with_save * 1000,
                AUTO_TARGET * 100,
                every,
            )

    def _settle(self, *, raise_error: bool = True) -> None:
        """Until the previous save's image is finished (normally long ago);
        raise its failure, if it failed. A save's wait leaves at once when
        the agent ends the round; the others wait (a finish is bounded: a
        copy, its checksums, a header)."""
        if raise_error:
            self._wait(lambda: self._sealing is None, None)
        else:
            with self._acked:
                self._acked.wait_for(lambda: self._sealing is None)
        with self._lock:
            error, self._seal_error = self._seal_error, None
        if error is not None and raise_error:
            raise error

    def _seal_loop(self) -> None:
        """Finishes each image (its background copy and checksums, then its
        header), then tells the agent and hands a due step to the persister."""
        while True:
            item = self._seals.get()
            if item is None:
                return
            self._seal(*item)

    def _seal(self, pending: PendingImage, persist_due: bool) -> None:
        """Finish `pending` (see `_seal_loop`); a failure is kept for the next save."""
        try:
            image = pending.finish()
        except Exception as exc:  # noqa: BLE001 - kept for the next save to raise
            pending.abandon()
            error = CheckpointError(f"the image of step {pending.step} was not written: {exc}")
            error.__cause__ = exc
            _log.error("%s", error)
            with self._acked:
                self._seal_error = error
                self._sealing = None
                self._acked.notify_all()
            return
        persist_due = persist_due and self._claim(image)
        with self._acked:
            self._last_image = image
            self._times.append(
                ImageTimes(image.step, pending.copied_s or 0.0, pending.ready_s or 0.0)
            )
            if persist_due:
                self._persisting = image.step
            self._sealing = None
            self._acked.notify_all()
        if self._agent is not None:
            self._notices.put(image)
        if persist_due:
            self._persists.put(image)

    @property
    def last_image(self) -> ImageFile | None:
        """Where the newest save of this process put its image (None before
        one), once it is finished."""
        self._settle(raise_error=False)
        return self._last_image

    def image_times(self, step: int) -> ImageTimes | None:
        """How long the image of `step` (one of the last few finished) took."""
        with self._lock:
            return next((t for t in reversed(self._times) if t.step == step), None)

    @property
    def committed_step(self) -> int:
        """The newest step the agent said is committed (and, with a peer
        node, replicated): what a failure rolls back to at worst, while its
        images live (-1: none yet). It trails the saves by the agent's round
        trip; without an agent nothing is committed."""
        with self._acked:
            return self._committed

    @property
    def step_held_s(self) -> float:
        """Time the optimizer steps of this process waited for overlapped
        copies, in total (every Checkpointer of the process together)."""
        return _GUARD.held_s

    def _stripe(self, rank: int, world: int) -> Stripe | None:
        """This rank's place on its node, when large replicated tensors are cut
        among the node's ranks: under an agent (which keeps every image of the
        node), with every node the same size."""
        if not self.stripe_replicated or self._private:
            return None
        local_rank, local_world = _local_context()
        if local_world < 2 or world % local_world or rank % local_world != local_rank:
            return None
        return Stripe(local_rank, local_world)

    def _writer_for(self, rank: int) -> ImageWriter:
        if self._writer is None or self._writer.rank != rank:
            if self._writer is not None:
                self._writer.close()
            # In the node's folder, the rank's presence tells rank 0 on
            # SIGTERM whether this rank can still write its parts.
            self._writer = ImageWriter(
                self.image_dir,
                rank,
                slots=_PRIVATE_SLOTS if self._private else IMAGE_SLOTS,
                memory_bytes=None if self._private else IMAGE_MEMORY_BYTES,
                presence=not self._private,
            )
        return self._writer

    def _protected(self) -> int | None:
        """The step whose image the writer keeps, with every newer one while
        it has room: the one being persisted, else the newest the agent
        answered committed (and replicated). Without an agent nothing is
        committed: the writer keeps only the newest (and a persisting) image."""
        if self._agent is None:
            return self._persisting
        if self._persisting is not None:
            return min(self._persisting, self._committed)
        return self._committed

    def _wait_for_room(self, writer: ImageWriter, step: int) -> None:
        """Until the writer can take `step` without replacing an image that
        may still be restored (see `slots`): the agent's answers, which come
        in the background, free the images older than the step they name.
        A save waits only when the agent's answers trail the saves by more
        than the slots hold (normally never); so a lost node loses at most
        the steps those slots hold, a killed rank at most the step being
        saved. Once the agent answered the previous save without a commit
        (the master is away, with no node to hold the step whole) there is
        nothing better to wait for: the oldest image that is neither the
        protected one nor the newest goes. Bounded: never longer than
        `commit_wait_s` (the agent's own bounds are shorter)."""
        if self._agent is None:
            return
        previous = self._last_saved
        self._wait(
            # The agent's answer first: it costs nothing, the slots' count does.
            lambda: self._announced >= previous or writer.has_room(step, self._protected()),
            self.commit_wait_s,
        )

    def _wait(self, done: Callable[[], bool], timeout_s: float | None) -> None:
        """Wait on the training thread until `done()`, but leave at once when
        the agent ends the round (the thread is in no collective here, so
        only this check can let it go)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._acked:
            while not done():
                left = _WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return
                self._acked.wait(min(left, _WAIT_SLICE_S))
                elastic.check()

    def _notify_loop(self) -> None:
        announced_at = -ANNOUNCE_INTERVAL_S
        while True:
            image = self._notices.get()
            if image is None:
                return
            # At most one announcement an interval (saves meanwhile are
            # history by then, but the newest): each costs the agent a report,
            # and the master a commit, whatever the save rate.
            left = announced_at + ANNOUNCE_INTERVAL_S - time.monotonic()
            if left > 0:
                self._closing.wait(left)
            while True:  # the newest only: an older notice is history
                try:
                    newer = self._notices.get_nowait()
                except queue.Empty:
                    break
                if newer is None:
                    self._notices.put(None)
                    break
                image = newer
            announced_at = time.monotonic()
            self._announce(image)

    def _announce(self, image: ImageFile) -> None:
        assert self._agent is not None
        attempt = elastic.current()
        notice = checkpoint_pb2.SavedNotice(
            rank=image.rank,
            local_rank=attempt.local_rank if attempt else int(os.environ.get("LOCAL_RANK", "0")),
            step=image.step,
            round=image.round,
            world_size=image.world_size,
            path=str(image.header_path),
            bytes=image.nbytes,
        )
        committed = -1
        try:
            ack = self._agent.Saved(
                notice, timeout=_CALL_TIMEOUT_S, metadata=((TOKEN_METADATA_KEY, self._token),)
            )
            committed = ack.committed_step
        except grpc.RpcError as exc:
            _log.warning(
                "the agent did not take the image of step %d: %s", image.step, exc.code().name
            )
        with self._acked:
            if image.round != self._round:
                return  # an answer about a round that a restore has left behind
            self._committed = max(self._committed, committed)
            self._announced = max(self._announced, image.step)
            self._acked.notify_all()

    # ----------------------------------------------------------- persist

    def _claim(self, image: ImageFile) -> bool:
        """Whether this rank is to write its part of `image`'s step now: True
        once per step of a round, False if it was handed to the persister (or
        written on SIGTERM) before, whether that write is done or not. Two
        writes of one step would cross: the second rewrites files while rank 0
        finishes the folder from the first, or writes into a `.partial`
        folder that rank 0 has just renamed to its final name."""
        key = (image.round, image.step)
        with self._lock:
            if key in self._claimed:
                return False
            self._claimed.append(key)
            return True

    def _persist_loop(self) -> None:
        """Writes this rank's part of each due step (its image is protected
        meanwhile); rank 0 hands the folder to the finisher, which waits for
        the other ranks' parts off the path of the next saves."""
        while True:
            image = self._persists.get()
            if image is None:
                self._finishes.put(None)
                return
            try:
                folder = persist.write_part(LocalImage(image.header_path), self.persist_dir)
            except Exception as exc:  # noqa: BLE001 - a full disk surfaces from torch.save as
                # a RuntimeError too; any failure must leave this thread alive, or every later
                # persist, and the save that waits for it, would hang
                self._persist_failed(image.step, exc)
                continue
            finally:
                with self._acked:
                    self._persisting = None
                    self._acked.notify_all()
            if image.rank == 0:
                with self._lock:
                    self._finish_due = max(self._finish_due, image.step)
                self._finishes.put((image, folder))

    def _finish_loop(self) -> None:
        while True:
            item = self._finishes.get()
            if item is None:
                return
            image, folder = item
            try:
                self._finish(image, folder)
            except Exception as exc:  # noqa: BLE001 - as in _persist_loop: the thread goes on
                if self._persisted(image.step):  # only telling the master failed
                    _log.error("step %d is persisted to %s: %s", image.step, folder, exc)
                else:
                    self._persist_failed(image.step, exc)

    def _on_disk(self) -> str:
        """What a persist failure leaves to restore from disk."""
        newest = persist.newest_persisted(self.persist_dir)
        if newest is None:
            return f"no step is complete on disk under {self.persist_dir}"
        return f"the newest complete step on disk is {newest[0]} ({newest[1]})"

    def _persist_failed(self, step: int, exc: BaseException) -> None:
        """Say why `step` is not on disk and what is, and remove its
        incomplete folder: it can never complete without this rank's part,
        and on a full disk its bytes would make every later step fail too.
        Training goes on; the complete folders are untouched."""
        folder = persist.step_folder(self.persist_dir, step)
        partial = persist.partial_folder(folder)
        shutil.rmtree(partial, ignore_errors=True)
        on_disk = self._on_disk()
        _log.error(
            "persisting step %d to %s failed: %s; its incomplete folder is removed, training "
            "goes on; %s",
            step,
            folder,
            _disk_error(exc),
            on_disk,
        )

    def _all_parts_written(self, image: ImageFile, folder: Path) -> bool:
        """Wait for the other ranks' parts of `image`'s step, until they are all
        there (True), a newer step is due to finish, a rank is known to be
        gone without an image of the step here, or PERSIST_TIMEOUT_S: a rank
        that died before writing its part never will (its part is written
        from its image when this node holds one, see `_stand_in`), and the
        folder of a newer step supersedes this one (an incomplete folder is
        pruned). Closing is no reason to stop waiting: the last step's parts
        come as the ranks close, each in its own time."""
        started = time.monotonic()
        world, round_ = image.world_size, image.round
        while True:
            gone = not persist.write_stand_ins(folder, world, round_, self._stand_in)
            missing = persist.missing_parts(folder, world_size=world, round=round_)
            if not missing:
                persist.finish(folder, world_size=world, round=round_, timeout=0)
                return True
            with self._lock:
                newer = self._finish_due if self._finish_due > image.step else None
            waited = time.monotonic() - started
            if gone or newer is not None or waited > PERSIST_TIMEOUT_S:
                why = self._not_persisted(image, folder, missing, waited, newer, gone)
                _log.warning("%s", why)
                return False
            time.sleep(0.05)

    def _not_persisted(
        self,
        image: ImageFile,
        folder: Path,
        missing: list[int],
        waited: float,
        newer: int | None,
        gone: bool = False,
    ) -> str:
        """Why `image`'s step is not on disk, and what is."""
        why = (
            f"a rank of {missing} is gone, and this node holds no image of its part"
            if gone
            else f"step {newer} was due before the parts of ranks {missing} came"
            if newer is not None
            else f"the parts of ranks {missing} did not come within {waited:.0f}s "
            "(did those ranks stop before their Checkpointer closed?)"
        )
        on_disk = self._on_disk()
        return (
            f"step {image.step} is not persisted: {why}; {persist.partial_folder(folder)} "
            f"stays incomplete and is never loaded; {on_disk}"
        )

    def _finish(self, image: ImageFile, folder: Path) -> None:
        started = time.monotonic()
        if not self._all_parts_written(image, folder):
            return
        persist.prune(self.persist_dir, self.keep_persisted)
        _log.info(
            "persisted step %d to %s in %.2fs", image.step, folder, time.monotonic() - started
        )
        master = os.environ.get(MASTER_ENV)
        if master:
            with MasterClient(master, token=self._token) as client:
                client.report_persisted(
                    checkpoint_pb2.PersistedReport(
                        step=image.step,
                        path=str(folder),
                        round=image.round,
                        world_size=image.world_size,
                    )
                )

    def _watch_sigterm(self) -> None:
        """Persist on SIGTERM (see `_on_sigterm`): a handler can only be set
        from the main thread."""
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._term_watch = TermWatch(self._persist_then_wake_main)
            atexit.register(self._persist_before_exit)

    def _persist_before_exit(self) -> None:
        """At the interpreter's exit, a persist SIGTERM started (on
        TermWatch's thread, a daemon: ended with the interpreter) is
        finished first, or run here if the thread has not read the signal
        yet. The main thread may leave without ever running this module's
        handler: another handler of the signal raised (Lightning's
        broadcasts to the peers, and fails when one is dead), or the
        training failed on the dead peer just before the signal came."""
        watch = self._term_watch
        if watch is not None and (watch.signalled.is_set() or watch.pending()):
            self._term_handled.set()  # the main thread needs no waking: it is leaving
            self._persist_on_term()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Preempted (the agent stops its workers with SIGTERM, then SIGKILL
        after a grace period): persist the newest image first, if it is not
        on disk yet, then go on as the previous handler would. The newest
        save may still be sealing (its checksums run in the background):
        wait for it, within the same bound, so its step is the one kept.

        The ranks of a round are stopped one by one, so one may have saved
        a step that another, stopped a moment earlier, never reached (or
        the reverse). Each rank therefore writes its part of every image it
        holds of its newest round (its newest and the one before), newest
        first; rank 0 finishes the newest step whose parts all come.

        This handler runs on the main thread only once it is back in Python:
        a rank blocked in a collective (its peer stopped first) would never
        persist. So `TermWatch` persists on a thread as soon as the signal
        comes; the handler then finds it done (or waits for it) and goes on.
        """
        self._term_handled.set()
        self._persist_on_term()
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
            return
        raise SystemExit(128 + signum)

    def _persist_then_wake_main(self) -> None:
        """TermWatch's action: the persist, then the main thread's handler.
        The kernel hands a process's signal to any of its threads: taken
        by another one, it does not interrupt the main thread's blocking
        call (a `time.sleep`, a wait in C), whose handler then runs only
        when that call returns. So unless it has run by then, the signal
        goes to the main thread itself."""
        self._persist_on_term()
        if not self._term_handled.wait(TERM_HANDLER_WAIT_S):
            main = threading.main_thread().ident
            if main is not None:
                signal.pthread_kill(main, signal.SIGTERM)

    def _persist_on_term(self) -> None:
        """`_on_sigterm`'s persist, once, from whichever thread comes first
        (the other waits for it)."""
        with self._term_lock:
            if self._term_done:
                return
            self._term_done = True
            with self._acked:
                self._acked.wait_for(lambda: self._sealing is None, SIGTERM_PERSIST_S)
            image = self._last_image
            if image is not None and not self._persisted(image.step):
                with self._acked:
                    self._acked.wait_for(lambda: self._persisting is None, SIGTERM_PERSIST_S)
                if not self._persisted(image.step):
                    self._persist_held(image)

    def _persist_held(self, newest: ImageFile) -> None:
        """`_on_sigterm`'s persist: this rank's part of each image it holds
        of `newest`'s round, newest first; rank 0 then finishes the newest
        step whole on disk within SIGTERM_PERSIST_S."""
        held = self._writer.images() if self._writer is not None else [newest]
        images = sorted(
            (i for i in held if i.round == newest.round and i.step <= newest.step),
            key=lambda i: i.step,
            reverse=True,
        )
        written: list[ImageFile] = []  # this rank's part is written: now, or by the persister
        for image in images:
            if self._persisted(image.step):
                break  # an older step than one on disk is no use
            if not self._claim(image):
                written.append(image)
                continue
            try:
                persist.write_part(LocalImage(image.header_path), self.persist_dir)
                written.append(image)
            except (OSError, CheckpointError) as exc:
                _log.error("terminated: step %d could not be persisted: %s", image.step, exc)
        if newest.rank != 0 or not written:
            if written:
                _log.warning(
                    "terminated: wrote this rank's part of step(s) %s",
                    ", ".join(str(i.step) for i in written),
                )
            return
        folders = {persist.step_folder(self.persist_dir, i.step): i for i in written}
        try:
            finished = persist.finish_newest(
                [(folder, i.world_size, i.round) for folder, i in folders.items()],
                timeout=SIGTERM_PERSIST_S,
                stand_in=self._stand_in,
            )
        except (OSError, CheckpointError) as exc:
            _log.error("terminated: no step could be persisted: %s", exc)
            return
        if finished is None:
            steps = ", ".join(str(i.step) for i in written)
            _log.error(
                "terminated: step(s) %s could not be persisted: the other ranks' parts did "
                "not come within %.0fs; the folders stay incomplete and are never loaded",
                steps,
                SIGTERM_PERSIST_S,
            )
            return
        _log.warning("terminated: persisted step %d first", folders[finished].step)

    def _stand_in(self, step: int, round_: int, rank: int) -> ImageSource | persist.Absent:
        """Rank 0's stand-in on SIGTERM for a part not written: see
        `persist.node_stand_in` (the node's folder only; a private folder
        is this rank's alone, and says nothing of the others)."""
        if self._private:
            return persist.Absent.COMING
        return persist.node_stand_in(self.image_dir, step, round_, rank)

    def _check_location(self, round_: int) -> None:
        """Once per round, at its first load or save (a node that joins later is
        checked in its first round): fail on every rank now if some host cannot
        see the persist location, rather than persist steps that can never be
        whole there. Nothing to check when nothing is persisted, in a world of
        one process or of one node (its ranks share its file system)."""
        if not self.persist_every or self._location_round == round_ or _group_size() < 2:
            return
        if _node_count() != 1:
            location.check_shared(self.persist_dir, node=_node_name())
        self._location_round = round_

    def _persisted(self, step: int) -> bool:
        return (persist.step_folder(self.persist_dir, step) / persist.METADATA).exists()

    # -------------------------------------------------------------- load

    def load(self, state: dict[str, Any] | None = None) -> Restored | None:
        """The newest step every rank can restore, or None (start afresh).

        With `state` (a template: e.g. `{"model": model.state_dict(), ...}` or
        torch.distributed.checkpoint.state_dict's get_state_dict for sharded
        models), it is loaded in place and returned; without, the saved
        nested state dict is rebuilt (replicated state only)."""
        self._settle(raise_error=False)  # an image of the round that ended, still being finished
        self._check_location(_context()[2])
        restored = self._load(state)
        # The lineage goes on from the restored step: saves of later steps
        # by the round that failed are history, whatever was committed then.
        with self._acked:
            base = restored.step if restored is not None else -1
            self._committed = self._announced = self._last_saved = base
            self._round = _context()[2]
        self._start_auto()
        return restored

    def _load(self, state: dict[str, Any] | None) -> Restored | None:
        rank, world, _ = _context()
        before = 0
        ceiling: list[int] = []  # the master's restart-loop ceiling, once told
        lost: list[int] = []  # a committed step the master says is gone, once told
        for _ in range(_ATTEMPTS):
            step, addresses = _agree(self._newest_in_memory(before, ceiling, lost))
            if step < 0:
                break
            restored = self._try(self._from_memory, step, addresses, state, rank, world)
            if restored is not None:
                return restored
            before = step
        # The breaker's ceiling holds on disk too: a step at or above it is
        # the one the job keeps failing after.
        below: int | None = ceiling[0] if ceiling else None
        for _ in range(_ATTEMPTS):
            # Rank 0 verifies and chooses; the others take its choice.
            alone = rank == 0 or _group_size() == 1
            step = _agree_step(self._newest_on_disk(below) if alone else -1)
            if step < 0:
                if lost and rank == 0:
                    _log.warning(
                        "starting afresh, though the job had committed step %d: its images "
                        "were on nodes that are gone and it was never persisted (persist_every "
                        "%d, persist_dir %s). The model starts over while the dataset goes on "
                        "from where the job was: the records trained since the start are not "
                        "in it. Persist (persist_every, or SIGTERM before a node goes) to keep "
                        "a job's steps past the loss of every node",
                        lost[0], self.persist_every, self.persist_dir,
                    )  # fmt: skip
                return None
            restored = self._try(self._from_disk, step, [], state, rank, world)
            if restored is not None:
                return restored
            below = step
        raise CheckpointError(
            f"no persisted step could be read by every rank (the last tried: {below})"
        )

    def _newest_in_memory(
        self, before: int, ceiling: list[int], lost: list[int]
    ) -> checkpoint_pb2.CheckpointRecord | None:
        """The master's newest restorable step below `before` (0: any); a
        restart-loop ceiling it names is put in `ceiling`, a committed step
        it says is lost in `lost`."""
        master = os.environ.get(MASTER_ENV)
        if not master or self._private:
            return None
        with MasterClient(master, token=self._token) as client:
            record = client.latest_checkpoint(before_step=before)
        if record.below_step > 0 and not ceiling:
            _log.warning(
                "restart loop: restoring a step below %d, the step the job keeps failing after",
                record.below_step,
            )
            ceiling.append(record.below_step)
        if record.lost_step > 0 and not lost:
            lost.append(record.lost_step)
        return record if record.found else None

    def _newest_on_disk(self, below: int | None) -> int:
        """The newest complete folder below step `below` that its manifest
        verifies (rank 0 looks; the others read what it chose). Each folder
        passed over is said, with the file that failed."""
        folders = persist.complete_folders(self.persist_dir)
        paths = dict(folders)
        candidates = [
            Candidate(
                Rung.PERSISTED if step == folders[-1][0] else Rung.OLDER_PERSISTED, step, str(path)
            )
            for step, path in folders
        ]

        def verify(candidate: Candidate) -> Verification:
            try:
                persist.verify_folder(paths[candidate.step])
            except PersistCorruptError as exc:
                return Rejected(Skip.CHECKSUM, str(exc))
            except OSError as exc:
                return Rejected(Skip.MISSING, str(exc))
            return Verified()

        descent = descend(candidates, verify, below_step=below)
        if descent.passed and any(p.why is not Skip.ABOVE_BREAKER for p in descent.passed):
            _log.warning("%s", descent.describe())
        return descent.chosen.step if descent.chosen is not None else -1

    def _try(
        self,
        read: Any,
        step: int,
        addresses: list[tuple[int, str]],
        state: dict[str, Any] | None,
        rank: int,
        world: int,
    ) -> Restored | None:
        """Every rank reads `step`; all succeed or all give it up."""
        try:
            restored: Restored | None = read(step, addresses, state, rank, world)
        except (OSError, CheckpointError, DlfleetError) as exc:
            _log.warning("rank %d cannot restore step %d: %s", rank, step, exc)
            restored = None
        if not _all_agree(restored is not None):
            return None
        return restored

    def _from_memory(
        self,
        step: int,
        addresses: list[tuple[int, str]],
        state: dict[str, Any] | None,
        rank: int,
        world: int,
    ) -> Restored:
        sources: list[ImageSource] = list(self._local_images(step))
        source = MEMORY
        held = {s.header.rank for s in sources}
        try:
            return Restored(step, _restore(state, sources, rank, world), source)
        except CheckpointError:
            if not addresses:
                raise
        # Not enough here (a sharded state, or this node holds none of it):
        # fetch the other ranks' images from the nodes that hold them.
        for saved_rank, address in addresses:
            if saved_rank in held:
                continue
            header, body = fetch_image(address, self._token, step, saved_rank)
            sources.append(BytesImage(header, body))
            held.add(saved_rank)
            source = PEER
        return Restored(step, _restore(state, sources, rank, world), source)

    def _local_images(self, step: int) -> list[LocalImage]:
        folders = [self.image_dir]
        if not self._private:
            folders += files.replica_folders(self.image_dir)
        found = []
        for folder in folders:
            for stored in files.list_images(folder):
                if stored.header.step == step:
                    try:
                        found.append(LocalImage(stored.header_path))
                    except ImageCorruptError as exc:
                        _log.warning("passing over a damaged image: %s", exc)
                    except (OSError, CheckpointError):
                        continue  # reused while we looked
        return found

    def _from_disk(
        self,
        step: int,
        addresses: list[tuple[int, str]],
        state: dict[str, Any] | None,
        rank: int,
        world: int,
    ) -> Restored:
        folder = persist.step_folder(self.persist_dir, step)
        if state is None:
            return Restored(step, persist.load_persisted_full(folder), DISK)
        persist.load_persisted(state, folder)
        return Restored(step, state, DISK)

    # -------------------------------------------------------------- end

    def close(self) -> None:
        """Persist the last image (when persisting), then stop the helpers."""
        self._settle(raise_error=False)
        self._seals.put(None)
        if self.persist_every and self._last_image is not None:
            image = self._last_image
            # A step that was due is persisted (or being persisted) already.
            if not self._persisted(image.step) and self._claim(image):
                with self._acked:  # marked as persisting, for a SIGTERM meanwhile to wait for
                    self._acked.wait_for(lambda: self._persisting is None, PERSIST_TIMEOUT_S)
                    self._persisting = image.step
                self._persists.put(image)
        self._closing.set()  # the last image is announced without waiting out the interval
        self._notices.put(None)
        self._persists.put(None)
        for thread in self._threads:
            thread.join(timeout=PERSIST_TIMEOUT_S + 30.0)
        if self._writer is not None:
            self._writer.close()
        if self._term_watch is not None:
            atexit.unregister(self._persist_before_exit)
            self._term_watch.close()
            self._term_watch = None
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if self._agent_channel is not None:
            self._agent_channel.close()
        if self._private:
            shutil.rmtree(self.image_dir, ignore_errors=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------ helpers


def _disk_error(exc: BaseException) -> str:
    """What went wrong, by the file system's own error where there is one:
    torch.save reports a full disk as a RuntimeError about zip positions,
    raised while handling the OSError that says it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return str(seen) if seen is exc else f"{seen} ({exc})"
        seen = seen.__cause__ or seen.__context__
    return str(exc)


def _context() -> tuple[int, int, int]:
    """(rank, world size, round) of this process now."""
    attempt = elastic.current()
    if attempt is not None:
        return attempt.rank, attempt.world_size, attempt.round
    import torch.distributed as dist

    round_ = int(os.environ.get(ROUND_ENV, "0") or 0)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), round_
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), round_


def _local_context() -> tuple[int, int]:
    """(local rank, local world size) of this process now."""
    attempt = elastic.current()
    if attempt is not None:
        return attempt.local_rank, attempt.local_world_size
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _node_count() -> int | None:
    """How many nodes the round has, None when nothing says (a process group
    initialised by hand, without torchrun or dlworker)."""
    attempt = elastic.current()
    if attempt is not None and attempt.in_process:
        return attempt.group_world_size
    value = os.environ.get("GROUP_WORLD_SIZE")
    return int(value) if value else None


def _node_name() -> str:
    """This process's node, as an error names it: the agent's node id or the
    node's group rank, and the host."""
    attempt = elastic.current()
    group_rank = (
        str(attempt.group_rank)
        if attempt is not None and attempt.in_process
        else os.environ.get("GROUP_RANK")
    )
    node = os.environ.get(NODE_ID_ENV) or (f"node {group_rank}" if group_rank else "")
    host = socket.gethostname()
    return f"{node} on host {host}" if node else f"host {host}"


def _restore(
    state: dict[str, Any] | None, sources: list[ImageSource], rank: int, world: int
) -> dict[str, Any]:
    if state is None:
        return load_full(sources, rank=rank, world_size=world)
    restore_into(state, sources, rank=rank, world_size=world)
    return state


def _group_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _agree(record: checkpoint_pb2.CheckpointRecord | None) -> tuple[int, list[tuple[int, str]]]:
    """Rank 0's choice of step, on every rank; with where its images are."""
    step = _agree_step(record.step if record is not None else -1)
    if step < 0 or record is None or record.step != step:
        # This rank's own view differs (a report landed in between): ask
        # the master for that very step.
        master = os.environ.get(MASTER_ENV)
        if step < 0 or not master:
            return step, []
        with MasterClient(master, token=os.environ.get(TOKEN_ENV, "")) as client:
            record = client.latest_checkpoint(before_step=step + 1)
        if not record.found or record.step != step:
            return step, []
    return step, [(copy.rank, copy.address) for copy in record.copies if copy.address]


def _agree_step(step: int) -> int:
    if _group_size() == 1:
        return step
    import torch
    import torch.distributed as dist

    chosen = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(chosen, src=0)
    return int(chosen.item())


def _all_agree(ok: bool) -> bool:
    return _all_reduced(1 if ok else 0, "MIN") == 1


def _agreed_max(value: int) -> int:
    """The largest `value` of the ranks (every rank calls it at the same save)."""
    return _all_reduced(value, "MAX")


def _all_reduced(value: int, op: str) -> int:
    """`value` reduced by `op` over the default group (one all-reduce), or
    `value` alone without a group."""
    if _group_size() == 1:
        return value
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    reduced = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(reduced, op=getattr(dist.ReduceOp, op))
    return int(reduced.item())

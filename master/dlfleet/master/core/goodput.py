"""The job's goodput ledger: how much of its wall time went into training
steps, and where the rest went, by cause.

Why the master keeps it: an operator asking "how much did the faults cost
us?" should not have to parse a training script's logs. The master already
hears everything that interrupts training (rounds closing and forming, nodes
lost, workers failing or hanging, the rendezvous waiting for nodes) and, with
every heartbeat, how many steps each node made and how long one took. That is
enough to tile time.

The window opens at the job's first step and ends at the last instant the
ledger could account for. Inside it, every millisecond is in exactly one
place: productive (training steps) or lost to one `Cause`. So
`productive + sum(lost) == window` always, and the ratio is in [0, 1].

How time is tiled. Between events the job is in a *phase*: training, or
interrupted by a cause. Time passing while interrupted is lost to that cause.
Time passing while training is held *idle* until its cause is known: a
heartbeat that shows steps hands it back as productive (the steps' count
times the typical step time, at most the time elapsed). When an interruption
is heard, the idle time since the last step is what it took to notice it and
goes to the interruption's detection cause (a hang's wait for the watchdog
goes to `hang_detection`). When the job instead steps on, idle time that two
counts of steps left untaken is the training's own slack (`other`): a
progress file's write can lag a heartbeat by most of one, so steps are often
counted a heartbeat late, and they first take back the idle time before
their interval (what they bring beyond it is held as credit for the next
idle time). Idle time not yet explained is outside the reported window, so a
job that has just stopped stepping (or finished) reports the window up to
its last step. A heartbeat says how old its counts are (they were written
up to a progress interval before it): when steps end an interruption, the
time since their write is idle again rather than the interruption's, and
the next count takes it back with the steps made in it.

Write times, where the heartbeats tell them, settle the rest without the
typical step: two writes of one process with steps between them and no
interruption heard mean the job trained all the way to the later write,
however long its steps took meanwhile (a loaded machine's slow steps are
the job's pace, not slack), and what came after that write waits for the
next count. At an interruption, a node's last word settles the time up to
its last write, whichever node of the round says it (ranks step together:
the survivors of a node that died with its agent tell when training
stopped). A process that lived through the interruption (restarted in
place) has no last word to give (its file is gone between attempts, and a
beat that finds none settles nothing); its first counts after it say when
its previous run made its last step, and the job trained up to then. The
same counts say when their run began: training resumed there. Steps x the
typical step time remain for counts that tell neither.

Which heartbeats count. Data-parallel ranks step in lockstep, so one node's
steps are the job's: the ledger follows one *reference* node, the first that
steps, until it is lost or is no member of a new round; then the next node
that steps takes over, its first interval clipped to the time since the
previous reference's last count so that no step is counted twice. Summing
every node's steps would count the same training time once per node.

The typical step time is the mean of the latest reported step times, leaving
out those over `OUTLIER_OF_MEDIAN` times their median: the figure a heartbeat
carries spans the gap of a restart now and then, and one such figure must not
turn a restart into productive time; but a median alone is short of the
steps' real pace, since a loaded machine makes some steps several times
slower than the rest (a 2-minute chaos run showed it as 7 s of false slack,
4% of its window, while the steps' own lines showed none).

The steps a reference made after its last heartbeat and before its workers
stopped would otherwise go to the failure that stopped them (the next
process counts from zero). So an agent tells the master its stopped workers'
final count at once, still about the round that closed (`stopped`): those
steps take back the time charged since the last count, and never mean the
job trains again; if the next round formed before that word came, those it
trained beyond the step that round restored are rolled back.

Corrections after the fact move time out of productive: steps a round rolled
back (trained, then discarded by restoring an older checkpoint) become
`rolled_back`; the time a node reports its training was blocked writing
checkpoints becomes `checkpoint`.

How many steps a restore rolls back: the reference reports the training step
it is at (its last save's step plus the steps since), and a round that forms
says which step it restores; the difference is what was trained and lost.
That report is only as fresh as the last save, and a process restored in
place counts on from its old save until its next one, so the step it is at
is taken as at most the previous round's restored step plus the steps
counted since: no more than the ledger counted is taken back.

Pure: no clock, no I/O; each method takes `now_ms` (the master's clock, as
the events were heard: wall-clock milliseconds, so that they mean the same
in the next master process). Kept across a master restart: the master
writes the whole ledger (`to_dict`) to its journal every few seconds and a
restarted master goes on from the last one written (`from_dict`). The gap
from that write to the first event the new master hears is charged like any
other time (idle while training, which the steps the nodes made meanwhile
take back, since their counts of steps are kept too), so the window is the
job's, not the process's.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

# Step times whose mean is the typical step.
TYPICAL_OF = 15
# A step time over this many times the median spans a gap, not steps.
OUTLIER_OF_MEDIAN = 3.0


class Cause(StrEnum):
    """Where lost time went."""

    RESTART = "restart"  # workers failed and restart (their detection included)
    RE_RENDEZVOUS = "re_rendezvous"  # the round re-forms (a node joined, a scale)
    HANG_DETECTION = "hang_detection"  # a hung step, until the watchdog said so
    NODE_REPLACEMENT = "node_replacement"  # a node was lost, until training resumed
    CHECKPOINT = "checkpoint"  # training blocked on checkpoint writes
    ROLLED_BACK = "rolled_back"  # steps trained, then undone by a restore
    WAITING_FOR_NODES = "waiting_for_nodes"  # fewer nodes than the job's minimum
    OTHER = "other"  # the training's own slack between steps


@dataclass(frozen=True)
class Goodput:
    """The ledger as of `as_of_ms`, in milliseconds. `lost_ms` holds every
    cause (zero where none was lost)."""

    opened_ms: int | None  # the first step; None before it
    as_of_ms: int  # the window's end: the last instant accounted for
    productive_ms: float
    lost_ms: Mapping[Cause, float]
    phase: Cause | None  # the interruption the job is in; None: training

    @property
    def window_ms(self) -> float:
        return self.productive_ms + sum(self.lost_ms.values())

    @property
    def ratio(self) -> float:
        """Productive share of the window; 0 before the first step."""
        window = self.window_ms
        return min(1.0, max(0.0, self.productive_ms / window)) if window > 0 else 0.0


@dataclass
class _Beat:
    steps: int
    at_ms: int
    written_ms: int | None = None  # when its counts were written (None: not said)


@dataclass
class _Charge:
    """Time charged since the reference's last counted heartbeat, by where it
    went (a cause, or None: idle): what that heartbeat's steps may take back."""

    cause: Cause | None
    ms: float


@dataclass
class GoodputLedger:
    opened_ms: int | None = None
    until_ms: int = 0  # time is accounted up to here (idle included)
    phase: Cause | None = None
    # The cause that holds after waiting for nodes ends.
    resumes_as: Cause | None = None
    interrupted_ms: int = 0  # when the phase last became an interruption
    productive_ms: float = 0.0
    lost_ms: dict[Cause, float] = field(default_factory=lambda: dict.fromkeys(Cause, 0.0))
    idle_ms: float = 0.0
    aged_ms: float = 0.0  # of idle_ms: left over after a count of steps already
    reference: str | None = None
    counted_ms: int = 0  # the reference's last counted heartbeat
    stepping: bool = False  # that heartbeat showed steps
    # Step time counted beyond the idle time it could take back (steps that
    # reached a heartbeat late), held for the next idle time while training.
    credit_ms: float = 0.0
    charges: list[_Charge] = field(default_factory=list)
    # Where those charges begin: the last count, or the write it told of.
    charges_from_ms: float = 0.0
    beats: dict[str, _Beat] = field(default_factory=dict)
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=TYPICAL_OF))
    blocked_ms: dict[str, float] = field(default_factory=dict)
    # The step the reference last said it trained (None: not said this round),
    # the steps counted since the round formed, and the step it restored.
    trained_step: int | None = None
    round_steps: int = 0
    round_restored: int = 0
    # Set by a round that formed while the job was interrupted, until it
    # steps: the step it restored (-1: none) and the step up to which what
    # was trained before it is accounted (rolled back or not), for a count of
    # the previous round's workers that arrives late (`stopped`).
    restore: tuple[int, int] | None = None

    # ------------------------------------------------------------ events

    def stepped(
        self,
        node_id: str,
        steps: int,
        step_time_ms: float,
        now_ms: int,
        trained_step: int | None = None,
        age_ms: float = 0.0,
        stepping_ms: float = 0.0,
        run_ended_ms: float = 0.0,
    ) -> None:
        """A heartbeat of a member of the active round: its rank 0 has made
        `steps` steps since its process started, `step_time_ms` each lately
        (0: unknown), and is at training step `trained_step` (None: unknown);
        its counts were written `age_ms` before the heartbeat, its current
        run of steps began `stepping_ms` before it, and the run before that
        made its last step `run_ended_ms` before it (0: unknown)."""
        if trained_step is not None and self.reference in (None, node_id):
            self.trained_step = trained_step
        before = self.beats.get(node_id)
        written = round(now_ms - age_ms) if age_ms > 0 else None
        self.beats[node_id] = _Beat(steps, now_ms, written)
        if step_time_ms > 0:
            self.step_times.append(step_time_ms)
        made = steps if before is None or steps < before.steps else steps - before.steps
        if self.opened_ms is None:
            if made > 0:
                self._open(node_id, made, before, now_ms)
            return
        self._advance(now_ms)
        self._run_ended(now_ms, run_ended_ms)
        if made <= 0 or (self.reference not in (None, node_id)):
            if node_id == self.reference:
                self._no_steps(written, now_ms)
            return
        self.reference = node_id
        self.round_steps += made
        if trained_step is not None:
            self.trained_step = trained_step
        if (
            self.phase is None
            and written is not None
            and before is not None
            and before.written_ms is not None
            and steps > before.steps
        ):
            self._trained_until(written, now_ms)
            return
        if self.phase is not None and self._resumed(now_ms, written, stepping_ms):
            return
        since = max(before.at_ms if before is not None else self.counted_ms, self.counted_ms)
        span = max(0, now_ms - since)
        full_ms = made * self._typical_ms() if self.step_times else float(span)
        made_ms = min(full_ms, span)
        if self.phase is None:
            full_ms += self.credit_ms
            taken = self._take_back(min(full_ms, span), earliest_first=False)
            # Steps beyond this interval were made before it and counted late
            # (a progress file written just after the previous heartbeat):
            # they take back the idle time that still waits for a cause.
            older = self.idle_ms - self._idle_in_charges()
            late = min(full_ms - taken, older)
            # Idle time is slack once two counts of steps went by without
            # taking it back: a write can lag a heartbeat by most of one.
            slack = min(self.aged_ms, older - late)
            self.productive_ms += taken + late
            self.lost_ms[Cause.OTHER] += slack
            self.idle_ms -= late + slack
            self.aged_ms = older - late - slack
            # What is left was made in time already called slack: it covers
            # the next idle time instead (at most an interval's worth).
            self.credit_ms = min(full_ms - taken - late, span)
        else:
            # Steps that fit before the interruption were made before it
            # (if the job was stepping at the last count); more than half a
            # step beyond that: the job trains again.
            before_ms = min(made_ms, max(0, self.interrupted_ms - since)) if self.stepping else 0
            after_ms = made_ms - before_ms
            # Steps held from before (`credit_ms`) were made before it too.
            before_ms = min(before_ms + self.credit_ms, span - after_ms)
            self.credit_ms = 0.0
            self.productive_ms += self._take_back(before_ms, earliest_first=True)
            if after_ms > self._typical_ms() / 2:
                self.productive_ms += self._take_back(after_ms, earliest_first=False)
                self.phase, self.resumes_as, self.restore = None, None, None
                # Training resumed before the counts' write, and what came
                # after it is not known yet: idle, for the next count to take.
                self._release(min(age_ms, span - after_ms))
        self._counted(now_ms, stepping=True)

    def interrupted(self, detected_as: Cause, then: Cause, now_ms: int) -> None:
        """Training stopped, and the master heard why: the idle time since
        the last step is `detected_as`, and what follows is `then` until the
        job steps again. An interruption heard while the job is already
        interrupted keeps the first cause."""
        if self.opened_ms is None:
            return
        self._advance(now_ms)
        if self.phase is not None:
            return
        self._blame_idle(detected_as)
        self.phase, self.interrupted_ms = then, now_ms

    def waiting_for_nodes(self, waiting: bool, now_ms: int) -> None:
        """Whether the rendezvous waits for nodes to reach the job's minimum:
        while it does, that is the cause; after, the cause before it."""
        if self.opened_ms is None:
            return
        self._advance(now_ms)
        if waiting and self.phase is not Cause.WAITING_FOR_NODES:
            if self.phase is None:
                self._blame_idle(Cause.WAITING_FOR_NODES)
                self.interrupted_ms = now_ms
            self.resumes_as = self.phase or Cause.RE_RENDEZVOUS
            self.phase = Cause.WAITING_FOR_NODES
        elif not waiting and self.phase is Cause.WAITING_FOR_NODES:
            self.phase, self.resumes_as = self.resumes_as or Cause.RE_RENDEZVOUS, None

    def node_gone(self, node_id: str) -> None:
        """`node_id` left the round (lost, dropped, finished): its beats no
        longer speak for the job."""
        self.beats.pop(node_id, None)
        self.blocked_ms.pop(node_id, None)
        if self.reference == node_id:
            self.reference = None

    def round_formed(self, members: frozenset[str]) -> None:
        """A round formed: a reference that is no member of it steps down."""
        if self.reference is not None and self.reference not in members:
            self.reference = None

    def restored(self, step: int, committed: int, now_ms: int) -> None:
        """A round formed that restores training step `step` (-1: none, a
        fresh start), when the newest step committed as the previous round
        closed was `committed` (-1: none): what was trained beyond `step` is
        rolled back."""
        trained = max(committed, -1 if self.trained_step is None else self.trained_step)
        accounted = step
        if step >= 0 and trained > step:
            counted = self.round_restored + self.round_steps
            accounted = max(step, min(trained, counted))
            self.rolled_back(accounted - step, now_ms)
        self.trained_step, self.round_steps, self.round_restored = None, 0, max(step, 0)
        if self.phase is not None:
            self.restore = (step, accounted)

    def stopped(
        self,
        node_id: str,
        steps: int,
        now_ms: int,
        trained_step: int | None = None,
        age_ms: float = 0.0,
    ) -> None:
        """The last count of a node's workers in a round that closed: its
        agent's word as it stopped them (or a beat that still speaks of that
        round), written `age_ms` before (0: not said). The steps its rank 0
        made since the previous count were made before the interruption, so
        they take back time charged since that count, earliest first (up to
        the write, when it is known; else as many typical steps), and never
        mean that training resumed. Ranks step together, so the word of any
        node of that round tells how long training went on, once its write
        time is known; the reference's also tells the steps: if the next
        round formed already, those trained beyond the step it restored
        (`trained_step` tells; unknown: all of them) were rolled back. Too
        late once training resumed: the time they could take back is settled."""
        before = self.beats.get(node_id)
        written = round(now_ms - age_ms) if age_ms > 0 else None
        reference = node_id == self.reference
        if (
            self.opened_ms is None
            or self.phase is None
            or before is None
            or steps <= before.steps
            or (not reference and written is None)
        ):
            return
        self._advance(now_ms)
        made = steps - before.steps
        self.beats[node_id] = _Beat(steps, now_ms, written)
        if written is not None:
            taken = self._trained_to(written)
        else:
            trained_ms = self._time_of(made, max(0, now_ms - max(before.at_ms, self.counted_ms)))
            taken = self._trained_to(self.charges_from_ms + trained_ms)
        if not reference:
            return
        if self.restore is None:
            # The round that will restore has not formed: the steps are the
            # closed round's, for it to roll back.
            self.round_steps += made
            if trained_step is not None:
                self.trained_step = max(trained_step, self.trained_step or 0)
            return
        step, accounted = self.restore
        if step < 0:
            return  # a fresh start rolls nothing back (as `restored`)
        beyond = made if trained_step is None else min(made, trained_step - accounted)
        if beyond > 0:
            self._reclassify(Cause.ROLLED_BACK, self._time_of(beyond, taken))
            self.restore = (step, accounted + beyond)

    def rolled_back(self, steps: int, now_ms: int) -> None:
        """A round restored a checkpoint `steps` steps older than the newest
        step trained: that training is lost."""
        if self.opened_ms is None or steps <= 0:
            return
        self._advance(now_ms)
        self._reclassify(Cause.ROLLED_BACK, self._time_of(steps, self.productive_ms))

    def checkpoint_blocked(self, node_id: str, blocked_s: float, now_ms: int) -> None:
        """The reference's training processes have been blocked `blocked_s`
        in all writing checkpoints (a running total per process)."""
        before = self.blocked_ms.get(node_id, 0.0)
        now_blocked = blocked_s * 1000
        self.blocked_ms[node_id] = now_blocked
        if node_id != self.reference or self.opened_ms is None:
            return
        # Less than before: a new process, whose total starts again.
        blocked = now_blocked - before if now_blocked >= before else now_blocked
        if blocked > 0:
            self._advance(now_ms)
            self._reclassify(Cause.CHECKPOINT, blocked)

    # ------------------------------------------------------------ journal

    def to_dict(self) -> dict[str, Any]:
        """The whole ledger as JSON-able data (the master's journal)."""
        return {
            "opened_ms": self.opened_ms,
            "until_ms": self.until_ms,
            "phase": self.phase,
            "resumes_as": self.resumes_as,
            "interrupted_ms": self.interrupted_ms,
            "productive_ms": self.productive_ms,
            "lost_ms": {cause.value: ms for cause, ms in self.lost_ms.items()},
            "idle_ms": self.idle_ms,
            "aged_ms": self.aged_ms,
            "reference": self.reference,
            "counted_ms": self.counted_ms,
            "stepping": self.stepping,
            "credit_ms": self.credit_ms,
            "charges": [[charge.cause, charge.ms] for charge in self.charges],
            "charges_from_ms": self.charges_from_ms,
            "beats": {
                node: [beat.steps, beat.at_ms, beat.written_ms] for node, beat in self.beats.items()
            },
            "step_times": list(self.step_times),
            "blocked_ms": self.blocked_ms,
            "trained_step": self.trained_step,
            "round_steps": self.round_steps,
            "round_restored": self.round_restored,
            "restore": None if self.restore is None else list(self.restore),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GoodputLedger:
        """The ledger `to_dict` gave. A field it lacks keeps its default (a
        ledger written by an older master); a cause it does not know is an
        error naming it."""

        def known(value: str) -> Cause:
            try:
                return Cause(value)
            except ValueError:
                raise ValueError(f"goodput ledger: unknown cause {value!r}") from None

        def cause(value: str | None) -> Cause | None:
            return None if value is None else known(value)

        def _beat(steps: int, at_ms: int, written_ms: int | None = None) -> _Beat:
            return _Beat(int(steps), int(at_ms), None if written_ms is None else int(written_ms))

        ledger = cls()
        lost = dict.fromkeys(Cause, 0.0)
        for name, ms in data.get("lost_ms", {}).items():
            lost[known(name)] = float(ms)
        ledger.opened_ms = data.get("opened_ms")
        ledger.until_ms = int(data.get("until_ms", 0))
        ledger.phase = cause(data.get("phase"))
        ledger.resumes_as = cause(data.get("resumes_as"))
        ledger.interrupted_ms = int(data.get("interrupted_ms", 0))
        ledger.productive_ms = float(data.get("productive_ms", 0.0))
        ledger.lost_ms = lost
        ledger.idle_ms = float(data.get("idle_ms", 0.0))
        ledger.aged_ms = float(data.get("aged_ms", 0.0))
        ledger.reference = data.get("reference")
        ledger.counted_ms = int(data.get("counted_ms", 0))
        ledger.stepping = bool(data.get("stepping", False))
        ledger.credit_ms = float(data.get("credit_ms", 0.0))
        ledger.charges = [_Charge(cause(c), float(ms)) for c, ms in data.get("charges", [])]
        ledger.charges_from_ms = float(data.get("charges_from_ms", ledger.counted_ms))
        ledger.beats = {n: _beat(*fields) for n, fields in data.get("beats", {}).items()}
        ledger.step_times.extend(float(ms) for ms in data.get("step_times", []))
        ledger.blocked_ms = {n: float(ms) for n, ms in data.get("blocked_ms", {}).items()}
        ledger.trained_step = data.get("trained_step")
        ledger.round_steps = int(data.get("round_steps", 0))
        ledger.round_restored = int(data.get("round_restored", 0))
        restore = data.get("restore")
        ledger.restore = None if restore is None else (int(restore[0]), int(restore[1]))
        return ledger

    # ------------------------------------------------------------ report

    def report(self) -> Goodput:
        """What is settled: time charged since the reference's last count may
        still go back to productive (its next heartbeat tells), and idle time
        has no cause yet; both wait. So each cause's total only grows."""
        lost = dict(self.lost_ms)
        for charge in self.charges:
            if charge.cause is not None:
                lost[charge.cause] -= charge.ms
        report = Goodput(
            opened_ms=self.opened_ms,
            as_of_ms=0,
            productive_ms=self.productive_ms,
            lost_ms=lost,
            phase=self.phase,
        )
        if self.opened_ms is None:
            return report
        return replace(report, as_of_ms=self.opened_ms + round(report.window_ms))

    # ------------------------------------------------------------ steps

    def _open(self, node_id: str, made: int, before: _Beat | None, now_ms: int) -> None:
        """The first step: the window opens when it began (as far as the
        heartbeat tells), and the steps since are productive."""
        elapsed = now_ms - before.at_ms if before is not None else 0
        productive = self._time_of(made, elapsed) if self.step_times else elapsed
        self.opened_ms = now_ms - round(productive)
        self.until_ms = self.counted_ms = now_ms
        self.charges_from_ms = float(now_ms)
        self.stepping = True
        self.productive_ms = float(now_ms - self.opened_ms)
        self.reference = node_id
        self.round_steps += made

    def _typical_ms(self) -> float:
        if not self.step_times:
            return 0.0
        bound = OUTLIER_OF_MEDIAN * statistics.median(self.step_times)
        return statistics.fmean(ms for ms in self.step_times if ms <= bound)

    def _time_of(self, steps: int, at_most: float) -> float:
        """`steps` typical steps, in ms, at most `at_most` (all of it when no
        step time is known yet)."""
        if not self.step_times:
            return max(0.0, at_most)
        return max(0.0, min(at_most, steps * self._typical_ms()))

    def _counted(self, now_ms: int, *, stepping: bool) -> None:
        self.counted_ms, self.stepping = now_ms, stepping
        self.charges = []
        self.charges_from_ms = now_ms

    def _resumed(self, now_ms: int, written: int | None, stepping_ms: float) -> bool:
        """Whether counts written at `written` whose run of steps began
        `stepping_ms` before `now_ms` (a process's first step since it
        started or its last attempt ended) show training resumed after the
        interruption: then it trained from that first step to the write."""
        if not stepping_ms > 0 or written is None:
            return False
        began = now_ms - stepping_ms
        if began < self.interrupted_ms or written <= began:
            return False
        began = max(began, self.charges_from_ms)
        self.credit_ms = 0.0
        self.productive_ms += self._take_back(max(0.0, written - began), earliest_first=False)
        self.phase, self.resumes_as, self.restore = None, None, None
        self._release(now_ms - written)
        self._counted(now_ms, stepping=True)
        return True

    def _no_steps(self, written: int | None, now_ms: int) -> None:
        """The reference counted no steps. While interrupted, with its write
        time: none up to the write, and what came after it is not known yet
        (a stale file, a process about to step); without one (no file: its
        process is between attempts), none since, but nothing is settled: a
        process that lived through the interruption may yet say when it
        stopped stepping."""
        if self.phase is None:
            self._counted(now_ms, stepping=False)
            return
        if written is not None:
            self._settle_until(written)
        self.stepping = False

    def _run_ended(self, now_ms: int, run_ended_ms: float) -> None:
        """While interrupted: a process that lived through the interruption
        made the last step of its previous run `run_ended_ms` before now.
        Ranks step together, so the job trained up to then (that process had
        no last word to give: its file is gone between attempts)."""
        if self.phase is not None and run_ended_ms > 0:
            self._trained_to(min(now_ms - run_ended_ms, self.interrupted_ms))

    def _trained_to(self, until_ms: float) -> float:
        """The job trained up to `until_ms`: the time charged before it since
        the last count is productive. Returns what was moved."""
        taken = self._take_back(max(0.0, until_ms - self.charges_from_ms), earliest_first=True)
        self.charges_from_ms += taken
        self.productive_ms += taken
        return taken

    def _settle_until(self, written_ms: int) -> None:
        """Settle the time charged up to `written_ms` where it is (a count
        showed no steps up to then); what follows may still be taken back."""
        due = written_ms - self.charges_from_ms
        while due > 0 and self.charges:
            take = min(self.charges[0].ms, due)
            self.charges[0].ms -= take
            due -= take
            if self.charges[0].ms <= 0:
                self.charges.pop(0)
        self.charges_from_ms = max(self.charges_from_ms, float(written_ms))

    def _trained_until(self, written_ms: int, now_ms: int) -> None:
        """The reference wrote counts at `written_ms` that show steps since
        its previous write, in the same process, and training went on
        between (no interruption heard): the job trained up to that write,
        whatever its steps took meanwhile, so every idle moment before it is
        productive. What came after it waits for the next count (a
        heartbeat lags the write it reads by up to a progress interval)."""
        keep = min(self.idle_ms, float(max(0, now_ms - written_ms)))
        self.productive_ms += self.idle_ms - keep
        self.idle_ms, self.aged_ms, self.credit_ms = keep, 0.0, 0.0
        self._counted(now_ms, stepping=True)
        if keep > 0:
            self.charges = [_Charge(None, keep)]
        self.charges_from_ms = now_ms - keep

    def _advance(self, now_ms: int) -> None:
        """Charge the time since the last event to the phase: idle while
        training, else its cause."""
        span = now_ms - self.until_ms
        if span <= 0:
            return
        self.until_ms = now_ms
        if self.phase is None:
            self.idle_ms += span
        else:
            self.lost_ms[self.phase] += span
        if self.charges and self.charges[-1].cause is self.phase:
            self.charges[-1].ms += span
        else:
            self.charges.append(_Charge(self.phase, span))

    def _take_back(self, ms: float, *, earliest_first: bool) -> float:
        """Move up to `ms` charged since the last count back to productive:
        the earliest charges first for steps made before an interruption,
        the latest first for steps made since training resumed. Returns what
        was moved."""
        order = self.charges if earliest_first else reversed(self.charges)
        moved = 0.0
        for charge in order:
            take = min(charge.ms, ms - moved)
            if take <= 0:
                break
            charge.ms -= take
            moved += take
            if charge.cause is None:
                self.idle_ms -= take
            else:
                self.lost_ms[charge.cause] -= take
        return moved

    def _release(self, ms: float) -> None:
        """Move up to `ms` of the latest time charged to causes since the
        last count back to idle."""
        released = 0.0
        for charge in reversed(self.charges):
            if released >= ms:
                break
            if charge.cause is None:
                continue
            take = min(charge.ms, ms - released)
            charge.ms -= take
            self.lost_ms[charge.cause] -= take
            self.idle_ms += take
            released += take

    def _idle_in_charges(self) -> float:
        return sum(charge.ms for charge in self.charges if charge.cause is None)

    def _blame_idle(self, cause: Cause) -> None:
        self.lost_ms[cause] += self.idle_ms
        self.idle_ms = self.aged_ms = 0.0
        for charge in self.charges:
            if charge.cause is None:
                charge.cause = cause

    def _reclassify(self, cause: Cause, ms: float) -> None:
        moved = min(ms, self.productive_ms)
        self.productive_ms -= moved
        self.lost_ms[cause] += moved

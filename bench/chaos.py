"""Chaos bench: the quickstart job trains under `dlmaster --job-config` while a
seeded scheduler injects faults, one at a time; at the end the record ledger
must be exact, the job must have succeeded, and the bench says how long each
fault took to detect and to recover from, and how much of the wall time went
into training (goodput).

    python bench/chaos.py                      # 10 minutes, a fault every 30-60 s
    python bench/chaos.py --minutes 2 --fault-every 10:20 --seed 7
    python bench/chaos.py --faults 5 --kinds kill-worker,hang-worker --keep

The job: the quickstart's shape (examples/quickstart/job.yaml: nodes 1..2,
starting 2, one process each, DDP on CPU over gloo, rendezvous last call 1 s,
heartbeat 1 s / 10 s), running tests/e2e/scripts/ledger_train.py instead of
the quickstart's train.py, because that script logs which records each rank
trained at each step (its ledger, with a wall-clock stamp per step). As the
examples do, it trains through `dlfleet.elastic.run` (healthy ranks restart
in place, spares take over dead ones) and saves every step in memory with
`dlfleet.Checkpointer` (`--in-memory`); `--checkpoints disk` gives the old
way instead, a torch.save file every 5 steps and cold restarts. Its
ShardedDataLoader feeds the agent's step watchdog and the job's goodput
(dlfleet.worker.progress.step() for every batch; until 2026-11-28 the script
called it after each step as well, which counted every step twice). Each step
sleeps `--sleep-per-step` (0.1 s) and the dataset is sized so that
training without faults lasts about `--minutes` (2 epochs). Generous
limits: max_restarts and max_node_relaunches 1000, relaunch_delay_s 0.5,
step_timeout_s `--step-timeout` (5 s) with a learned bound under it,
step_timeout_factor `--step-timeout-factor` (4; 0: the fixed 5 s only) and
step_timeout_min_s `--step-timeout-min` (0.5; job.yaml's default is 2): a
rank is hung once its progress file is older than 4 x the longest gap
between its writes in the round (written up to ten times a second: with
0.1 s steps the gap is about 0.14 s), at least the floor. On 2026-11-27,
with a Go build loading both cores, a 3-minute run of hangs and kills
(`--kinds hang-worker,kill-worker --fault-every 20:30`) had 3 watchdog calls
for 3 hangs and none other, training resumed 0.63-0.73 s after each SIGSTOP
(2.2-2.6 s with the 2 s floor). The agents' logs say when their watchdogs called a rank
hung: a call that no injected hang came before (within
`HANG_CALL_WINDOW_S`) is a false positive, printed, and fails the run.

The faults (`--kinds`, all by default), each sent by this bench with
os.kill to a process of the job:

* kill-worker: SIGKILL one training process (a child of a node's dlworker).
* kill-agent:  SIGKILL a node's dlworker agent; its workers die with it (the
  parent-death signal) and the supervisor relaunches the node.
* preempt:     SIGTERM a node's agent: it stops its workers, leaves the round
  and exits 0. The supervisor counts that node as finished and does not
  replace it (see "Preemption" below), so once it has exited the bench asks
  for the target again, the Job service's Scale (what `dlmaster scale
  --nodes 2` does), and a fresh node takes its place: a preempted host
  replaced by the cluster.
* kill-master: SIGKILL the master process (status `master_pid`); the
  supervisor starts it again on the same address and store.
* hang-worker: SIGSTOP one training process and leave it stopped: every rank
  then waits in the all-reduce, and the step watchdog (step_timeout_s) must
  notice and restart the workers. The stopped process must be gone afterwards.

The schedule (seeded by `--seed`): kinds are drawn from shuffled bags (every
kind once per bag, in a random order), so that any `len(kinds)` consecutive
faults hold one of each; the victim is a random running node (and a random
training process of it). Fault i+1 is sent `--fault-every MIN:MAX` seconds
(uniform) after fault i, or, for the first, after the first training step;
but never before the job has fully recovered from the previous fault and
trained steadily for `--settle` seconds since (so each fault hits a healthy
job with a recent checkpoint), and never once the dataset is `--stop-at`
(90 %) done (a fault in the last seconds would hit the teardown, not the
training). `--faults N` stops after N faults.

What is observed: the job's status (the Job service's GetStatus, the data of
`dlmaster status --json`, polled every 0.2 s over one gRPC channel rather
than by starting a process each time), and the ledger's lines as they are
written (each: attempt = rendezvous round, world size, step, wall time t).

Per fault, from the moment T0 the signal was sent:

* detect: T0 -> the first status poll that differs from the last one before
  T0 in anything: the round or world size (the master closed the round), a
  node's state, pid or relaunch count (the supervisor saw it exit), the
  master's pid, restart count or reachability, or the last failure report (an
  agent reported a failed or hung worker). Resolution: the poll period.
* resume: T0 -> the first step logged, after T0, by an attempt later than
  the one that was training at T0 (training goes on, at any world size). For
  kill-master, whose nodes keep their workers: T0 -> the first step logged
  after the master answered again.
* full: T0 -> the first step of the full world (2 nodes) after the fault, in
  the round that then stays steady for `--settle` seconds (status: master
  up, 2 running nodes, the world of 2 ranks; ledger: that round is stepping).
  The next fault waits for this.
* stall: the seconds of [T0, T0 + full] in which no rank was in a step
  (bench/_chaos_timeline.py: how the ledger's lines tile time).

The training window runs from the first step's line to the end of the last
step (process start-up before the first step and teardown after the last
are left out). Goodput = the time covered by the steps of the final lineage
(those kept by the model that finished: tests/e2e/ledger.py's rule; steps
rolled back by a restore are lost work) / the training window. A step's time
is the interval to the same rank's next line in the same attempt (one
typical step for the last line of an attempt; an interval over 5 typical
steps counts as one typical step, the rest as stall); ranks overlap, so the
covered time is the union over all ranks. Printed: every fault, the median
and max of detect / resume / full / stall per kind and overall, the ledger
check, the window, stalled time, lost work, and the last line `ratio: X`
with X = goodput, a share in [0, 1] (higher is better; the goal of the
reliability issue is >= 0.80 over 10 minutes with a fault every 30-60 s).

The job's own figure: the master keeps a goodput ledger of its own
(master/dlfleet/master/core/goodput.py: productive step time and time lost by
cause, from the rounds, failures, losses and heartbeats it hears), served in
its /api/v1/status (`goodput`). The bench reads it every `GOODPUT_POLL_S`
from the status's `http_url` and keeps the last reading of each ledger (by
the instant its window opened: a restarted master goes on with the ledger
its journal holds, so a job has one ledger, master kills included), and
prints productive over window beside the external figure, with the
external figure over the ledger's window too (it opens at the first step
the master heard of). The two are
meant to agree within 1 percentage point over the same windows, once time
is counted alike: a step's line spans the save after it, so the step ledger
counts checkpoint blocking as step time, where the job's own ledger calls it
lost (`checkpoint`); the difference is printed both ways. Then, fault by
fault, what each figure lost between the ledger's readings taken just
before one fault and just before the next, over the same window: where the
two part.

The run passes when the job exited 0, the ledger is exactly once (each
epoch's records trained exactly once by the final lineage), every fault was
detected and fully recovered within `--recover-timeout`, and no process of
the job outlived it; the exit code is 0 then, 1 otherwise.

Expect the default run (10 minutes of training, a fault every 30-60 s: about
12 faults) to take about 12 minutes on a 2-core machine; there, on
2026-11-25 with the learned step bound (--step-timeout-factor 4), it measured
12/12 faults recovered, hangs detected in 2.2-2.6 s, 16.7 s of stalls in a
654 s window, goodput 0.973. On 2026-11-27, with progress written up to ten
times a second and the 0.5 s floor: 12/12 recovered, 3 watchdog calls for 3
hangs (none false), training back 0.60-0.64 s after a SIGSTOP, 4.2 s of
stalls in a 643 s window, goodput 0.992; the job's own ledger 0.951 (0.977
with its checkpoint blocking counted as step time).

Preemption: dlworker answers SIGTERM by leaving and exiting 0, which the
supervisor (master/dlfleet/master/job/runner.py) cannot tell from a node whose
training finished: the node becomes `succeeded` and is not replaced, so the
job goes on with fewer nodes (and if every node is preempted, the job ends
"succeeded" with its dataset unfinished). Hence the Scale call above.

Processes: the job runs in its own session with a marker in its environment;
at the end everything carrying the marker is SIGKILLed and the bench checks
that nothing is left. The job's files (job.yaml, logs, ledger, events.jsonl:
every status change seen, with its time) are removed after a passing run
unless `--keep` or `--workdir`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
# This process's gRPC client: no INFO lines from the C core ("Got goaway" when
# the job's control port closes at its end). The job itself keeps its own.
_QUIET_GRPC = "GRPC_VERBOSITY" not in os.environ
if _QUIET_GRPC:
    os.environ["GRPC_VERBOSITY"] = "ERROR"
for _extra in (ROOT / "bench", ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from _chaos_timeline import (  # noqa: E402
    Accounting,
    StepLine,
    account,
    intervals,
    stalled_between,
    union_length,
)
from _common import exit_on_sigterm, say, tagged_pids  # noqa: E402
from e2e.ledger import check, final_lineage, read_ledger  # noqa: E402

from dlfleet.api.client import MasterClient, RetryPolicy  # noqa: E402
from dlfleet.api.errors import DlfleetError  # noqa: E402
from dlfleet.api.v1 import job_pb2  # noqa: E402

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "ledger_train.py"
RANK_NAME = "dlfleet-rank"  # dlfleet.elastic's name for a spare that took over a rank
KINDS = ("kill-worker", "kill-agent", "preempt", "kill-master", "hang-worker")
JOB_NAME = "chaos"
NODES = 2  # the quickstart's nodes.max, and the target throughout
NPROC = 1  # processes per node
POLL_S = 0.2
# How often the master's own goodput ledger is read (its /api/v1/status).
GOODPUT_POLL_S = 1.0
TAG_ENV = "DLFLEET_CHAOS_TAG"
ACTIVE = ("starting", "running", "stopping")
# A step of ledger_train.py beyond its sleep (log line fsynced, all-reduce,
# checkpoint every 5 steps), 2 nodes on a 2-core machine: for sizing only.
STEP_OVERHEAD_S = 0.006
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0
LEFTOVER_S = 5.0  # how long the job's processes may take to go once dlmaster exited


# --------------------------------------------------------------------------- settings


@dataclass
class Settings:
    minutes: float = 10.0  # training without faults, roughly
    seed: int = 0
    fault_every: tuple[float, float] = (30.0, 60.0)
    faults: int | None = None  # at most this many
    kinds: tuple[str, ...] = KINDS
    settle_s: float = 5.0
    sleep_per_step: float = 0.1
    batch: int = 4  # per rank
    epochs: int = 2
    checkpoint_every: int = 5
    # "memory": restart in place and save every step in memory (dlfleet.elastic
    # + Checkpointer, as the examples do); "disk": rank 0 writes a torch.save
    # file every `checkpoint_every` steps and every restart is a cold start.
    checkpoints: str = "memory"
    step_timeout_s: float = 5.0
    step_timeout_factor: float = 4.0  # 0: the fixed bound only
    step_timeout_min_s: float = 0.5  # the learned bound's floor
    last_call_s: float = 1.0
    relaunch_delay_s: float = 0.5
    recover_timeout_s: float = 180.0
    stop_at: float = 0.9
    job_timeout_s: float | None = None  # default: 120 s + 3 x the training time
    workdir: Path | None = None
    keep: bool = False
    quiet: bool = False

    @property
    def size(self) -> int:
        """Records per epoch for about `minutes` of fault-free training."""
        steps = self.minutes * 60.0 / (self.sleep_per_step + STEP_OVERHEAD_S)
        per_step = self.batch * NODES * NPROC
        return max(per_step, math.ceil(steps * per_step / self.epochs))

    @property
    def job_timeout(self) -> float:
        if self.job_timeout_s is not None:
            return self.job_timeout_s
        return 120.0 + 3.0 * self.minutes * 60.0


# --------------------------------------------------------------------------- faults


@dataclass
class Fault:
    index: int
    kind: str
    node: str
    pid: int  # the process signalled
    t: float  # wall clock (time.time()) when the signal was sent
    attempt_before: int  # the round that was training
    first_line: int  # index into the ledger tail's lines at T0
    detected_at: float | None = None
    detect_signal: str = ""
    # When the last status read that showed no change was asked for: the
    # change that detection saw happened after it.
    unchanged_at: float | None = None
    resumed_at: float | None = None
    master_back_at: float | None = None
    scaled_at: float | None = None
    full_at: float | None = None
    full_round: int = 0
    stall_s: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.full_at is not None and self.detected_at is not None

    def since(self, at: float | None) -> float | None:
        return None if at is None else max(0.0, at - self.t)

    @property
    def detect_s(self) -> float | None:
        return self.since(self.detected_at)

    @property
    def resume_s(self) -> float | None:
        return self.since(self.resumed_at)

    @property
    def full_s(self) -> float | None:
        return self.since(self.full_at)

    @property
    def victim(self) -> str:
        what = {"kill-master": "master", "kill-worker": "worker", "hang-worker": "worker"}
        return f"{self.node} {what.get(self.kind, 'agent')} {self.pid}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "victim": self.victim,
            "t": self.t,
            "detect_s": self.detect_s,
            "detect_signal": self.detect_signal,
            "resume_s": self.resume_s,
            "full_s": self.full_s,
            "stall_s": self.stall_s,
            "round_before": self.attempt_before,
            "round_after": self.full_round,
            "ok": self.ok,
            "error": self.error,
        }


class Scheduler:
    """Seeded: which kind next (shuffled bags), how long until it, which victim."""

    def __init__(self, seed: int, kinds: tuple[str, ...], every: tuple[float, float]) -> None:
        self.rng = random.Random(seed)
        self.kinds = kinds
        self.every = every
        self._bag: list[str] = []

    def next_kind(self) -> str:
        if not self._bag:
            self._bag = list(self.kinds)
            self.rng.shuffle(self._bag)
        return self._bag.pop()

    def put_back(self, kind: str) -> None:
        self._bag.append(kind)

    def next_delay(self) -> float:
        return self.rng.uniform(*self.every)

    def pick(self, choices: list[Any]) -> Any:
        return choices[self.rng.randrange(len(choices))]


# --------------------------------------------------------------------------- processes


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError):
            found += [int(c) for c in task.read_text().split()]
    return found


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, T, Z...), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def workers_of(agent_pid: int) -> list[int]:
    """The training processes of a node: its agent's children running the
    script, spares left out (a spare is started with DLFLEET_SPARE=1 and is
    named `dlfleet-rank` once it took over a rank)."""
    return sorted(
        c
        for c in children(agent_pid)
        if str(SCRIPT) in cmdline(c) and (comm(c) == RANK_NAME or not started_as_spare(c))
    )


def started_as_spare(pid: int) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"DLFLEET_SPARE=1" in environ


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# --------------------------------------------------------------------------- observing


class LedgerTail:
    """The ledger's step lines, read as they are written (whole lines only)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self.lines: list[StepLine] = []

    def read(self) -> None:
        if not self.directory.exists():
            return
        for path in sorted(self.directory.glob("ledger-*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                with path.open("rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            self._offsets[path] = offset + len(data)
            complete, _, partial = (self._partial.get(path, b"") + data).rpartition(b"\n")
            self._partial[path] = partial
            for raw in complete.splitlines():
                with suppress(ValueError, KeyError, TypeError):
                    line = json.loads(raw)
                    if "t" in line:
                        self.lines.append(
                            StepLine(
                                attempt=int(line["attempt"]),
                                rank=int(line["rank"]),
                                world=int(line["world"]),
                                step=int(line["step"]),
                                t=float(line["t"]),
                            )
                        )

    def last_attempt(self) -> int:
        return max((line.attempt for line in self.lines[-16:]), default=0)


def signature(status: job_pb2.JobStatus) -> dict[str, str]:
    """What a status says about the job's health, for spotting changes."""
    failure = status.last_failure
    sig = {
        "phase": status.phase,
        "round": str(status.round),
        "world": str(status.world_size),
        "master": f"pid {status.master_pid}, restarts {status.master_restarts}, "
        f"up {status.master_up}",
        "failure": (
            f"{failure.node_id} round {failure.round} rank {failure.global_rank} "
            f"restart {failure.restart_count}"
            if failure.node_id
            else "-"
        ),
    }
    for node in status.nodes:
        sig[node.name] = f"{node.state}, pid {node.pid}, relaunches {node.relaunches}"
    return sig


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    keys = sorted(set(before) | set(after))
    return [
        f"{key}: {before.get(key, '-')} -> {after.get(key, '-')}"
        for key in keys
        if before.get(key) != after.get(key)
    ]


def running_nodes(status: job_pb2.JobStatus) -> list[job_pb2.NodeStatus]:
    return [n for n in status.nodes if n.state == "running" and n.pid > 0]


def healthy(status: job_pb2.JobStatus | None) -> bool:
    """Master up, the target's nodes all running, the full world in a round."""
    if status is None or status.phase != "running" or not status.master_up:
        return False
    active = [n for n in status.nodes if n.state in ACTIVE]
    return (
        len(active) == NODES
        and all(n.state == "running" for n in active)
        and status.round > 0
        and status.world_size == NODES * NPROC
    )


def progress(status: job_pb2.JobStatus | None) -> float:
    if status is None:
        return 0.0
    done = sum(d.records_done for d in status.datasets)
    total = sum(d.records_total for d in status.datasets)
    return done / total if total else 0.0


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Stretch:
    """Between two readings of the job's own ledger (the last before a fault
    and the last before the next, or the end): what each figure lost in the
    same window, in seconds. `own` by cause, checkpoint blocking left out
    (the step ledger counts it as step time)."""

    fault: int  # the fault it starts with (0: the start)
    start: float  # the window, unix seconds
    end: float
    own: dict[str, float]
    external: float

    @property
    def own_lost(self) -> float:
        return sum(self.own.values())


def stretches(
    readings: list[dict[str, Any]], faults: list[Fault], kept: list[Any]
) -> list[Stretch]:
    """Cut the readings at each fault and compare the lost time of the job's
    ledger with the step ledger's over each piece (readings of one ledger
    only: a master that started without its journal opens another)."""
    if not readings:
        return []

    def lost(reading: dict[str, Any]) -> dict[str, float]:
        return {
            item["cause"]: float(item["seconds"])
            for item in reading["badput"]
            if item["cause"] != "checkpoint"
        }

    cuts: list[tuple[int, dict[str, Any]]] = [(0, readings[0])]
    for fault in faults:
        before = [r for r in readings if r["as_of_unix_ms"] / 1000 <= fault.t]
        if before and before[-1] is not cuts[-1][1]:
            cuts.append((fault.index, before[-1]))
    cuts.append((-1, readings[-1]))
    out = []
    for (index, a), (_, b) in itertools.pairwise(cuts):
        if a["opened_unix_ms"] != b["opened_unix_ms"]:
            continue
        lo, hi = a["as_of_unix_ms"] / 1000, b["as_of_unix_ms"] / 1000
        if hi <= lo:
            continue
        la, lb = lost(a), lost(b)
        own = {c: lb.get(c, 0.0) - la.get(c, 0.0) for c in lb}
        own = {c: v for c, v in own.items() if abs(v) >= 0.005}
        out.append(Stretch(index, lo, hi, own, (hi - lo) - union_length(kept, lo, hi)))
    return out


@dataclass
class Result:
    settings: Settings
    faults: list[Fault]
    code: int | None  # dlmaster's exit code; None: it had to be killed
    reason: str
    wall_s: float  # dlmaster started -> exited
    ledger_ok: bool
    ledger_summary: str
    accounting: Accounting
    counted: int
    discarded: int
    attempts: int
    workdir: Path
    observer_cpu_s: float = 0.0  # this bench's own CPU time while it watched
    problems: list[str] = field(default_factory=list)
    # The masters' own ledgers (/api/v1/status `goodput`), each as last read
    # (one per window opened: a restarted master goes on with its journal's), and the external
    # goodput over their windows; None if never read.
    job_ledgers: list[dict[str, Any]] = field(default_factory=list)
    external_in_job_windows: float | None = None
    # The two figures' lost time between faults, over the same windows.
    stretches: list[Stretch] = field(default_factory=list)
    # The step watchdog's calls (wall clock), from the agents' logs, and
    # those no injected hang explains (false positives).
    hang_calls: list[float] = field(default_factory=list)
    false_hangs: list[float] = field(default_factory=list)

    @property
    def job_goodput(self) -> float | None:
        """The job's own figure: productive over window, summed over the
        masters' ledgers."""
        window = sum(g["window_seconds"] for g in self.job_ledgers)
        productive = sum(g["productive_seconds"] for g in self.job_ledgers)
        return productive / window if window > 0 else None

    @property
    def job_goodput_alike(self) -> float | None:
        """The job's own figure with its checkpoint blocking as step time, as
        the step ledger counts it (a step's line spans the save after it, and
        the optimizer step a save's overlapped copy held)."""
        window = sum(g["window_seconds"] for g in self.job_ledgers)
        if window <= 0:
            return None
        productive = sum(g["productive_seconds"] for g in self.job_ledgers)
        blocked = sum(
            item["seconds"]
            for g in self.job_ledgers
            for item in g["badput"]
            if item["cause"] == "checkpoint"
        )
        return float((productive + blocked) / window)

    @property
    def goodput(self) -> float:
        return self.accounting.goodput

    @property
    def ok(self) -> bool:
        return (
            self.code == 0
            and self.ledger_ok
            and all(f.ok for f in self.faults)
            and not self.problems
            and not self.false_hangs
        )

    def as_dict(self) -> dict[str, Any]:
        a = self.accounting
        return {
            "ok": self.ok,
            "code": self.code,
            "reason": self.reason,
            "wall_s": self.wall_s,
            "ledger_ok": self.ledger_ok,
            "ledger": self.ledger_summary,
            "window_s": a.window,
            "useful_s": a.useful,
            "stalled_s": a.stalled,
            "lost_work_s": a.lost_work,
            "typical_step_s": a.typical_step,
            "goodput": a.goodput,
            "counted_lines": self.counted,
            "discarded_lines": self.discarded,
            "attempts": self.attempts,
            "faults": [f.as_dict() for f in self.faults],
            "problems": self.problems,
            "observer_cpu_s": self.observer_cpu_s,
            "job_goodput": self.job_goodput,
            "job_ledgers": self.job_ledgers,
            "external_goodput_in_job_windows": self.external_in_job_windows,
            "hang_calls": self.hang_calls,
            "false_hangs": self.false_hangs,
            "seed": self.settings.seed,
            "minutes": self.settings.minutes,
            "size": self.settings.size,
        }


class ChaosRun:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        base = settings.workdir or Path(tempfile.mkdtemp(prefix="dlfleet-chaos-"))
        base.mkdir(parents=True, exist_ok=True)
        self.dir = base
        self.ledger_dir = base / "ledger"
        self.job_dir = base / ".dlfleet" / JOB_NAME
        self.tag = secrets.token_hex(8)
        self.tail = LedgerTail(self.ledger_dir)
        self.scheduler = Scheduler(settings.seed, settings.kinds, settings.fault_every)
        self.faults: list[Fault] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: MasterClient | None = None
        self.started = 0.0
        self.cpu_at_start = 0.0
        self.problems: list[str] = []
        self._log: IO[bytes] | None = None
        self._events: IO[str] | None = None
        # The loop's state.
        self.pending: Fault | None = None
        self.next_at: float | None = None  # when the next fault is due
        self.steady_since: float | None = None  # healthy, the full world stepping
        self.steady_round = 0
        self.last_sig: dict[str, str] = {}
        self.injecting = True
        self.token = ""
        self.http_url = ""
        # Each master's goodput ledger as last read, by when its window opened.
        self.ledgers: dict[int, dict[str, Any]] = {}
        # Every reading, in order: how the figure moved around each fault.
        self.readings: list[dict[str, Any]] = []
        self._goodput_read_at = 0.0

    # ----------------------------------------------------------- job

    def job_config(self) -> dict[str, Any]:
        s = self.s
        options = {
            "--ledger-dir": self.ledger_dir,
            "--size": s.size,
            "--batch-size": s.batch,
            "--epochs": s.epochs,
            "--sleep-per-step": s.sleep_per_step,
            "--checkpoint-every": s.checkpoint_every,
        }
        flags: list[str] = []
        if s.checkpoints == "memory":
            flags.append("--in-memory")
        return {
            "name": JOB_NAME,
            "nodes": {"min": 1, "max": NODES},
            "nproc_per_node": NPROC,
            "command": str(SCRIPT),
            "args": [str(item) for option in options.items() for item in option] + flags,
            "max_restarts": 1000,
            "max_node_relaunches": 1000,
            "relaunch_delay_s": s.relaunch_delay_s,
            "step_timeout_s": s.step_timeout_s,
            **(
                {
                    "step_timeout_factor": s.step_timeout_factor,
                    "step_timeout_min_s": s.step_timeout_min_s,
                }
                if s.step_timeout_factor
                else {}
            ),
            "rendezvous": {"last_call_timeout_s": s.last_call_s},
            "heartbeat": {"interval_s": 1.0, "timeout_s": 10.0},
            "display": "plain",
        }

    def start(self) -> None:
        config = self.dir / "job.yaml"
        config.write_text(json.dumps(self.job_config(), indent=1))  # JSON is YAML
        self._log = (self.dir / "dlmaster.log").open("wb")
        self._events = (self.dir / "events.jsonl").open("w", encoding="utf-8")
        env = {**os.environ, TAG_ENV: self.tag, "PYTHONUNBUFFERED": "1"}
        if _QUIET_GRPC:
            env.pop("GRPC_VERBOSITY")
        self.started = time.time()
        self.cpu_at_start = _cpu_s()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dlfleet.master", "--job-config", str(config)],
            cwd=self.dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        master_file = self.job_dir / "master.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dlmaster exited with {self.proc.returncode}; {self.log_tail()}"
                )
            with suppress(OSError, ValueError, KeyError):
                address = str(json.loads(master_file.read_text())["address"])
                token = self.token = (self.job_dir / "token").read_text().strip()
                retry = RetryPolicy(attempts=1, max_backoff_s=0.1, total_budget_s=1.0)
                self.client = MasterClient(address, token=token, timeout_s=1.0, retry=retry)
                return
            time.sleep(0.1)
        raise RuntimeError(f"dlmaster did not serve within {START_TIMEOUT_S:g}s; {self.log_tail()}")

    def status(self) -> job_pb2.JobStatus | None:
        assert self.client is not None
        try:
            return self.client.job_status()
        except DlfleetError:
            return None

    def log_tail(self, lines: int = 20) -> str:
        path = self.dir / "dlmaster.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return f"{path}, last lines:\n" + "\n".join(text[-lines:])

    def elapsed(self, at: float | None = None) -> float:
        return (time.time() if at is None else at) - self.started

    def note(self, message: str) -> None:
        if not self.s.quiet:
            say(f"[{self.elapsed():7.1f}s] {message}")

    def event(self, at: float, what: str, data: Any) -> None:
        if self._events is not None:
            self._events.write(json.dumps({"t": at, "elapsed": at - self.started, what: data}))
            self._events.write("\n")
            self._events.flush()

    # ----------------------------------------------------------- loop

    def run(self) -> Result:
        self.start()
        assert self.proc is not None
        deadline = self.started + self.s.job_timeout
        while self.proc.poll() is None:
            tick = time.time()
            if tick > deadline:
                self.problems.append(f"the job did not end within {self.s.job_timeout:.0f}s")
                break
            self._tick()
            time.sleep(max(0.0, POLL_S - (time.time() - tick)))
        if self.pending is not None and not self.pending.error:
            self.pending.error = "the job ended before it recovered"
            self._release(self.pending)
        return self._finish()

    def _tick(self) -> None:
        asked = time.time()
        status = self.status()
        now = time.time()
        self.tail.read()
        sig = signature(status) if status is not None else self.last_sig
        moved = changes(self.last_sig, sig) if self.last_sig else []
        if moved:
            self.event(now, "status", moved)
        self._watch_steady(status, now)
        if status is not None and status.http_url:
            self.http_url = status.http_url
        if now - self._goodput_read_at >= GOODPUT_POLL_S:
            self._goodput_read_at = now
            self._read_job_goodput()
        if self.pending is not None:
            self._check(self.pending, status, now, moved, asked)
        elif self.injecting and status is not None:
            self._maybe_inject(status, now)  # detection compares with `sig`
        self.last_sig = sig

    def _read_job_goodput(self) -> None:
        """The master's own goodput ledger, kept once it has a window: the
        last one read of each master (a master's is gone with it)."""
        if not self.http_url:
            return
        request = urllib.request.Request(
            f"{self.http_url}/api/v1/status", headers={"Authorization": f"Bearer {self.token}"}
        )
        with suppress(OSError, ValueError, urllib.error.URLError):
            with urllib.request.urlopen(request, timeout=0.5) as answer:
                goodput = json.loads(answer.read()).get("goodput")
            if goodput and goodput.get("window_seconds", 0) > 0:
                self.ledgers[int(goodput["opened_unix_ms"])] = goodput
                self.readings.append(goodput)

    def _after(self) -> float:
        """Steps that count for recovery are logged after this time."""
        fault = self.pending
        if fault is None:
            return 0.0
        if fault.kind == "kill-master":
            return fault.master_back_at or math.inf
        return fault.t

    def _watch_steady(self, status: job_pb2.JobStatus | None, now: float) -> None:
        """Steady: healthy, and the status round's full world has stepped
        since the pending fault (or since the start)."""
        if status is not None and healthy(status) and self._steps_in(status.round, self._after()):
            if self.steady_since is None or self.steady_round != status.round:
                self.steady_since, self.steady_round = now, int(status.round)
        else:
            self.steady_since = None

    def _settled(self, now: float) -> bool:
        return self.steady_since is not None and now - self.steady_since >= self.s.settle_s

    def _check(
        self,
        fault: Fault,
        status: job_pb2.JobStatus | None,
        now: float,
        moved: list[str],
        asked: float,
    ) -> None:
        if fault.detected_at is None:
            if moved:
                fault.detected_at = now
                fault.detect_signal = "; ".join(moved)
            elif status is not None:
                fault.unchanged_at = asked
        self._follow(fault, status)
        new_round = fault.kind == "kill-master" or self.steady_round > fault.attempt_before
        if self._settled(now) and new_round:
            self._recovered(fault, self.steady_round, self._after())
            self.next_at = fault.t + self.scheduler.next_delay()
            self.pending = None
        elif now - fault.t > self.s.recover_timeout_s:
            fault.error = f"not recovered within {self.s.recover_timeout_s:.0f}s"
            self._release(fault)
            self.note(f"fault {fault.index}: {fault.error}")
            self.pending, self.injecting = None, False

    def _maybe_inject(self, status: job_pb2.JobStatus, now: float) -> None:
        if self.next_at is None and self.tail.lines:
            first_step = min(line.t for line in self.tail.lines)
            self.next_at = first_step + self.scheduler.next_delay()
        if self.s.faults is not None and len(self.faults) >= self.s.faults:
            self.injecting = False
        elif progress(status) >= self.s.stop_at:
            self.injecting = False
            self.note(f"{progress(status):.0%} of the data trained: no more faults")
        elif self.next_at is not None and now >= self.next_at and self._settled(now):
            self.pending = self._inject(status)

    def _steps_in(self, round_: int, after: float) -> bool:
        """Has round `round_`'s full world logged a step after `after`?"""
        for line in reversed(self.tail.lines[-64:]):
            if line.attempt == round_ and line.world == NODES * NPROC and line.t > after:
                return True
        return False

    def _inject(self, status: job_pb2.JobStatus) -> Fault | None:
        kind = self.scheduler.next_kind()
        nodes = sorted(running_nodes(status), key=lambda n: n.name)
        node = self.scheduler.pick(nodes)
        name, pid, sig = str(node.name), int(node.pid), signal.SIGKILL
        if kind == "kill-master":
            name, pid = "master", int(status.master_pid)
        elif kind in ("kill-worker", "hang-worker"):
            workers = workers_of(pid)
            if not workers:  # between two of its processes: try again at the next poll
                self.scheduler.put_back(kind)
                return None
            pid = self.scheduler.pick(workers)
            sig = signal.SIGSTOP if kind == "hang-worker" else signal.SIGKILL
        elif kind == "preempt":
            sig = signal.SIGTERM
        fault = Fault(
            index=len(self.faults) + 1,
            kind=kind,
            node=name,
            pid=pid,
            t=time.time(),
            attempt_before=max(int(status.round), self.tail.last_attempt()),
            first_line=len(self.tail.lines),
        )
        os.kill(pid, sig)
        self.faults.append(fault)
        self.event(fault.t, "fault", fault.as_dict())
        self.note(f"fault {fault.index}: {kind} ({signal.Signals(sig).name} {fault.victim})")
        return fault

    def _follow(self, fault: Fault, status: job_pb2.JobStatus | None) -> None:
        """Bookkeeping while a fault is pending: resume, master back, scale."""
        now = time.time()
        if (
            fault.kind == "kill-master"
            and fault.master_back_at is None
            and status is not None
            and status.master_up
            and status.master_pid != fault.pid
        ):
            fault.master_back_at = now
        if fault.resumed_at is None:
            for line in self.tail.lines[fault.first_line :]:
                if fault.kind == "kill-master":
                    good = fault.master_back_at is not None and line.t >= fault.master_back_at
                else:
                    good = line.attempt > fault.attempt_before and line.t > fault.t
                if good and (fault.resumed_at is None or line.t < fault.resumed_at):
                    fault.resumed_at = line.t
        if fault.kind == "preempt" and fault.scaled_at is None and status is not None:
            node = next((n for n in status.nodes if n.name == fault.node), None)
            active = [n for n in status.nodes if n.state in ACTIVE]
            if node is not None and node.state not in ACTIVE:
                if len(active) < NODES:
                    assert self.client is not None
                    try:
                        self.client.scale(NODES)
                    except DlfleetError as error:
                        self.note(f"scale to {NODES} failed ({error}); trying again")
                        return
                    self.note(f"{fault.node} left ({node.state}): asked for {NODES} nodes again")
                fault.scaled_at = now

    def _recovered(self, fault: Fault, round_: int, after: float) -> None:
        full = [
            line.t
            for line in self.tail.lines[fault.first_line :]
            if line.attempt == round_ and line.world == NODES * NPROC and line.t > after
        ]
        fault.full_round = round_
        fault.full_at = min(full) if full else time.time()
        if fault.detected_at is None:
            fault.error = "recovered, but no status change was ever seen"
        self._release(fault)
        self.note(
            f"fault {fault.index}: detected after {_fmt(fault.detect_s)}s "
            f"({fault.detect_signal.split(';')[0] or '-'}), training resumed after "
            f"{_fmt(fault.resume_s)}s, full world after {_fmt(fault.full_s)}s "
            f"(round {fault.attempt_before} -> {round_})"
        )

    def _release(self, fault: Fault) -> None:
        """A stopped worker must be gone once its fault is over."""
        if fault.kind != "hang-worker":
            return
        state = process_state(fault.pid)
        if state is not None and state != "Z":
            message = f"the stopped worker {fault.pid} is still there (state {state})"
            fault.error = f"{fault.error}; {message}" if fault.error else message
            with suppress(ProcessLookupError):
                os.kill(fault.pid, signal.SIGKILL)

    # ----------------------------------------------------------- the end

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE_S)
        for pid in tagged_pids(TAG_ENV, self.tag):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self.client is not None:
            self.client.close()
        for stream in (self._log, self._events):
            if stream is not None:
                stream.close()

    def _finish(self) -> Result:
        assert self.proc is not None
        code = self.proc.poll()
        wall_s = self.elapsed()
        if code is None:
            self.stop()
        else:
            # The supervisor's children get SIGKILL as it exits (parent-death signal).
            left = tagged_pids(TAG_ENV, self.tag)
            deadline = time.monotonic() + LEFTOVER_S
            while left and time.monotonic() < deadline:
                time.sleep(0.2)
                left = tagged_pids(TAG_ENV, self.tag)
            if left:
                described = ", ".join(f"{p} ({cmdline(p)[:60]})" for p in left)
                self.problems.append(f"processes outlived the job: {described}")
            self.stop()
        reason = ""
        with suppress(OSError, ValueError):
            reason = str(json.loads((self.job_dir / "result.json").read_text())["reason"])
        if code not in (0, None) and not reason:
            reason = self.log_tail(5)
        s = self.s
        report = check(self.ledger_dir, size=s.size, epochs=s.epochs)
        entries, restores, _ = read_ledger(self.ledger_dir)
        counted, discarded = final_lineage(entries, restores)
        kept = {(e.attempt, e.rank, e.step) for e in counted}
        lines = [
            StepLine(e.attempt, e.rank, e.world, e.step, e.t, (e.attempt, e.rank, e.step) in kept)
            for e in entries
            if e.t is not None
        ]
        accounting = account(lines)
        spans = intervals(lines, accounting.typical_step)
        for fault in self.faults:
            if fault.full_at is not None:
                fault.stall_s = stalled_between(spans, fault.t, fault.full_at)
        ledgers = [self.ledgers[opened] for opened in sorted(self.ledgers)]
        kept_spans = [span for span in spans if span.counted]
        useful_in, window_in = 0.0, 0.0
        for ledger in ledgers:
            lo = max(ledger["opened_unix_ms"] / 1000, accounting.start)
            hi = min(ledger["as_of_unix_ms"] / 1000, accounting.end)
            if hi > lo:
                useful_in += union_length(kept_spans, lo, hi)
                window_in += hi - lo
        return Result(
            stretches=stretches(self.readings, self.faults, kept_spans),
            settings=s,
            faults=self.faults,
            code=code,
            reason=reason,
            wall_s=wall_s,
            ledger_ok=report.ok,
            ledger_summary=report.summary(),
            accounting=accounting,
            counted=len(counted),
            discarded=len(discarded),
            attempts=len(report.attempts),
            workdir=self.dir,
            observer_cpu_s=_cpu_s() - self.cpu_at_start,
            problems=self.problems,
            job_ledgers=ledgers,
            external_in_job_windows=useful_in / window_in if window_in > 0 else None,
            hang_calls=(calls := watchdog_calls(self.job_dir / "logs")),
            false_hangs=unexplained(calls, self.faults),
        )


# An agent's log line (its logging format) where its step watchdog calls a
# rank hung.
HANG_CALL = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) dlworker ERROR local rank \d+ hung: "
)
# How long after a hang is injected the watchdog's calls are its (every
# node's ranks stop in the all-reduce it waits in: each agent may call it).
HANG_CALL_WINDOW_S = 30.0


def watchdog_calls(log_dir: Path) -> list[float]:
    """When (time.time()) the agents' step watchdogs called a rank hung."""
    calls = []
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = HANG_CALL.match(line)
            if match:
                stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
                calls.append(stamp + int(match.group(2)) / 1000)
    return sorted(calls)


def unexplained(calls: list[float], faults: list[Fault]) -> list[float]:
    """The watchdog calls that no injected hang came before (within
    HANG_CALL_WINDOW_S): false positives."""
    hangs = [f.t for f in faults if f.kind == "hang-worker"]
    return [call for call in calls if not any(0 <= call - t <= HANG_CALL_WINDOW_S for t in hangs)]


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def run(settings: Settings) -> Result:
    """One chaos run; every process of the job is gone when it returns."""
    chaos = ChaosRun(settings)
    try:
        result = chaos.run()
    finally:
        chaos.stop()
    if result.ok and not settings.keep and settings.workdir is None:
        shutil.rmtree(chaos.dir, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _med_max(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    return f"{statistics.median(present):.2f} / {max(present):.2f}"


def report(result: Result) -> None:
    s = result.settings
    faults = result.faults
    say()
    say(
        f"{'#':>3s} {'at s':>7s}  {'kind':11s} {'victim':24s} {'detect':>7s} {'resume':>7s} "
        f"{'full':>7s} {'stall':>7s}  rounds  first signal"
    )
    for f in faults:
        first = f.detect_signal.split(";")[0] if f.detect_signal else "-"
        say(
            f"{f.index:>3d} {f.t - (result.accounting.start or f.t):>7.1f}  {f.kind:11s} "
            f"{f.victim:24s} {_fmt(f.detect_s):>7s} {_fmt(f.resume_s):>7s} "
            f"{_fmt(f.full_s):>7s} {_fmt(f.stall_s):>7s}  "
            f"{f.attempt_before:>2d}->{f.full_round:<3d} "
            f"{first}{'  ERROR: ' + f.error if f.error else ''}"
        )
    say("(at: seconds after the first step; detect / resume / full / stall in seconds, see the")
    say(" module docstring; rounds: the round training at the fault -> the steady round after)")
    say()
    say(
        f"{'kind':11s} {'faults':>6s} {'recovered':>9s}  {'detect med/max':>15s} "
        f"{'resume med/max':>15s} {'full med/max':>15s} {'stall med/max':>15s}"
    )
    for kind in [*s.kinds, "all"]:
        these = [f for f in faults if kind in ("all", f.kind)]
        if not these:
            continue
        say(
            f"{kind:11s} {len(these):>6d} {sum(f.ok for f in these):>9d}  "
            f"{_med_max([f.detect_s for f in these]):>15s} "
            f"{_med_max([f.resume_s for f in these]):>15s} "
            f"{_med_max([f.full_s for f in these]):>15s} "
            f"{_med_max([f.stall_s for f in these]):>15s}"
        )
    a = result.accounting
    say()
    outcome = "succeeded" if result.code == 0 else f"FAILED (exit {result.code})"
    why = f": {result.reason}" if result.reason and result.code != 0 else ""
    say(f"job: {outcome} after {result.wall_s:.1f}s wall{why}")
    say(result.ledger_summary)
    say(
        f"training window {a.window:.1f}s (first step -> end of the last), typical step "
        f"{a.typical_step * 1000:.0f} ms; steps of the final lineage {a.useful:.1f}s, "
        f"stalled {a.stalled:.1f}s, lost work (rolled back) {a.lost_work:.1f}s; "
        f"{result.counted} step lines kept, {result.discarded} rolled back, "
        f"{result.attempts} attempts; this bench used {result.observer_cpu_s:.1f}s of CPU "
        f"watching"
    )
    say_job_goodput(result)
    say_stretches(result)
    hangs = [f for f in faults if f.kind == "hang-worker"]
    say(
        f"step watchdog: {len(result.hang_calls)} calls for {len(hangs)} hangs injected, "
        f"{len(result.false_hangs)} false (a call no injected hang explains); hangs detected "
        f"in {_med_max([f.detect_s for f in hangs]).strip() or '-'} s (median/max), bound "
        f"{result.settings.step_timeout_factor:g} x the longest gap between progress writes, "
        f"at least {result.settings.step_timeout_min_s:g} s"
    )
    for problem in result.problems:
        say(f"problem: {problem}")
    recovered = sum(f.ok for f in faults)
    verdict = "PASS" if result.ok else "FAIL"
    say(
        f"{verdict}: {len(faults)} faults, {recovered} recovered; job "
        f"{'succeeded' if result.code == 0 else 'failed'}; ledger "
        f"{'exactly once' if result.ledger_ok else 'WRONG'}; goodput {a.goodput:.1%} "
        f"(useful step time / training window)"
    )
    if not result.ok:
        say(f"(logs kept in {result.workdir})")
    say(f"ratio: {a.goodput:.3f}")


def say_stretches(result: Result) -> None:
    """Where the two figures part: each fault's stretch, both lost times."""
    if not result.stretches:
        return
    kinds = {f.index: f.kind for f in result.faults}
    say("lost between faults, the job's own (checkpoint blocking left out) vs external, s:")
    for st in result.stretches:
        causes = ", ".join(f"{c} {v:.2f}" for c, v in sorted(st.own.items()))
        say(
            f"  {st.fault:>3d} {kinds.get(st.fault, 'start'):11s} {st.end - st.start:6.1f}s  "
            f"own {st.own_lost:5.2f}  external {st.external:5.2f}  "
            f"({causes or 'nothing'})"
        )


def say_job_goodput(result: Result) -> None:
    """The masters' own goodput beside the external one, over the whole
    window and over the ledgers' windows (one ledger, unless a master
    started without its journal)."""
    ledgers, a, own = result.job_ledgers, result.accounting, result.job_goodput
    if own is None:
        say("the job's own goodput: never read (no /api/v1/status with a goodput window)")
        return
    lost: dict[str, float] = {}
    for ledger in ledgers:
        for item in ledger["badput"]:
            lost[item["cause"]] = lost.get(item["cause"], 0.0) + item["seconds"]
    causes = ", ".join(
        f"{cause} {seconds:.1f}s" for cause, seconds in lost.items() if seconds >= 0.05
    )
    windows = " + ".join(f"{ledger['window_seconds']:.1f}s" for ledger in ledgers)
    say(
        f"the job's own goodput (its masters' ledgers): {own:.3f} over {windows}, "
        f"productive {sum(g['productive_seconds'] for g in ledgers):.1f}s, lost: "
        f"{causes or 'nothing'}"
    )
    same = result.external_in_job_windows
    beside = f", {same:.3f} over the ledgers' windows" if same is not None else ""
    differs = ""
    if same is not None:
        # A step's line spans the save after it: the step ledger counts the
        # time a save blocked as step time, where the job's own calls it lost.
        alike = result.job_goodput_alike or 0.0
        differs = (
            f"; the job's own - external: {100 * (own - same):+.1f} pp, "
            f"{100 * (alike - same):+.1f} pp with its checkpoint blocking as step time "
            f"({alike:.3f}), as the step ledger counts it"
        )
    say(
        f"external goodput (the step ledger): {a.goodput:.3f} over {a.window:.1f}s{beside}{differs}"
    )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> tuple[Settings, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0, help="fault-free training time (10)")
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed (0)")
    parser.add_argument(
        "--fault-every", default="30:60", help="MIN:MAX seconds between faults (30:60)"
    )
    parser.add_argument("--faults", type=int, default=None, help="at most this many faults")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    parser.add_argument("--settle", type=float, default=5.0, help="steady seconds before a fault")
    parser.add_argument("--sleep-per-step", type=float, default=0.1, help="seconds (0.1)")
    parser.add_argument("--step-timeout", type=float, default=5.0, help="watchdog seconds (5)")
    parser.add_argument(
        "--step-timeout-factor",
        type=float,
        default=4.0,
        help="learned watchdog: x the longest gap between progress writes (4; 0: off)",
    )
    parser.add_argument(
        "--step-timeout-min",
        type=float,
        default=0.5,
        help="the learned watchdog bound's floor, seconds (0.5)",
    )
    parser.add_argument("--last-call", type=float, default=1.0, help="rendezvous last call (1)")
    parser.add_argument(
        "--recover-timeout", type=float, default=180.0, help="seconds to recover a fault (180)"
    )
    parser.add_argument("--stop-at", type=float, default=0.9, help="no faults past this progress")
    parser.add_argument(
        "--checkpoints",
        choices=("memory", "disk"),
        default="memory",
        help="memory: in-place restarts and a save every step in memory (the default); "
        "disk: a torch.save file every 5 steps and cold restarts (before dlfleet.elastic)",
    )
    parser.add_argument("--workdir", type=Path, help="keep the job's files here")
    parser.add_argument("--keep", action="store_true", help="keep the job's files")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no line per fault while running")
    args = parser.parse_args(argv)
    low, sep, high = args.fault_every.partition(":")
    try:
        every = (float(low), float(high if sep else low))
    except ValueError:
        parser.error("--fault-every wants MIN:MAX seconds")
    if not 0 < every[0] <= every[1]:
        parser.error("--fault-every wants 0 < MIN <= MAX")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--kinds wants some of {', '.join(KINDS)}")
    if args.minutes <= 0 or args.sleep_per_step < 0 or args.step_timeout <= 0:
        parser.error("--minutes and --step-timeout must be positive, --sleep-per-step not negative")
    if args.step_timeout_factor != 0 and not args.step_timeout_factor >= 2:
        parser.error("--step-timeout-factor wants 0 (off) or >= 2")
    if args.step_timeout_factor and not 0 < args.step_timeout_min <= args.step_timeout:
        parser.error("--step-timeout-min must be > 0 and at most --step-timeout")
    settings = Settings(
        checkpoints=args.checkpoints,
        minutes=args.minutes,
        seed=args.seed,
        fault_every=every,
        faults=args.faults,
        kinds=kinds,
        settle_s=args.settle,
        sleep_per_step=args.sleep_per_step,
        step_timeout_s=args.step_timeout,
        step_timeout_factor=args.step_timeout_factor,
        step_timeout_min_s=args.step_timeout_min,
        last_call_s=args.last_call,
        recover_timeout_s=args.recover_timeout,
        stop_at=args.stop_at,
        workdir=args.workdir,
        keep=args.keep,
        quiet=args.quiet,
    )
    return settings, args.json


def main(argv: list[str] | None = None) -> int:
    settings, json_path = parse_args(argv)
    exit_on_sigterm()
    say(
        f"chaos: seed {settings.seed}, about {settings.minutes:g} min of training "
        f"({settings.size} records x {settings.epochs} epochs, {NODES} nodes x {NPROC} process, "
        f"{settings.sleep_per_step:g}s per step), a fault every {settings.fault_every[0]:g}-"
        f"{settings.fault_every[1]:g}s of {', '.join(settings.kinds)}"
    )
    result = run(settings)
    report(result)
    if json_path is not None:
        json_path.write_text(json.dumps(result.as_dict(), indent=1))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())

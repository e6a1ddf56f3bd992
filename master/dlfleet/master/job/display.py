"""What a running job shows in the terminal.

`LiveDisplay` (a TTY): the nodes' output scrolls as usual, and a status block
stays at the bottom, redrawn in place (round, nodes, shards done/total per
dataset, samples/s, ETA and the goodput the master accounts for, in-memory
checkpoints, last failure). `PlainDisplay`
(a pipe, a CI log): the same output lines, and the status as one plain log
line every `every_s` seconds. Both take lines from several threads (node output readers, logging),
so writes are serialised by a lock.

Lives in the job supervisor process; `dlmaster status` (`control.py`) prints
the status with `status_lines` too.
"""

from __future__ import annotations

import abc
import logging
import shutil
import sys
import threading
import time
from typing import TextIO

from dlfleet.api.job_phase import JobPhase
from dlfleet.api.node_state import NodeState
from dlfleet.api.v1 import checkpoint_pb2, job_pb2


def format_duration(seconds: float) -> str:
    if seconds < 0:
        return "?"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def format_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def checkpoint_line(checkpoints: checkpoint_pb2.CheckpointStatus) -> str | None:
    """One line on the in-memory checkpoints, or None while there is none."""
    parts = []
    if checkpoints.restorable_step >= 0:
        held = format_bytes(checkpoints.bytes_held)
        replicated = checkpoints.replicated_step
        safe = f", step {replicated} on two nodes" if replicated >= 0 else ""
        parts.append(f"step {checkpoints.restorable_step} in memory ({held} held{safe})")
    elif checkpoints.committed_step >= 0:
        parts.append(f"step {checkpoints.committed_step} saved, no complete copy left in memory")
    if checkpoints.persisted_step >= 0:
        parts.append(f"persisted step {checkpoints.persisted_step}")
    return "checkpoints: " + ", ".join(parts) if parts else None


def goodput_text(goodput: job_pb2.Goodput) -> str | None:
    """The job's goodput and its two largest causes of lost time, for the
    pace line; None before the first step."""
    if goodput.window_seconds <= 0:
        return None
    lost = sorted(
        (item for item in goodput.badput if item.seconds >= 0.05), key=lambda b: -b.seconds
    )
    causes = ", ".join(
        f"{item.cause} "
        + (f"{item.seconds:.1f}s" if item.seconds < 60 else format_duration(item.seconds))
        for item in lost[:2]
    )
    return f"goodput {100 * goodput.ratio:.1f}%" + (f" (lost: {causes})" if causes else "")


def status_lines(status: job_pb2.JobStatus) -> list[str]:
    """The status block: a few short lines, the same on a TTY and in a log."""
    states: dict[str, int] = {}
    for node in status.nodes:
        states[node.state] = states.get(node.state, 0) + 1
    nodes = ", ".join(f"{count} {state}" for state, count in sorted(states.items())) or "none"
    lines = [
        f"job {status.job_name}: {status.phase} | round {status.round or '-'} "
        f"| world {status.world_size} | nodes {nodes} (target {status.target_nodes})"
    ]
    for ds in status.datasets:
        percent = 100.0 * ds.records_done / ds.records_total if ds.records_total else 100.0
        failed = f" | {ds.failed_shards} FAILED shards" if ds.failed_shards else ""
        lines.append(
            f"  {ds.name}: epoch {min(ds.epoch + 1, ds.epochs)}/{ds.epochs} "
            f"| {ds.records_done}/{ds.records_total} records ({percent:.1f}%){failed}"
        )
    if (
        status.phase == JobPhase.RUNNING.value
    ):  # an ended job has no pace, and nothing left to wait for
        eta = format_duration(status.eta_seconds)
        goodput = goodput_text(status.goodput) if status.HasField("goodput") else None
        pace = f"  {status.samples_per_second:.1f} samples/s | ETA {eta}"
        lines.append(pace + (f" | {goodput}" if goodput else ""))
    for node in status.nodes:
        if node.detail and node.state == NodeState.STARTING.value:
            lines.append(f"  {node.name}: {node.detail[:140]}")
        elif node.HasField("metrics") and node.state == NodeState.RUNNING.value:
            m = node.metrics
            # Before its first step a node has no pace to show (not a pace of 0).
            pace = (
                f"{m.samples_per_second:.1f} samples/s | step {m.step_time_ms:.0f} ms"
                if m.steps
                else "no step yet"
            )
            lines.append(
                f"  {node.name}: {pace} | cpu {m.cpu_percent:.0f}% | rss {m.rss_bytes >> 20} MiB"
            )
        elif node.state == NodeState.FAULTY.value and node.check.faulty:
            check = node.check
            lines.append(f"  {node.name}: node check {check.rule}: {check.reason[:140]}")
    checkpoints = checkpoint_line(status.checkpoints) if status.HasField("checkpoints") else None
    if checkpoints is not None:
        lines.append(f"  {checkpoints}")
    if status.last_plan:
        lines.append(f"  brain: {status.last_plan[:160]}")
    if status.HasField("last_failure"):
        failure = status.last_failure
        message = failure.message.strip().splitlines()
        how = failure.signal or f"exit {failure.exit_code}"
        if failure.rule:
            # A verdict of restart with no restart left ended the node.
            spent = failure.action == "restart" and not failure.restarting
            action = "not restarted, restarts spent" if spent else failure.action
            how += f"; {failure.category}, rule {failure.rule}: {action}"
        lines.append(
            f"  last failure: {failure.node_id} rank {failure.global_rank} ({how})"
            + (f": {message[-1][:120]}" if message else "")
        )
    return lines


class Display(abc.ABC):
    """Where output lines and status updates go."""

    @abc.abstractmethod
    def line(self, source: str, text: str) -> None: ...

    @abc.abstractmethod
    def update(self, status: job_pb2.JobStatus) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional: most displays hold nothing
        """Flush what is left."""


class NoDisplay(Display):
    """`display: off`: the job runs silently (its nodes still log to files)."""

    def line(self, source: str, text: str) -> None:
        return None

    def update(self, status: job_pb2.JobStatus) -> None:
        return None


class PlainDisplay(Display):
    def __init__(self, out: TextIO = sys.stdout, every_s: float = 10.0) -> None:
        self.out = out
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = 0.0
        self._phase = ""

    def line(self, source: str, text: str) -> None:
        with self._lock:
            self.out.write(f"[{source}] {text}\n")
            self.out.flush()

    def update(self, status: job_pb2.JobStatus) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s and status.phase == self._phase:
            return
        self._last, self._phase = now, status.phase
        with self._lock:
            self.out.write("[dlmaster] " + " ".join(s.strip() for s in status_lines(status)) + "\n")
            self.out.flush()


class LiveDisplay(Display):
    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self._lock = threading.Lock()
        self._block: list[str] = []

    def line(self, source: str, text: str) -> None:
        with self._lock:
            self._erase()
            self.out.write(f"[{source}] {text}\n")
            self._draw()

    def update(self, status: job_pb2.JobStatus) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        block = [line[: width - 1] for line in status_lines(status)]
        with self._lock:
            self._erase()
            self._block = block
            self._draw()

    def close(self) -> None:
        with self._lock:  # the last block stays on screen, above what follows
            self.out.flush()
            self._block = []

    def _erase(self) -> None:
        for _ in self._block:
            self.out.write("\x1b[1A\x1b[2K")  # cursor up one line, clear it

    def _draw(self) -> None:
        style = "\x1b[1m"  # bold
        for line in self._block:
            self.out.write(f"{style}{line}\x1b[0m\n")
        self.out.flush()


def choose_display(mode: str, out: TextIO = sys.stdout) -> Display:
    if mode == "off":
        return NoDisplay()
    if mode == "live" or (mode == "auto" and out.isatty()):
        return LiveDisplay(out)
    return PlainDisplay(out)


class DisplayLogHandler(logging.Handler):
    """The master's own log lines, through the display (so that a live
    status block is not torn apart by them)."""

    def __init__(self, display: Display) -> None:
        super().__init__()
        self.display = display

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.display.line("dlmaster", self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)

"""What a node measures of its training processes, for its heartbeats.

CPU time and resident memory come from /proc for each worker process and its
descendants (DataLoader workers included); step and sample counts from the
workers' progress files (`dlfleet.worker.progress`), with local rank 0's
checkpoint blocking, training step and the age of its counts for the
master's goodput ledger; the memory limit from the
node's cgroup. CPU is over the time since the last sample; steps and samples
over the time between the progress files' writes (`rank_rates`), which is
when they were counted. Linux only: elsewhere the /proc parts read as zero.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from dlfleet.api.v1 import rendezvous_pb2
from dlfleet.worker.progress import Counts, read_counts

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_NO_LIMIT = 1 << 60  # cgroup v1 "unlimited" is a huge number


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (via /proc/<pid>/task/*/children)."""
    found: list[int] = []
    todo = [pid]
    while todo and len(found) < 4096:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in task.read_text().split())
            except (OSError, ValueError):
                continue
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime
    except (OSError, ValueError, IndexError):
        return 0.0


def _rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def rank_rates(before: Counts, after: Counts, elapsed: float) -> tuple[float, float] | None:
    """(steps/s, samples/s) of one rank between two reads of its progress
    file `elapsed` seconds apart; None when there is nothing to measure (a
    new process, or the start-up before the first step)."""
    if after.steps < before.steps:
        return None  # another process: its counts start again
    if after.at is None or before.at is None:  # a file without times
        span = elapsed
    elif after.at <= before.at:
        return 0.0, 0.0  # no step written since the last read
    elif before.steps == 0:
        return None  # from "no step yet" to the first steps: start-up, not pace
    else:
        span = after.at - before.at
    return (after.steps - before.steps) / span, (after.samples - before.samples) / span


def memory_limit_bytes() -> int:
    """This node's cgroup memory limit (v2, else v1); 0 if none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return 0
        try:
            value = int(text)
        except ValueError:
            continue
        return 0 if value >= _NO_LIMIT else value
    return 0


class NodeSampler:
    """Samples the training processes of one worker group."""

    def __init__(self, progress_dir: Path, pids: Sequence[int]) -> None:
        self.progress_dir = progress_dir
        self.pids = list(pids)
        self.peak_rss = 0
        # The most steps a rank reported (None: none reported any), for the
        # diagnosis of a failure before the first step; carried over by the agent.
        self.most_steps: int | None = None
        self.limit = memory_limit_bytes()
        self._at = time.monotonic()
        self._cpu = self._cpu_total()
        self._counts = self._read_counts()

    def read_steps(self) -> int | None:
        """Read the progress files again (at a failure) and return `most_steps`."""
        self._note_steps(self._read_counts())
        return self.most_steps

    def _note_steps(self, counts: Sequence[Counts | None]) -> None:
        for count in counts:
            if count is not None:
                self.most_steps = max(self.most_steps or 0, count[0])

    def _cpu_total(self) -> dict[int, float]:
        return {pid: _cpu_seconds(pid) for root in self.pids for pid in descendants(root)}

    def _read_counts(self) -> list[Counts | None]:
        return [read_counts(str(self.progress_dir / str(rank))) for rank in range(len(self.pids))]

    def sample(self) -> rendezvous_pb2.NodeMetrics:
        now = time.monotonic()
        elapsed = max(now - self._at, 1e-6)
        cpu = self._cpu_total()
        # Processes that ended since the last sample drop out of both sides.
        used = sum(seconds - self._cpu.get(pid, seconds) for pid, seconds in cpu.items())
        rss = sum(_rss_bytes(pid) for pid in cpu)
        self.peak_rss = max(self.peak_rss, rss)
        counts = self._read_counts()
        read_at = time.monotonic()  # a write during the /proc walk is younger than `now`
        self._note_steps(counts)
        step_rates, samples, step_times = [], 0.0, []
        for before, after in zip(self._counts, counts, strict=True):
            rates = rank_rates(before, after, elapsed) if before and after else None
            if rates is None:
                continue
            step_rates.append(rates[0])
            samples += rates[1]
            if rates[0] > 0:
                step_times.append(1000 / rates[0])
        first = counts[0] if counts else None

        def age(at: float | None) -> float:
            """How long before the read rank 0's file says `at` was (0: not said)."""
            return max(0.0, read_at - at) if at else 0.0

        metrics = rendezvous_pb2.NodeMetrics(
            cpu_percent=100.0 * max(0.0, used) / elapsed,
            rss_bytes=rss,
            peak_rss_bytes=self.peak_rss,
            memory_limit_bytes=self.limit,
            steps_per_second=sum(step_rates) / len(step_rates) if step_rates else 0.0,
            samples_per_second=samples,
            step_time_ms=sum(step_times) / len(step_times) if step_times else 0.0,
            steps=first.steps if first is not None else 0,
            checkpoint_blocked_s=first.blocked_s if first is not None else 0.0,
            trained_step=(first.trained_step or 0) if first is not None else 0,
            steps_age_s=age(first.at) if first is not None else 0.0,
            stepping_age_s=age(first.since) if first is not None else 0.0,
            run_ended_age_s=age(first.ended) if first is not None else 0.0,
        )
        self._at, self._cpu = now, cpu
        # A rank whose file is missing now (idle) keeps its last counts.
        self._counts = [
            a if a is not None else b for a, b in zip(counts, self._counts, strict=True)
        ]
        return metrics

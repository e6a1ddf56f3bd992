"""NodeSampler: real processes, real /proc, real progress files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dlfleet.worker import progress
from dlfleet.worker.agent.metrics import NodeSampler, descendants, rank_rates
from dlfleet.worker.progress import Counts

# A worker that burns CPU, holds ~64 MiB, and steps 8 samples at a time.
_WORKER = textwrap.dedent(
    """
    import os, sys, time
    os.environ["DLFLEET_PROGRESS_FILE"] = sys.argv[1]
    from dlfleet.worker import progress
    hold = bytearray(64 << 20)
    for i in range(0, len(hold), 4096):
        hold[i] = 1
    end = time.monotonic() + 30
    while time.monotonic() < end:
        t = time.monotonic()
        while time.monotonic() - t < 0.01:
            pass
        progress.step(8)
    """
)


def test_sampler_measures_cpu_memory_and_steps(tmp_path: Path) -> None:
    progress_file = tmp_path / "0"
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(progress_file)])
    try:
        deadline = time.monotonic() + 20
        while progress.read_counts(str(progress_file)) is None:
            assert time.monotonic() < deadline, "the worker never wrote its progress"
            time.sleep(0.05)
        sampler = NodeSampler(tmp_path, [proc.pid])
        time.sleep(1.5)
        metrics = sampler.sample()
    finally:
        proc.kill()
        proc.wait()
    assert metrics.cpu_percent > 30, metrics  # a busy loop: most of a core
    assert metrics.rss_bytes > 60 << 20, metrics
    assert metrics.peak_rss_bytes >= metrics.rss_bytes
    # ~10 ms a step: between 30 and 110 steps/s, allowing a loaded machine.
    assert 20 < metrics.steps_per_second < 110, metrics
    assert abs(metrics.samples_per_second - 8 * metrics.steps_per_second) < 1e-6
    assert 9 < metrics.step_time_ms < 60, metrics
    assert metrics.steps > 0


def test_idle_rank_keeps_its_counts_and_no_negative_rates(tmp_path: Path) -> None:
    (tmp_path / "0").write_text("100 800\n")
    sampler = NodeSampler(tmp_path, [999_999_999])  # no such process
    (tmp_path / "0").unlink()  # idle() between epochs
    metrics = sampler.sample()
    assert metrics.steps_per_second == 0 and metrics.cpu_percent == 0
    (tmp_path / "0").write_text("110 880\n")
    time.sleep(0.1)
    metrics = sampler.sample()
    assert metrics.steps == 110 and metrics.steps_per_second > 0


def test_descendants_include_children(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,sys; subprocess.run(['sleep', '5'])"]
    )
    try:
        deadline = time.monotonic() + 10
        while len(descendants(parent.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def test_rates_are_over_the_times_the_counts_were_written_not_when_they_were_read(
    tmp_path: Path,
) -> None:
    """A worker writes its counts every half second, the agent reads them
    every heartbeat: a read lags its write by up to half a second, so the
    time between reads is not the time the counts cover."""
    (tmp_path / "0").write_text("100 800 1000.0\n")
    sampler = NodeSampler(tmp_path, [999_999_999])
    (tmp_path / "0").write_text("150 1200 1000.5\n")  # 50 steps in 0.5 s, read at once
    metrics = sampler.sample()
    assert metrics.steps_per_second == pytest.approx(100.0)
    assert metrics.samples_per_second == pytest.approx(800.0)
    assert metrics.step_time_ms == pytest.approx(10.0)


def test_rank_rates_skip_start_up_and_read_no_new_write_as_no_step() -> None:
    # From "no step yet" (the loader's announcement) to the first steps: start-up.
    assert rank_rates(Counts(0, 0, 10.0), Counts(2, 16, 18.0), 1.0) is None
    assert rank_rates(Counts(2, 16, 18.0), Counts(2, 16, 18.0), 1.0) == (0.0, 0.0)
    assert rank_rates(Counts(2, 16, 18.0), Counts(12, 96, 18.5), 1.0) == (20.0, 160.0)
    assert rank_rates(Counts(50, 400, 20.0), Counts(3, 24, 21.0), 1.0) is None  # a new process
    assert rank_rates(Counts(100, 800), Counts(110, 880), 2.0) == (5.0, 40.0)  # no times


def test_a_worker_writes_when_it_counted(tmp_path: Path) -> None:
    path = tmp_path / "0"
    code = (
        "import os, sys; os.environ['DLFLEET_PROGRESS_FILE'] = sys.argv[1]\n"
        "from dlfleet.worker import progress\n"
        "progress.step(8)\n"
    )
    before = time.monotonic()
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)
    counts = progress.read_counts(str(path))
    assert counts is not None and (counts.steps, counts.samples) == (1, 8)
    assert counts.at is not None and before <= counts.at <= time.monotonic()


def test_a_save_hands_its_blocking_and_step_to_the_progress_file(tmp_path: Path) -> None:
    path = tmp_path / "0"
    code = (
        "import os, sys; os.environ['DLFLEET_PROGRESS_FILE'] = sys.argv[1]\n"
        "from dlfleet.worker import progress\n"
        "progress.step(8)\n"
        "progress.saved(40, 0.25)\n"
        "progress.step(8)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)
    counts = progress.read_counts(str(path))
    assert counts is not None and (counts.steps, counts.samples) == (2, 16)
    assert counts.blocked_s == pytest.approx(0.25)
    assert counts.trained_step == 41


def test_a_file_without_a_save_or_of_an_older_form_reads_as_none_blocked(
    tmp_path: Path,
) -> None:
    (tmp_path / "0").write_text("12 96 18.5 0.000000 -1\n")
    assert progress.read_counts(str(tmp_path / "0")) == Counts(12, 96, 18.5, 0.0, None)
    (tmp_path / "0").write_text("12 96 18.5\n")
    assert progress.read_counts(str(tmp_path / "0")) == Counts(12, 96, 18.5, 0.0, None)


def test_the_sampler_reports_rank_0s_checkpoint_blocking_and_trained_step(
    tmp_path: Path,
) -> None:
    (tmp_path / "0").write_text("100 800 1000.0 1.500000 340\n")
    metrics = NodeSampler(tmp_path, [999_999_999]).sample()
    assert metrics.checkpoint_blocked_s == pytest.approx(1.5)
    assert metrics.trained_step == 340
    (tmp_path / "0").write_text("100 800\n")
    metrics = NodeSampler(tmp_path, [999_999_999]).sample()
    assert (metrics.checkpoint_blocked_s, metrics.trained_step) == (0.0, 0)


def test_the_sampler_reports_how_old_rank_0s_counts_are(tmp_path: Path) -> None:
    (tmp_path / "0").write_text(f"100 800 {time.monotonic() - 2.0:.6f} 0.0 -1\n")
    metrics = NodeSampler(tmp_path, [999_999_999]).sample()
    assert metrics.steps_age_s == pytest.approx(2.0, abs=0.5)


def test_a_run_of_steps_starts_at_the_first_step_and_again_after_idle(tmp_path: Path) -> None:
    """The file says when the current run of steps began: the process's
    first step, and the first after an attempt ended (`idle`), and when the
    run before it made its last step; the sampler tells their ages (when
    training resumed and when it stopped, for the master's goodput)."""
    path = tmp_path / "0"
    code = (
        "import os, sys, time; os.environ['DLFLEET_PROGRESS_FILE'] = sys.argv[1]\n"
        "from dlfleet.worker import progress\n"
        "first = time.monotonic(); progress.step(8); time.sleep(0.2)\n"
        "last = time.monotonic(); progress.step(8)\n"
        "print(first, last)\n"
        "progress.idle(); time.sleep(0.1)\n"
        "again = time.monotonic(); progress.step(8); time.sleep(0.05); progress.step(8)\n"
        "print(again)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], check=True, timeout=60, capture_output=True
    )
    first, last, again = (float(word) for word in done.stdout.split())
    counts = progress.read_counts(str(path))
    assert counts is not None and counts.steps >= 3  # the count runs on
    assert counts.since is not None and again <= counts.since < again + 0.05
    assert counts.since > first + 0.3
    assert counts.ended is not None and last <= counts.ended < last + 0.05  # the run before
    metrics = NodeSampler(tmp_path, [999_999_999]).sample()
    assert metrics.stepping_age_s == pytest.approx(time.monotonic() - counts.since, abs=0.5)
    assert metrics.stepping_age_s >= metrics.steps_age_s
    assert metrics.run_ended_age_s == pytest.approx(time.monotonic() - counts.ended, abs=0.5)
    (tmp_path / "0").write_text("12 96 18.5 0.000000 -1\n")  # an older form: not said
    assert NodeSampler(tmp_path, [999_999_999]).sample().stepping_age_s == 0.0

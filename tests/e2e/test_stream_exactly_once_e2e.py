"""Exactly-once, end to end, for streamed files: the ledger job of
test_exactly_once.py (scripts/ledger_train.py under `dlmaster --job-config`,
gloo, real dlworker nodes) trains a FileCatalog of real JSON-lines, Parquet
and WebDataset files whose records carry their ids, through a killed worker,
a killed node (2 -> 1 -> 2 ranks: a world change mid-epoch) and a killed
master; ledger.py checks each epoch's records were trained exactly once."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from e2e.test_exactly_once import SIZE, LedgerJob
from stream_files import write_catalog

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# 203 records (the ledger job's SIZE) in files of three formats.
COUNTS = (50, 61, 42, 50)
FORMATS = ("jsonl", "parquet", "tar")


@pytest.fixture
def stream_job(tmp_path: Path) -> Any:
    data = tmp_path / "data"
    data.mkdir()
    paths, ids = write_catalog(data, COUNTS, FORMATS)
    assert ids == list(range(SIZE))
    jobs: list[LedgerJob] = []

    def make(args: list[str], **settings: Any) -> LedgerJob:
        catalog = ["--catalog", *(str(p) for p in paths), "--block-size", "8"]
        job = LedgerJob(tmp_path, [*catalog, "--dataset-name", "stream", *args], **settings)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()


def test_a_worker_killed_mid_epoch_trains_every_streamed_record_once(stream_job: Any) -> None:
    job = stream_job(["--crash-at-step", "17", "--crash-rank", "1", "--checkpoint-every", "5"])
    job.start()
    job.succeed()
    report = job.check()
    assert len(report.attempts) >= 2
    assert any(r.restored_step > 0 for r in report.restores)
    # The counts were read once per file and cached in the job's work directory.
    assert len(list((job.root / ".dlfleet" / "ledger" / "catalogs").glob("*.json"))) == len(COUNTS)


def test_a_node_killed_and_replaced_changes_the_world_and_loses_no_streamed_record(
    stream_job: Any,
) -> None:
    job = stream_job(["--sleep-per-step", "0.1"], relaunch_delay_s=6.0, max_node_relaunches=1)
    job.start()
    job.wait_for(lambda: job.steps_logged() >= 2 * 10, "10 steps of 2 ranks")
    os.kill(job.node_pid("node-1"), signal.SIGKILL)
    job.succeed()
    worlds = job.worlds()
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, worlds
    job.check()


def test_a_master_killed_mid_epoch_resumes_the_stream_from_its_store(stream_job: Any) -> None:
    job = stream_job(["--sleep-per-step", "0.05"])
    job.start()
    job.wait_for(lambda: job.steps_logged() >= 2 * 15, "15 steps of 2 ranks")
    job.kill()  # SIGKILL: the master, and its nodes with it
    job.start()
    job.succeed()
    report = job.check()
    assert len(report.attempts) >= 2 and any(r.restored_step > 0 for r in report.restores)

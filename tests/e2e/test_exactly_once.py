"""Exactly-once, end to end: `dlmaster --job-config` runs a real DDP job
(scripts/ledger_train.py, gloo, real dlworker nodes) whose ranks log every
record they train; ledger.py checks that each epoch's records were trained
exactly once by the final model lineage, through each failure the product
claims to survive: a worker killed, a node killed (2 -> 1 -> 2 nodes), the
master killed and started again, with drop_last on and off, and record counts
that no world size divides."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.ledger import LedgerReport, assert_exactly_once, read_ledger
from harness import JobProcess, worker_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).parent / "scripts" / "ledger_train.py"
SIZE = 203  # prime: no world size or batch divides it
BATCH = 4  # per rank
EPOCHS = 2


class LedgerJob(JobProcess):
    def __init__(self, root: Path, args: list[str], **settings: Any) -> None:
        root = root / str(settings.get("name", "ledger"))
        root.mkdir()
        self.ledger = root / "ledger"
        super().__init__(
            root,
            {
                "name": "ledger",
                "command": str(SCRIPT),
                "args": [
                    "--ledger-dir",
                    str(self.ledger),
                    "--size",
                    str(SIZE),
                    "--batch-size",
                    str(BATCH),
                    "--epochs",
                    str(EPOCHS),
                    *args,
                ],
                "nodes": {"min": 1, "max": 2},
                "display": "plain",
                "max_restarts": 3,
                "relaunch_delay_s": 0.5,
                "rendezvous": {"last_call_timeout_s": 0.5},
                "heartbeat": {"interval_s": 0.5, "timeout_s": 10},
                # The data is small: a replacement that checks itself first
                # (seconds; tests/e2e/test_node_check_e2e.py) could find it done
                # before the world grows back.
                "node_check": {"enabled": False},
                **settings,
            },
        )

    def steps_logged(self) -> int:
        entries, _, _ = read_ledger(self.ledger) if self.ledger.exists() else ([], [], [])
        return len(entries)

    def worlds(self) -> list[int]:
        """The world size of each attempt, in order."""
        entries, _, _ = read_ledger(self.ledger)
        by_attempt = {e.attempt: e.world for e in entries}
        return [by_attempt[a] for a in sorted(by_attempt)]

    def succeed(self) -> None:
        code, out, err = self.finish(timeout=180)
        assert code == 0, f"job failed ({code}):\n{err[-4000:]}\n{out[-4000:]}"

    def check(self, **options: Any) -> LedgerReport:
        return assert_exactly_once(self.ledger, size=SIZE, epochs=EPOCHS, **options)


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[LedgerJob] = []

    def make(args: list[str], **settings: Any) -> LedgerJob:
        job = LedgerJob(tmp_path, args, **settings)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
def test_a_plain_run_trains_every_record_once(make_job: Any, drop_last: bool) -> None:
    job = make_job(["--drop-last"] if drop_last else []).start()
    job.succeed()
    # 203 records, global batch 8: the last step of an epoch is short (kept) or
    # dropped; either way every rank runs the same steps (the checker demands a
    # line from every rank of the world for every counted step).
    report = job.check(drop_last_global_batch=BATCH * 2 if drop_last else None)
    assert job.worlds() == [2]
    assert report.discarded == 0


def test_a_worker_killed_mid_epoch_restores_and_trains_every_record_once(make_job: Any) -> None:
    job = make_job(["--crash-at-step", "17", "--crash-rank", "1", "--checkpoint-every", "5"])
    job.start()
    job.succeed()
    report = job.check()
    assert len(report.attempts) >= 2  # the crash made a new round
    assert any(r.restored_step > 0 for r in report.restores)
    assert report.discarded > 0  # the steps after the checkpoint were rolled back


def test_a_crash_after_a_checkpointed_step_loses_nothing(make_job: Any) -> None:
    job = make_job(["--crash-at-step", "25", "--crash-rank", "0", "--crash-point", "trained"])
    job.start()
    job.succeed()
    assert len(job.check().attempts) >= 2


def test_a_node_killed_shrinks_the_world_then_a_new_node_grows_it_back(make_job: Any) -> None:
    # The survivor restarts cold (a process, torch, gloo): seconds on a loaded
    # machine, so the replacement comes late enough for it to train alone first
    # (8 s, then its own warm start), and the steps are slow enough (82 left
    # at 0.2 s) that the survivor is not done alone before the replacement is in.
    job = make_job(["--sleep-per-step", "0.2"], relaunch_delay_s=8.0, max_node_relaunches=1)
    job.start()
    # The agent's pid first: `dlmaster status` is a process start, seconds on a
    # loaded machine, and the job could finish meanwhile.
    job.wait_for(lambda: job.node_pid("node-1") > 0, "node-1 started")
    agent = job.node_pid("node-1")
    job.wait_for(lambda: job.steps_logged() >= 2 * 10, "10 steps of 2 ranks")
    os.kill(agent, signal.SIGKILL)  # its worker dies with it
    job.succeed()
    worlds = job.worlds()
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, worlds
    job.check()


def test_a_master_killed_mid_epoch_resumes_the_job_from_its_store(make_job: Any) -> None:
    job = make_job(["--sleep-per-step", "0.05"])
    job.start()
    job.wait_for(lambda: job.steps_logged() >= 2 * 15, "15 steps of 2 ranks")
    job.kill()  # SIGKILL: the master, and its nodes with it
    assert not (job.root / ".dlfleet" / "ledger" / "result.json").exists()
    job.start()  # the same command again
    job.succeed()
    report = job.check()
    assert len(report.attempts) >= 2 and any(r.restored_step > 0 for r in report.restores)
    result = json.loads((job.root / ".dlfleet" / "ledger" / "result.json").read_text())
    assert result["code"] == 0


def test_a_master_crash_is_survived_by_the_nodes_with_nothing_lost(
    make_job: Any, store_url: str
) -> None:
    """SIGKILL the master process alone: the supervisor starts it again on the
    same address and store (a SQLite file, or PostgreSQL), the nodes keep
    their workers and reconnect, and the job's wall time grows by no more than
    the master's downtime + 10 s."""
    args = ["--sleep-per-step", "0.05", "--checkpoint-every", "5"]
    baseline = make_job(args, name="baseline")
    started = time.monotonic()
    baseline.start().succeed()
    plain_s = time.monotonic() - started

    job = make_job(args, state_store=store_url)
    started = time.monotonic()
    job.start()
    job.wait_for(lambda: job.steps_logged() >= 2 * 15, "15 steps of 2 ranks")
    killed_pid = int(job.status()["master_pid"])
    os.kill(killed_pid, signal.SIGKILL)
    killed = time.monotonic()

    seen: list[dict[str, Any]] = []

    def master_back() -> bool:
        seen.append(job.status())
        return bool(seen[-1]["master_up"]) and int(seen[-1]["master_pid"]) != killed_pid

    job.wait_for(master_back, "the master to be back", timeout=30)
    downtime_s = time.monotonic() - killed
    status = seen[-1]  # the job may end soon after: read no status again
    assert status["master_restarts"] == 1
    assert all(n["relaunches"] == 0 for n in status["nodes"])  # no node was lost
    job.succeed()
    crashed_s = time.monotonic() - started
    job.check()
    print(f"plain {plain_s:.1f}s, master down {downtime_s:.1f}s, with the crash {crashed_s:.1f}s")
    assert crashed_s <= plain_s + downtime_s + 10, (plain_s, downtime_s, crashed_s)


# ------------------------------------------------ in-memory checkpoints


def _restores_from_memory(report: LedgerReport) -> list[int]:
    return [r.restored_step for r in report.restores if r.restored_step > 0]


def test_a_worker_killed_is_restored_from_memory_in_place_exactly_once(make_job: Any) -> None:
    """Every step saved in memory: the killed rank's spare and the surviving
    rank go on from the last step all ranks saved; at most one step is redone."""
    job = make_job(
        ["--in-memory", "--crash-at-step", "17", "--crash-rank", "1", "--sleep-per-step", "0.05"]
    )
    job.start()
    job.succeed()
    report = job.check()
    assert len(report.attempts) >= 2
    restored = _restores_from_memory(report)
    assert restored and min(restored) >= 15, report.restores  # not from the start, not from disk


def test_a_rank_killed_before_saving_a_step_rolls_back_to_the_step_every_rank_saved(
    make_job: Any,
) -> None:
    """Rank 1 dies after training step 25 and before saving it, while rank 0
    saves it: step 25 is not committed, so the next round restores step 24."""
    job = make_job(
        [
            "--in-memory",
            "--crash-at-step",
            "25",
            "--crash-rank",
            "1",
            "--crash-point",
            "unsaved",
            "--sleep-per-step",
            "0.05",
        ]
    )
    job.start()
    job.succeed()
    report = job.check()
    assert _restores_from_memory(report) == [24], report.restores


def test_a_node_killed_leaves_its_peer_restoring_from_memory_in_a_smaller_world(
    make_job: Any,
) -> None:
    """The lost node's images survive as replicas on its peer: the survivor,
    alone, restores a recent step from memory (not from the start), and the
    replacement node joins later; the ledger stays exact."""
    job = make_job(
        ["--in-memory", "--sleep-per-step", "0.15"], relaunch_delay_s=2.0, max_node_relaunches=1
    )
    job.start()
    # The agent's pid first: asking for it takes a process start, slow on a
    # busy machine, and the kill must come mid-run.
    job.wait_for(lambda: job.node_pid("node-1") > 0, "node-1 started")
    agent = job.node_pid("node-1")
    job.wait_for(lambda: job.steps_logged() >= 2 * 12, "12 steps of 2 ranks")
    os.kill(agent, signal.SIGKILL)
    job.succeed()
    worlds = job.worlds()
    assert worlds[0] == 2 and 1 in worlds, worlds
    report = job.check()
    assert min(_restores_from_memory(report)) >= 10, report.restores


def test_state_cut_among_a_nodes_ranks_restores_whole_after_rank_and_node_kills(
    make_job: Any,
) -> None:
    """Two ranks per node and a 2 MiB replicated tensor in every save: each
    rank's image holds half of it. A rank killed restores from its node's
    images (its sibling's half too); a node killed leaves its peer restoring
    from memory (the lost node's images live on as replicas). Every restore
    checks the tensor is the one of its step; the ledger stays exact."""
    job = make_job(
        [
            "--in-memory",
            "--ballast-mb",
            "2",
            "--batch-size",
            "1",  # four ranks: enough steps for both faults
            "--crash-at-step",
            "8",
            "--crash-rank",
            "1",
            "--sleep-per-step",
            "0.1",
        ],
        nproc_per_node=2,
        relaunch_delay_s=2.0,
        max_node_relaunches=1,
    )
    job.start()
    job.wait_for(lambda: job.node_pid("node-1") > 0, "node-1 started")
    agent = job.node_pid("node-1")  # before: see the test above
    job.wait_for(lambda: job.steps_logged() >= 4 * 25, "25 steps of 4 ranks")
    os.kill(agent, signal.SIGKILL)
    job.succeed()
    report = job.check()
    restored = _restores_from_memory(report)
    assert len(restored) >= 2 and min(restored) >= 6, report.restores
    held = [json.loads(line) for line in (job.ledger / "ballast.jsonl").read_text().splitlines()]
    assert held and {h["rows"] for h in held} == {128}, held  # half of 256 rows each


def test_every_node_killed_restores_from_the_newest_persisted_step(make_job: Any) -> None:
    """The master and every node SIGKILLed: no image is left in any memory, so
    the job, started again, restores the newest step persisted to disk."""
    job = make_job(["--in-memory", "--persist-every", "10", "--sleep-per-step", "0.05"])
    job.start()
    job.wait_for(lambda: job.steps_logged() >= 2 * 25, "25 steps of 2 ranks")
    job.kill()  # SIGKILL: the master, and its nodes with it
    job.start()
    job.succeed()
    report = job.check()
    restored = [r.restored_step for r in report.restores if r.restored_step > 0]
    assert restored and restored[0] % 10 == 0 and restored[0] >= 20, report.restores


def test_a_master_killed_while_the_ranks_save_loses_no_checkpoint(make_job: Any) -> None:
    """SIGKILL the master while every rank saves every step: saves go on (the
    agents' reports wait for the master), and a worker killed after the master
    is back is restored from memory, at a step saved after the crash."""
    job = make_job(["--in-memory", "--sleep-per-step", "0.4"], max_restarts=5)
    job.start()
    job.wait_for(lambda: job.steps_logged() >= 2 * 12, "12 steps of 2 ranks")
    killed_pid = int(job.status()["master_pid"])
    os.kill(killed_pid, signal.SIGKILL)

    def master_back() -> bool:
        status = job.status()
        return bool(status["master_up"]) and int(status["master_pid"]) != killed_pid

    job.wait_for(master_back, "the master to be back", timeout=30)
    logged = job.steps_logged()
    job.wait_for(lambda: job.steps_logged() >= logged + 2 * 4, "4 more steps")
    victims = [n for n in job.status()["nodes"] if n["state"] == "running"]
    worker = worker_of(victims[0]["pid"])
    os.kill(worker, signal.SIGKILL)
    job.succeed()
    report = job.check()
    restored = _restores_from_memory(report)
    assert restored and max(restored) > 12, report.restores

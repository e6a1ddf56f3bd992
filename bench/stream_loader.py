"""Streaming loader benchmark: the same DDP job over the same JSON-lines files,
read by a plain `IterableDataset` that strides the files by rank under
`torchrun`, and by `ShardedDataLoader` over a `FileCatalog` under `dlworker`
(leasing from a `dlmaster`); then what each does when a job resumes in
another world size.

    python bench/stream_loader.py            # 5 trials per system
    python bench/stream_loader.py --quick    # 2 trials, fewer steps

Throughput: 1 node x 2 processes on this machine, DDP over gloo, one torch
thread each, an MLP 16 -> 256 -> 256 -> 10 (bench/_loader_train.py's), per-rank
batch 32, 20 warm-up steps then `--steps` timed steps, all inside the first
epoch. The data: `--files` JSON-lines files of `--records-per-file` records
{"id", "x": 16 floats, "y"} written to a temporary folder; both loaders decode
each line with json.loads into a tensor (bench/_stream_train.py). Shuffling
is comparable: the plain loader visits its files in a seeded order and
shuffles through a buffer of 1024 records; the catalog visits blocks of 256
records in a seeded order with a shuffle window of 1024 positions. Trials
alternate the systems' order (plain first in trial 0, dlfleet first in trial
1, ...), each trial with fresh processes, ports and (for dlfleet) a fresh
master and SQLite store; the clock and the trial machinery are bench/loader.py's
(TrialRun, run_trial), and so is the rule for a noisy machine: a trial during
which the rest of the machine kept more than `--max-other-load` cores busy
(0.15) is reported and run again, at most as many times as trials were
planned. The count cache of the catalog is filled by the first dlfleet trial,
outside the clock (before the first step).

Resume after a world change (in this process, no launcher): an epoch is
trained for `--resume-steps` steps by 2 ranks, checkpointed, and resumed by
3 ranks.
* plain: the usual resume of a rank-strided IterableDataset, each rank
  skipping the records it had consumed (steps x batch) of its stripe: with 3
  stripes instead of 2 records are repeated and others never seen; the bench
  prints how many.
* dlfleet: a real master (`dlmaster` subprocess), ranks as threads, each step
  ended by a barrier as DDP's all-reduce would; rank 0's `state_dict` at the
  checkpoint, two more steps trained and lost (the kill), then 3 ranks in a new
  round `load_state_dict` and train the rest. The bench prints the duplicates
  and the records missing (0 and 0 expected) and fails if either is not 0.

The last line is `ratio: X`: dlfleet's median samples/s over the plain
loader's (goal >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import BenchError, ServerProcess, become_subreaper, free_port, say
from _stream_train import FileStripes
from loader import (
    BIN,
    NPROC,
    TORCHRUN,
    Config,
    System,
    TrialRun,
    dlfleet_system,
    run_trial,
    tail,
)

from dlfleet.api.env import TOKEN_ENV

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bench" / "_stream_train.py"
GOAL_RATIO = 0.97
FEATURES = 16
BATCH = 32


# ---------------------------------------------------------------- the data


def write_files(root: Path, files: int, per_file: int) -> list[str]:
    rng = random.Random(0)
    paths: list[str] = []
    for k in range(files):
        path = root / f"part-{k:03d}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i in range(k * per_file, (k + 1) * per_file):
                x = [round(rng.gauss(0, 1), 4) for _ in range(FEATURES)]
                f.write(json.dumps({"id": i, "x": x, "y": i % 10}) + "\n")
        paths.append(str(path))
    return paths


# ---------------------------------------------------------------- throughput


class StreamTrial(TrialRun):
    """bench/loader.py's trial (processes, clock, cleanup), with the
    streaming training script and its arguments."""

    script = TRAIN

    def data_args(self) -> list[str]:
        return ["--files", *self.args.paths, "--cache-dir", str(self.args.cache_dir)]


def run_trials(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    """Alternating trials; one during which the rest of the machine kept more
    than `--max-other-load` cores busy is reported and run again (at most as
    many re-runs as planned trials), as bench/loader.py does."""
    systems: list[System] = [TORCHRUN, dlfleet_system(0)]
    config = Config(0)
    rates: dict[str, list[float]] = {s.name: [] for s in systems}
    reruns_left = args.trials * len(systems)
    for index in range(args.trials):
        turn = index % 2
        for system in systems[turn:] + systems[:turn]:
            while True:
                result = run_trial(system, config, index, args, root, StreamTrial)
                other = result.other_load or 0.0
                say(
                    f"  {system.name:9s} trial {index}: {result.samples_per_s:8.0f} samples/s, "
                    f"step {result.step_ms:.2f} ms, data wait {result.data_share:.1%}, "
                    f"rank 0 CPU {result.cpu_ms:.2f} ms/step, other load {other:.2f} cores"
                    + (f" ({result.note})" if result.note else "")
                )
                if other <= args.max_other_load or not reruns_left:
                    break
                reruns_left -= 1
                say("    (disturbed: run again)")
            rates[system.name].append(result.samples_per_s)
    return rates


# ---------------------------------------------------------------- resume


def record_id(line: bytes) -> int:
    return int(json.loads(line)["id"])


def tally(seen: list[int], total: int) -> tuple[int, int]:
    """(duplicates, missing) of one epoch's records."""
    counts = Counter(seen)
    return sum(n - 1 for n in counts.values() if n > 1), total - len(counts)


def plain_resume(paths: list[str], steps: int, total: int) -> tuple[int, int]:
    seen: list[int] = []
    for rank in range(2):  # before the checkpoint: 2 ranks, `steps` steps
        stream = iter(FileStripes(paths, rank, 2, window=1024, parse=record_id))
        seen += [next(stream) for _ in range(steps * BATCH)]
    for rank in range(3):  # resumed by 3 ranks, each skipping what it consumed
        seen += list(FileStripes(paths, rank, 3, window=1024, skip=steps * BATCH, parse=record_id))
    return tally(seen, total)


def _ids(batch: list[Any]) -> list[int]:
    return [int(r["id"]) for r in batch]


def _keep(batch: list[Any]) -> list[Any]:
    return batch


def resume_round(
    master: str, token: str, catalog: Any, round_: int, world: int, stop: int | None,
    state: list[dict[str, Any]],
) -> list[int]:  # fmt: skip
    """One round of `world` ranks (threads); with `stop`, rank 0 checkpoints
    into `state` after `stop` steps and the round is killed two steps later.
    Returns the records of the steps that count (those up to the checkpoint)."""
    from dlfleet import ShardedDataLoader
    from dlfleet.worker.loader import LoaderEnvironment

    barrier = threading.Barrier(world, timeout=60)
    trained: dict[int, list[list[int]]] = {}
    errors: list[Exception] = []

    def rank_main(rank: int) -> None:
        env = LoaderEnvironment(
            master=master, token=token, round=round_, node_id=f"n{rank}", rank=rank,
            world_size=world,
        )  # fmt: skip
        trained[rank] = []
        loader = ShardedDataLoader(
            catalog, BATCH, seed=0, name="resume", collate_fn=_keep, environment=env
        )
        with loader:
            if state:
                loader.load_state_dict(state[0])
            for batch in loader:
                trained[rank].append(_ids(batch))
                barrier.wait()  # the step's all-reduce
                if stop is not None and len(trained[rank]) == stop:
                    if rank == 0:
                        state.append(loader.state_dict())
                    barrier.wait()
                if stop is not None and len(trained[rank]) == stop + 2:
                    return  # killed: these two steps are rolled back

    def guarded(rank: int) -> None:
        try:
            rank_main(rank)
        except Exception as error:  # noqa: BLE001 - reported by the caller
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors or any(t.is_alive() for t in threads):
        raise BenchError(f"the dlfleet resume round {round_} failed: {errors}")
    return [i for batches in trained.values() for ids in batches[:stop] for i in ids]


def dlfleet_resume(paths: list[str], steps: int, root: Path) -> tuple[int, int]:
    from dlfleet import FileCatalog

    token = secrets.token_hex(16)
    port = free_port()
    master = ServerProcess(
        "dlmaster",
        [str(BIN / "dlmaster"), "--port", str(port), "--state-store", f"sqlite:///{root}/r.db"],
        root / "resume-master.log",
        ready_text="listening on",
        env={**os.environ, TOKEN_ENV: token},
    )
    catalog = FileCatalog(paths, block_size=256, shuffle_window=1024, cache_dir=root / "cache")
    state: list[dict[str, Any]] = []
    try:
        master.wait_ready(port)
        address = f"127.0.0.1:{port}"
        kept = resume_round(address, token, catalog, 1, 2, steps, state)
        kept += resume_round(address, token, catalog, 2, 3, None, state)
    finally:
        catalog.close()
        master.stop()
    return tally(kept, len(catalog))


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 trials, 200 timed steps")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--records-per-file", type=int, default=5000)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--resume-steps", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=240.0, help="per trial, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the trials' folders")
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=0.15,
        help="cores the rest of the machine may keep busy during a trial before it is run again",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.steps = 2, 200
    args.batch_size = BATCH
    needed = (args.warmup + args.steps) * BATCH * NPROC
    if needed > args.files * args.records_per_file:
        parser.error(f"{needed} records are trained, the files hold fewer: one epoch only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="dlfleet-stream-bench-"))
    started = time.monotonic()
    try:
        data = root / "data"
        data.mkdir()
        args.paths = write_files(data, args.files, args.records_per_file)
        args.cache_dir = root / "cache"
        say(
            f"stream loader benchmark: {args.trials} trial(s) per system, 1 node x {NPROC} "
            f"processes, gloo, {args.files} JSON-lines files x {args.records_per_file} records, "
            f"batch {BATCH} per rank, {args.warmup} + {args.steps} timed steps; logs in {root}"
        )
        rates = run_trials(args, root)
        say("resume of an epoch after a world change (2 ranks -> 3 ranks):")
        total = args.files * args.records_per_file
        dup, missing = plain_resume(args.paths, args.resume_steps, total)
        say(f"  plain IterableDataset (files strided by rank): {dup} duplicated, {missing} dropped")
        ours = dlfleet_resume(args.paths, args.resume_steps, root)
        say(f"  dlfleet FileCatalog: {ours[0]} duplicated, {ours[1]} dropped")
        if ours != (0, 0):
            raise BenchError(f"dlfleet's resume is not exactly-once: {ours}")
    except BenchError as error:
        say(f"FAILED: {error}")
        say(tail(root / "resume-master.log"))
        say("ratio: n/a (the bench failed)")
        return 1
    plain, ours_rate = statistics.median(rates["torchrun"]), statistics.median(rates["dlfleet"])
    pairs = ", ".join(
        f"{d / p:.3f}" for p, d in zip(rates["torchrun"], rates["dlfleet"], strict=True)
    )
    say(f"(the bench took {time.monotonic() - started:.0f} s)")
    say(f"median samples/s: plain {plain:.0f}, dlfleet {ours_rate:.0f}; trial by trial {pairs}")
    ratio = ours_rate / plain
    say(f"goal: dlfleet >= {GOAL_RATIO} x plain: {'yes' if ratio >= GOAL_RATIO else 'NO'}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    say(f"ratio: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

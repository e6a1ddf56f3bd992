"""A real job for the shard service, on this machine: a master on a SQLite file,
three consumer processes that lease shards of a shuffled dataset, map positions
to records with the epoch's permutation and "train" them, a master killed with
SIGKILL mid-epoch and started again on the same store, and a ledger check at
the end: every record of every epoch trained exactly once.

    python examples/shard_service_demo.py [--records 20000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.permutation import EpochPermutation
from dlfleet.api.v1 import shards_pb2

DATASET = "demo"
PATIENT = RetryPolicy(attempts=500, initial_backoff_s=0.02, max_backoff_s=0.25, total_budget_s=60)


def start_master(
    store: str, token: str, port: int = 0, resume: bool = False
) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlfleet.master", "--port", str(port), "--store", store,
         "--log-level", "WARNING", *(["--resume"] if resume else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "DLFLEET_TOKEN": token},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on [\d.]+:(\d+)", line)
    if match is None:
        raise SystemExit(f"master failed to start: {line}{proc.stdout.read()}")
    return proc, int(match.group(1))


def consumer(target: str, token: str, node: str, spec: shards_pb2.DatasetSpec, out: Path) -> None:
    """Lease, train, ack (piggybacked on the next lease), until the dataset ends."""
    trained: list[str] = []
    with MasterClient(target, token=token, retry=PATIENT) as client:
        client.register_dataset(spec)  # every consumer may register: idempotent
        held: list[int] = []
        while True:
            resp = client.lease(DATASET, node_id=node, rank=0, done=held)
            held = []
            kind = resp.WhichOneof("outcome")
            if kind == "end_of_dataset":
                break
            if kind == "wait":
                time.sleep(resp.wait.retry_after_ms / 1000)
                continue
            if kind == "end_of_epoch":
                continue
            shard = resp.shard
            perm = EpochPermutation(spec.size, spec.seed, shard.epoch, spec.shuffle)
            records = perm.indices(shard.start, shard.end)
            time.sleep(0.05 * len(records) / spec.batch_size)  # the "training steps"
            trained.extend(f"{shard.epoch} {r}" for r in records)
            held = [shard.lease_id]
    out.write_text("\n".join(trained))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--consumers", type=int, default=3)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="dlfleet-demo-"))
    store = f"sqlite:///{workdir / 'master.db'}"
    token = secrets.token_hex(16)
    spec = shards_pb2.DatasetSpec(
        name=DATASET, size=args.records, batch_size=50, shard_size=500,
        epochs=args.epochs, shuffle=True, seed=2026,
    )  # fmt: skip
    print(f"demo: master on {store}")
    master, port = start_master(store, token)
    target = f"127.0.0.1:{port}"
    started = time.monotonic()
    ctx = mp.get_context("spawn")
    outs = [workdir / f"consumer{i}.txt" for i in range(args.consumers)]
    procs = [
        ctx.Process(target=consumer, args=(target, token, f"node{i}", spec, outs[i]))
        for i in range(args.consumers)
    ]
    for p in procs:
        p.start()

    total = args.records * args.epochs
    killed = False
    with MasterClient(target, token=token, retry=PATIENT) as watcher:
        while any(p.is_alive() for p in procs):
            try:
                status = watcher.dataset_status(DATASET)
            except Exception:  # noqa: BLE001 - not registered yet, or master restarting
                time.sleep(0.1)
                continue
            done = status.epoch * args.records + status.records_done
            print(
                f"  epoch {min(status.epoch, args.epochs - 1) + 1}/{args.epochs}  "
                f"done {min(done, total):>7}/{total}  leases {status.leases_active}",
                flush=True,
            )
            if not killed and done > total * 0.4:
                print("demo: SIGKILL the master mid-epoch, then start it again on the same store")
                master.kill()
                master.wait()
                time.sleep(1)
                master, _ = start_master(store, token, port, resume=True)
                killed = True
            time.sleep(0.5)
    for p in procs:
        p.join()
    elapsed = time.monotonic() - started
    master.terminate()
    master.wait(10)

    ledger = Counter(line for out in outs for line in out.read_text().splitlines() if line)
    expected = {f"{e} {r}" for e in range(args.epochs) for r in range(args.records)}
    lost = len(expected - set(ledger))
    twice = sum(1 for n in ledger.values() if n > 1)
    print(f"demo: {len(ledger)} (epoch, record) pairs trained in {elapsed:.1f}s")
    print(f"demo: lost {lost}, trained twice {twice}, master restarts 1")
    ok = lost == 0 and twice == 0 and all(p.exitcode == 0 for p in procs)
    print("demo: OK, every record of every epoch trained exactly once" if ok else "demo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

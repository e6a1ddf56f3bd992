"""The client harness of the shard-service benchmark: one process of client threads.

Standard library only, and no dlfleet or DLRover import: the same file runs under
dlfleet's virtual environment (driving dlfleet's master) and under the DLRover
benchmark environment (driving DLRover's master), so the measuring loop, its
timers and its bookkeeping are byte for byte the same for both systems. What
differs is only the *driver*: a module `bench/_driver_<name>.py` with

    make_driver(target, dataset, client_id, options) -> Driver
    register(target, dataset, geometry, options) -> dict   # once per dataset
    inspect(target, dataset, options) -> dict              # after a run

where a Driver has `setup()` (connect; not timed) and `lease_and_ack()` (lease one
shard and report it done: one *pair*; raises on anything but a granted lease).

Sub-commands (all print exactly one protocol line, `RESULT <json>`, on the
original stdout; library logging is moved to stderr):

    register  --driver D --target A --dataset N --size S --batch-size B --shard-size H
    inspect   --driver D --target A --dataset N
    run       --driver D --target A --dataset N --threads T --proc-index I
              --warmup W --seconds S

`run` builds T drivers (one client object per thread) and calls their setup(),
prints `READY`, then waits for a line `GO <delay>` on stdin: the orchestrator
sends it to every process of a run at once, and each process starts its threads
`delay` seconds later on its own clock. Every thread then loops lease_and_ack()
back to back; pairs that *complete* in the first W seconds are warm-up, pairs that
complete in the next S seconds are measured (count and per-pair latency from
time.perf_counter around the one call), and a thread stops at the first pair
that completes after the window (that pair, like the warm-up ones, is a real
lease and a real ack, reported in `total_pairs`, but not measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from _common import load_driver, parse_options


class Driver(Protocol):
    def setup(self) -> None: ...

    def lease_and_ack(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class _ThreadResult:
    latencies_us: list[int] = field(default_factory=list)
    warmup_pairs: int = 0
    late_pairs: int = 0
    error: str | None = None


def _client_loop(
    driver: Driver,
    start: float,
    measure_start: float,
    measure_end: float,
    out: _ThreadResult,
) -> None:
    while (now := time.perf_counter()) < start:
        time.sleep(min(start - now, 0.005))
    lease_and_ack = driver.lease_and_ack
    perf_counter = time.perf_counter
    latencies = out.latencies_us
    try:
        while True:
            t0 = perf_counter()
            lease_and_ack()
            t1 = perf_counter()
            if t1 > measure_end:
                out.late_pairs += 1
                return
            if t1 >= measure_start:
                latencies.append(round((t1 - t0) * 1e6))
            else:
                out.warmup_pairs += 1
    except Exception as exc:  # noqa: BLE001 - any failure is reported; the run then fails
        out.error = f"{type(exc).__name__}: {exc}"


def _run(args: argparse.Namespace, module: Any, options: dict[str, str], emit: Any) -> None:
    make_driver = module.make_driver
    drivers: list[Driver] = []
    for index in range(args.threads):
        client_id = f"{args.proc_index}-{index}"
        driver = cast(Driver, make_driver(args.target, args.dataset, client_id, options))
        driver.setup()
        drivers.append(driver)
    emit("READY")
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "GO":
        raise SystemExit(f"expected 'GO <delay>' on stdin, got {line!r}")
    start = time.perf_counter() + float(line[1])
    measure_start = start + args.warmup
    measure_end = measure_start + args.seconds
    results = [_ThreadResult() for _ in drivers]
    threads = [
        threading.Thread(
            target=_client_loop,
            args=(driver, start, measure_start, measure_end, result),
            daemon=True,
        )
        for driver, result in zip(drivers, results, strict=True)
    ]
    cpu = os.times()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu_end = os.times()
    for driver in drivers:
        driver.close()
    latencies = [lat for result in results for lat in result.latencies_us]
    warmup = sum(result.warmup_pairs for result in results)
    late = sum(result.late_pairs for result in results)
    report = {
        "proc_index": args.proc_index,
        "threads": args.threads,
        "pairs": len(latencies),
        "total_pairs": len(latencies) + warmup + late,
        "seconds": args.seconds,
        # CPU of this client process from the start of its loops to their end.
        "cpu_s": (cpu_end.user - cpu.user) + (cpu_end.system - cpu.system),
        "latencies_us": latencies,
        "errors": [result.error for result in results if result.error is not None],
    }
    emit("RESULT " + json.dumps(report, separators=(",", ":")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("command", choices=["register", "inspect", "run"])
    parser.add_argument("--driver", required=True)
    parser.add_argument("--target", required=True, help="host:port of the master")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for the driver")
    parser.add_argument("--size", type=int, default=0, help="register: records")
    parser.add_argument("--batch-size", type=int, default=0, help="register: records per batch")
    parser.add_argument("--shard-size", type=int, default=0, help="register: records per shard")
    parser.add_argument("--threads", type=int, default=1, help="run: client threads")
    parser.add_argument("--proc-index", type=int, default=0, help="run: this process's index")
    parser.add_argument("--warmup", type=float, default=1.0, help="run: warm-up seconds")
    parser.add_argument("--seconds", type=float, default=8.0, help="run: measured seconds")
    args = parser.parse_args(argv)

    # The protocol goes to the original stdout; whatever the client libraries
    # print (DLRover logs every client it builds) goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def emit(line: str) -> None:
        protocol.write(line + "\n")
        protocol.flush()

    options = parse_options(args.option)
    module = load_driver("_driver_", args.driver)
    if args.command == "register":
        geometry = {"size": args.size, "batch_size": args.batch_size, "shard_size": args.shard_size}
        info = module.register(args.target, args.dataset, geometry, options)
        emit("RESULT " + json.dumps(info))
    elif args.command == "inspect":
        emit("RESULT " + json.dumps(module.inspect(args.target, args.dataset, options)))
    else:
        _run(args, module, options, emit)
    protocol.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

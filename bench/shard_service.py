"""Shard-service benchmark: dlfleet's master against DLRover's, same harness.

    python bench/shard_service.py            # 3 runs of 5 s per level
    python bench/shard_service.py --quick    # ~2 s per level

What is measured: clients that do nothing but lease a shard and acknowledge it
(report it done), back to back, against a real master over gRPC on 127.0.0.1.
One *pair* is one lease plus one ack; we report pairs per second over the
measured window, and the p50/p99 latency of one pair, at 1, 16 and 64
concurrent clients, for each system:

* DLRover 0.6.1: its master (`python -m dlrover.python.master.main --platform
  local`) and its own worker-side gRPC client (`GrpcMasterClient.get_task` then
  `report_task_result`), installed in a separate virtual environment
  (.bench-venv-dlrover, created on first use; it needs protobuf<5 while dlfleet
  needs protobuf>=5, hence two environments).
* dlfleet: `python -m dlfleet.master` with a SQLite store (every lease and ack
  durable, fsync'd, before the answer), driven as its loaders drive it: a
  `LeaseSession` on the LeaseStream RPC, where one message each way reports the
  previous shard DONE and leases the next.
* dlfleet (unary), for reference: the same master driven with two unary calls
  per pair, `MasterClient.lease` then `report_done`, the shape of DLRover's
  client.

Both are driven by the same harness, bench/_harness.py (standard library only),
run by each environment's Python; only the two-call driver differs
(bench/_driver_dlrover.py, bench/_driver_dlfleet.py). For every level both
systems get the same number of client threads, spread the same way over the
same number of processes, one client object (one gRPC channel) per thread, the
same warm-up and the same measured duration, on a fresh dataset of the same
geometry (10^9 records in shards of 1,000: far more shards than any run takes,
so no run meets the end of an epoch). The threads of one process share its GIL,
so N clients run in K = min(N, --max-procs) processes, by default one per CPU:
enough that the client side's GIL never caps the rate, and no more, since the
clients share the machine with the master and every extra process costs CPU the
master then lacks. (On the 2-core machine this was written on, a client process
spends about 0.4-0.5 ms of CPU per pair for either system, so one process alone
could drive some 2,000 pairs/s; K = 1, 2 and 4 gave the same rates within the
noise, K = 4 with more client CPU per pair and higher p99.) The processes start
their loops together on a GO sent after all their clients are connected.

Both masters stay up and the systems take turns run by run (DLRover 1,
dlfleet 1, DLRover 1, dlfleet 1, ..., DLRover 16, ...), three runs per level by
default, and the median run of each system counts, so a drift in the machine's
load hits both alike and one noisy run decides nothing;
an idle master must use no CPU while the other is measured, and the bench prints
how much each did use. Each level also prints CPU time per pair (user+system,
over all pairs of the level, warm-up included) of the master and of the client
processes together.

After each level the master is asked what it still has out: every pair is a real
ack, so the outstanding count must be 0 and the acknowledged count must match
what the clients did, or the run fails.

The memory check (printed, not part of the ratio) starts a fresh master of each
system and reads its VmRSS from /proc before and after registering a dataset of
10^9 records in shards of 10^4 (10^5 shards per epoch), and after its clients
have leased and acknowledged shards of it for a few seconds.

The cost of watching (`--observe`): a fourth system, "dlfleet observed", is
the same master as dlfleet (LeaseStream) with its HTTP endpoint on, and while
its clients run, a poller in this process reads `/metrics`, `/api/v1/status`
and `/api/v1/events?since=...` once a second each (a Prometheus scraping every
second and the dashboard open), on one kept-alive connection with the job
token. It takes its turns with the others (the poller only runs during its
own), and its pairs per second over plain dlfleet's, per level and the
minimum over the counted levels, are printed with the number of polls; every
poll must answer 200, or the run fails. The issue's budget: within 5%
(ratio >= 0.95). On a small shared machine the runs' spread is wider than
that, so the bench also times the cost itself: the observed master's CPU for
one poll of all three, over 100 polls back to back once its levels are done
(idle, holding every dataset of the run), as a share of a core at one poll a
second.

The last line is `ratio: X`: dlfleet's pairs per second (LeaseStream) over
DLRover's, the minimum over the 16- and 64-client levels (the highest level run
if neither). The unary figures are printed beside it. Run without DLRover
(`--systems dlfleet --observe`), the last line is the observed ratio.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from _common import BenchError, ServerProcess, free_port, kill_group, say

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "bench" / "_harness.py"
DLFLEET_PYTHON = Path(sys.executable)
DLROVER_VENV = ROOT / ".bench-venv-dlrover"
DLROVER_PYTHON = DLROVER_VENV / "bin" / "python"
DLROVER_REQUIREMENTS = ["dlrover[k8s]==0.6.1", "protobuf<5"]
DLROVER_VERSION = "0.6.1"
# DLRover keeps at most this many shards of an epoch in memory at once
# (dlrover/python/master/shard/dataset_splitter.py, _MAX_SHARD_COUNT).
DLROVER_SUBEPOCH_SHARDS = 50_000

BATCH_SIZE = 100
MEMORY_DATASET_SIZE = 10**9
MEMORY_SHARD_SIZE = 10**4
POLL_EVERY_S = 1.0  # the observed master's /metrics, status and events
SYSTEM_KEYS = ("dlrover", "dlfleet", "dlfleet-unary", "dlfleet-observed")


@dataclass
class Geometry:
    size: int
    batch_size: int
    shard_size: int

    @property
    def shards(self) -> int:
        return math.ceil(self.size / self.shard_size)


@dataclass
class System:
    key: str  # the driver's name
    label: str
    python: Path
    # (workdir, tag) -> the master and its target
    start_master: Callable[[Path, str], tuple[ServerProcess, str]]
    # Shards the master counts as acknowledged, from the driver's inspect().
    acked_from_inspect: Callable[[dict[str, Any], Geometry], int | None]
    options: dict[str, str] = field(default_factory=dict)
    # target -> what watches the master while its clients run (dlfleet observed)
    observe: Callable[[str], Poller] | None = None


def start_dlrover_master(workdir: Path, tag: str) -> tuple[ServerProcess, str]:
    port = free_port()
    argv = [
        str(DLROVER_PYTHON),
        "-m",
        "dlrover.python.master.main",
        "--platform",
        "local",
        "--port",
        str(port),
        "--node_num",
        "1",
        "--job_name",
        "bench",
    ]
    master = ServerProcess("DLRover master", argv, workdir / f"dlrover-master-{tag}.log", None)
    master.wait_ready(port)
    return master, f"127.0.0.1:{port}"


def dlrover_acked(info: dict[str, Any], geometry: Geometry) -> int | None:
    """Shards acknowledged, from DLRover's todo count: exact while the run stays
    in the first sub-epoch, else modulo the sub-epoch size (compared so)."""
    shards = geometry.shards
    if shards <= DLROVER_SUBEPOCH_SHARDS:
        return shards - int(info["todo"])
    return (DLROVER_SUBEPOCH_SHARDS - int(info["todo"])) % DLROVER_SUBEPOCH_SHARDS


def make_dlfleet_starter(
    token: str, key: str, http_ports: dict[str, int] | None = None
) -> Callable[[Path, str], tuple[ServerProcess, str]]:
    """With `http_ports`, the master also serves HTTP, on a port recorded
    there under its gRPC target."""

    def start(workdir: Path, tag: str) -> tuple[ServerProcess, str]:
        port = free_port()
        argv = [
            str(DLFLEET_PYTHON),
            "-m",
            "dlfleet.master",
            "--port",
            str(port),
            "--store",
            f"sqlite:///{workdir / f'{key}-{tag}.db'}",
            "--token",
            token,
        ]
        if http_ports is not None:
            http_port = free_port()
            argv += ["--http-port", str(http_port)]
            http_ports[f"127.0.0.1:{port}"] = http_port
        ready = f"listening on 127.0.0.1:{port}"
        master = ServerProcess(f"{key} master", argv, workdir / f"{key}-master-{tag}.log", ready)
        master.wait_ready(port)
        return master, f"127.0.0.1:{port}"

    return start


def dlfleet_acked(info: dict[str, Any], geometry: Geometry) -> int | None:
    done = int(info["records_done"])
    return done // geometry.shard_size


class Poller:
    """Reads a master's /metrics, /api/v1/status and /api/v1/events every
    `every_s` on a thread, over one kept-alive connection, while in its
    `with` block: what a Prometheus scraping every second and an open
    dashboard cost the master. Any answer but 200 fails the run."""

    def __init__(self, port: int, token: str, every_s: float = POLL_EVERY_S) -> None:
        self.port = port
        self.every_s = every_s
        self.headers = {"Authorization": f"Bearer {token}"}
        self.polls = 0
        self.bytes = 0
        self.errors: list[str] = []
        self._since = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poller", daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.errors and exc[0] is None:
            raise BenchError(f"the poller failed {len(self.errors)} times: {self.errors[0]}")

    def _run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        next_at = time.monotonic()
        try:
            while not self._stop.is_set():
                for path in ("/metrics", "/api/v1/status", f"/api/v1/events?since={self._since}"):
                    try:
                        body = self._get(connection, path)
                    except (OSError, http.client.HTTPException) as exc:
                        self.errors.append(f"{path}: {exc}")
                        connection.close()  # reconnects on the next request
                        continue
                    if path.startswith("/api/v1/events"):
                        self._since = int(json.loads(body)["last_seq"])
                    self.bytes += len(body)
                self.polls += 1
                next_at += self.every_s
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        finally:
            connection.close()

    def poll_now(self, rounds: int) -> None:
        """`rounds` polls of all three back to back, on this thread."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            for _ in range(rounds):
                for path in ("/metrics", "/api/v1/status", "/api/v1/events?since=0"):
                    self.bytes += len(self._get(connection, path))
                self.polls += 1
        finally:
            connection.close()

    def _get(self, connection: http.client.HTTPConnection, path: str) -> bytes:
        connection.request("GET", path, headers=self.headers)
        answer = connection.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise http.client.HTTPException(f"HTTP {answer.status}: {body[:200]!r}")
        return body


# --------------------------------------------------------------------------- harness runs


@contextmanager
def _processes(procs: list[subprocess.Popen[str]]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc, grace=1.0)


def _line_reader(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _harness_argv(system: System, command: str, target: str, dataset: str) -> list[str]:
    argv = [str(system.python), str(HARNESS), command, "--driver", system.key.split("-")[0]]
    argv += ["--target", target, "--dataset", dataset]
    for key, value in system.options.items():
        argv += ["--option", f"{key}={value}"]
    return argv


def harness_call(
    system: System, command: str, target: str, dataset: str, extra: list[str], log: Path
) -> dict[str, Any]:
    """A one-shot harness command (register, inspect): its RESULT object."""
    argv = _harness_argv(system, command, target, dataset) + extra
    with open(log, "a", encoding="utf-8") as err:
        done = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=300, check=False
        )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise BenchError(f"harness {command} for {system.label} failed ({done.returncode}); see {log}")


@dataclass
class LevelResult:
    clients: int
    procs: int
    pairs: int
    seconds: float
    p50_ms: float
    p99_ms: float
    total_pairs: int
    client_cpu_s: float

    @property
    def rate(self) -> float:
        return self.pairs / self.seconds


def _quantile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank quantile."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return float(sorted_values[rank - 1])


def run_level(
    system: System,
    target: str,
    dataset: str,
    clients: int,
    max_procs: int,
    warmup: float,
    seconds: float,
    log: Path,
) -> LevelResult:
    nprocs = min(clients, max_procs)
    shares = [clients // nprocs + (1 if i < clients % nprocs else 0) for i in range(nprocs)]
    procs: list[subprocess.Popen[str]] = []
    readers: list[queue.Queue[str | None]] = []
    with open(log, "a", encoding="utf-8") as err, _processes(procs):
        for index, threads in enumerate(shares):
            argv = [
                *_harness_argv(system, "run", target, dataset),
                "--threads",
                str(threads),
                "--proc-index",
                str(index),
                "--warmup",
                str(warmup),
                "--seconds",
                str(seconds),
            ]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
            procs.append(proc)
            lines: queue.Queue[str | None] = queue.Queue()
            assert proc.stdout is not None
            threading.Thread(target=_line_reader, args=(proc.stdout, lines), daemon=True).start()
            readers.append(lines)

        def expect(lines: queue.Queue[str | None], prefix: str, deadline: float) -> str:
            while True:
                try:
                    line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise BenchError(f"{system.label}: no {prefix} from a client process") from None
                if line is None:
                    raise BenchError(f"{system.label}: a client process died; see {log}")
                if line.startswith(prefix):
                    return line

        deadline = time.monotonic() + 120
        for lines in readers:
            expect(lines, "READY", deadline)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("GO 0.2\n")
            proc.stdin.flush()
        deadline = time.monotonic() + warmup + seconds + 60
        reports = [json.loads(expect(lines, "RESULT ", deadline)[7:]) for lines in readers]
        for proc in procs:
            proc.wait(timeout=30)

    errors = [error for report in reports for error in report["errors"]]
    if errors:
        raise BenchError(f"{system.label}, {clients} clients: {len(errors)} failed: {errors[0]}")
    latencies = sorted(lat for report in reports for lat in report["latencies_us"])
    if not latencies:
        raise BenchError(f"{system.label}, {clients} clients: no pair completed in the window")
    return LevelResult(
        clients=clients,
        procs=nprocs,
        pairs=len(latencies),
        seconds=seconds,
        p50_ms=_quantile(latencies, 0.50) / 1000.0,
        p99_ms=_quantile(latencies, 0.99) / 1000.0,
        total_pairs=sum(int(report["total_pairs"]) for report in reports),
        client_cpu_s=sum(float(report["cpu_s"]) for report in reports),
    )


def verify(
    system: System, target: str, dataset: str, geometry: Geometry, total_pairs: int, log: Path
) -> str:
    info = harness_call(system, "inspect", target, dataset, [], log)
    if int(info["outstanding"]) != 0:
        raise BenchError(f"{system.label}: {info['outstanding']} leases still out after a run")
    acked = system.acked_from_inspect(info, geometry)
    if acked is None:
        return "0 out"
    expected = total_pairs
    if system.key == "dlrover" and geometry.shards > DLROVER_SUBEPOCH_SHARDS:
        expected %= DLROVER_SUBEPOCH_SHARDS
    if acked != expected:
        raise BenchError(f"{system.label}: master counts {acked} acked, clients did {expected}")
    return f"{total_pairs} acked, 0 out"


# --------------------------------------------------------------------------- set-up


def ensure_dlrover_venv() -> None:
    check = [
        str(DLROVER_PYTHON),
        "-c",
        "import importlib.metadata as m, google.protobuf as p;"
        "import dlrover.python.elastic_agent.master_client;"
        "print(m.version('dlrover'), p.__version__)",
    ]
    if DLROVER_PYTHON.exists():
        done = subprocess.run(check, capture_output=True, text=True, check=False)
        words = done.stdout.split()
        if done.returncode == 0 and words and words[0] == DLROVER_VERSION:
            say(f"DLRover environment: {DLROVER_VENV} (dlrover {words[0]}, protobuf {words[1]})")
            return
        say(f"DLRover environment at {DLROVER_VENV} is unusable; rebuilding it")
        shutil.rmtree(DLROVER_VENV)
    say(f"creating the DLRover environment {DLROVER_VENV} (python3 -m venv) ...")
    subprocess.run(["python3", "-m", "venv", str(DLROVER_VENV)], check=True)
    say(f"installing {' '.join(DLROVER_REQUIREMENTS)} with pip (a minute or two) ...")
    pip = subprocess.Popen(
        [
            str(DLROVER_VENV / "bin" / "pip"),
            "install",
            "--progress-bar",
            "off",
            *DLROVER_REQUIREMENTS,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert pip.stdout is not None
    for line in pip.stdout:
        if line.startswith(("Collecting", "Installing", "Successfully", "ERROR")):
            say("  pip: " + line.rstrip())
    if pip.wait() != 0:
        raise BenchError("pip install of DLRover failed")
    done = subprocess.run(check, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"DLRover environment still unusable: {done.stderr.strip()}")
    say(f"DLRover environment ready: {done.stdout.strip()}")


def dlfleet_available() -> str | None:
    """None when dlfleet's master and client can be imported, else why not."""
    probe = "import dlfleet.api.client, dlfleet.master.__main__"
    done = subprocess.run(
        [str(DLFLEET_PYTHON), "-c", probe], capture_output=True, text=True, check=False
    )
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


# --------------------------------------------------------------------------- the benchmark


def _row(*cells: object) -> str:
    widths = (16, 7, 5, 7, 11, 7, 7, 15, 7, 0)
    return "  ".join(f"{cell!s:>{width}}" for cell, width in zip(cells, widths, strict=False))


def bench_levels(
    systems: list[System],
    levels: list[int],
    geometry: Geometry,
    args: argparse.Namespace,
    workdir: Path,
) -> dict[str, dict[int, LevelResult]]:
    """Both masters up (an idle master uses no CPU; checked and printed below),
    the systems taking turns level by level, so that a slow drift of the machine
    cannot favour either."""
    say()
    say(
        f"== lease+ack: {args.warmup:g} s warm-up + {args.seconds:g} s measured per run; "
        f"the systems take turns, {args.repeats} runs per level, the median run counts =="
    )
    masters: dict[str, tuple[ServerProcess, str]] = {}
    results: dict[str, dict[int, LevelResult]] = {system.key: {} for system in systems}
    runs: dict[tuple[str, int], list[LevelResult]] = {}
    own_cpu = dict.fromkeys(results, 0.0)
    polls: dict[str, int] = {}
    failed: ServerProcess | None = None
    try:
        for system in systems:
            masters[system.key] = system.start_master(workdir, "levels")
            master, target = masters[system.key]
            say(f"{system.label} master: pid {master.proc.pid} on {target}")
        start_cpu = {key: master.cpu_seconds() for key, (master, _) in masters.items()}
        say(
            _row(
                "system", "clients", "procs", "pairs", "lease+ack/s", "p50 ms", "p99 ms",
                "CPU/pair master", "clients", "checked",
            )
        )  # fmt: skip
        for clients, repeat in ((c, r) for c in levels for r in range(args.repeats)):
            for system in systems:
                master, target = masters[system.key]
                failed = master
                log = workdir / f"{system.key}-clients.log"
                dataset = f"bench-{clients}-clients-{repeat}"
                extra = ["--size", str(geometry.size), "--batch-size", str(geometry.batch_size)]
                extra += ["--shard-size", str(geometry.shard_size)]
                turn_cpu = master.cpu_seconds()
                harness_call(system, "register", target, dataset, extra, log)
                cpu = master.cpu_seconds()
                watching = system.observe(target) if system.observe else nullcontext()
                with watching as watcher:
                    result = run_level(
                        system, target, dataset, clients, args.max_procs, args.warmup,
                        args.seconds, log,
                    )  # fmt: skip
                if isinstance(watcher, Poller):
                    polls[system.key] = polls.get(system.key, 0) + watcher.polls
                cpu = master.cpu_seconds() - cpu
                checked = verify(system, target, dataset, geometry, result.total_pairs, log)
                own_cpu[system.key] += master.cpu_seconds() - turn_cpu
                failed = None
                runs.setdefault((system.key, clients), []).append(result)
                say(
                    _row(
                        system.label,
                        clients,
                        result.procs,
                        result.pairs,
                        f"{result.rate:,.0f}",
                        f"{result.p50_ms:.2f}",
                        f"{result.p99_ms:.2f}",
                        f"{cpu * 1000 / result.total_pairs:.2f} ms",
                        f"{result.client_cpu_s * 1000 / result.total_pairs:.2f} ms",
                        checked,
                    )
                )
        for (key, clients), repeats in runs.items():
            # The median run by rate stands for the level (its latencies too).
            results[key][clients] = sorted(repeats, key=lambda r: r.rate)[len(repeats) // 2]
        idle = {
            key: master.cpu_seconds() - start_cpu[key] - own_cpu[key]
            for key, (master, _) in masters.items()
        }
        say(
            "CPU each master used while the other system ran: "
            + ", ".join(f"{system.label} {idle[system.key]:.2f} s" for system in systems)
        )
        for key, count in polls.items():
            say(f"{key}: {count} polls of /metrics, /api/v1/status and /api/v1/events, all 200")
        for system in systems:
            if system.observe is not None:
                master, target = masters[system.key]
                poll_cost(master, system.observe(target), len(levels) * args.repeats)
    except BenchError:
        if failed is not None:
            say(failed.tail())
        raise
    finally:
        for master, _ in masters.values():
            master.stop()
    return results


def poll_cost(master: ServerProcess, poller: Poller, datasets: int, rounds: int = 100) -> None:
    """The master's CPU for one poll of all three endpoints, measured idle
    over many back to back (the clock ticks in 10 ms): a direct figure for
    the throughput ratio's noisy one."""
    before = master.cpu_seconds()
    started = time.perf_counter()
    poller.poll_now(rounds)
    wall = time.perf_counter() - started
    each_ms = (master.cpu_seconds() - before) * 1000 / rounds
    say(
        f"one poll of the three, idle master holding {datasets} datasets: {each_ms:.2f} ms of "
        f"its CPU ({poller.bytes // rounds:,} bytes, {wall * 1000 / rounds:.1f} ms wall): "
        f"{each_ms / (10 * POLL_EVERY_S):.2f}% of a core at one poll every {POLL_EVERY_S:g} s"
    )


def memory_check(system: System, args: argparse.Namespace, workdir: Path) -> None:
    geometry = Geometry(MEMORY_DATASET_SIZE, BATCH_SIZE, MEMORY_SHARD_SIZE)
    master, target = system.start_master(workdir, "memory")
    log = workdir / f"{system.key}-memory.log"
    try:
        time.sleep(1.0)
        before = master.rss_mb()
        extra = ["--size", str(geometry.size), "--batch-size", str(geometry.batch_size)]
        extra += ["--shard-size", str(geometry.shard_size)]
        started = time.perf_counter()
        harness_call(system, "register", target, "memory", extra, log)
        register_s = time.perf_counter() - started
        registered = master.rss_mb()
        result = run_level(system, target, "memory", 16, args.max_procs, 0.0, args.mem_seconds, log)
        verify(system, target, "memory", geometry, result.total_pairs, log)
        leased = master.rss_mb()
    except BenchError:
        say(master.tail())
        raise
    finally:
        master.stop()
    say(
        f"{system.label + ':':<16} RSS {before:7.1f} MB idle, "
        f"{registered:7.1f} MB registered (+{registered - before:.1f} MB, {register_s:.2f} s), "
        f"{leased:7.1f} MB after {result.total_pairs:,} leases+acks "
        f"(+{leased - before:.1f} MB over idle)"
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Lease+ack throughput of dlfleet's master against DLRover's."
    )
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up seconds per level")
    parser.add_argument("--quick", action="store_true", help="2 s per level (0.5 s warm-up)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="turns per level; the median run counts (default 3, 1 with --quick)",
    )
    parser.add_argument("--clients", default="1,16,64", help="comma-separated levels")
    parser.add_argument(
        "--max-procs",
        type=int,
        default=os.cpu_count() or 2,
        help="client processes per level, at most (default: one per CPU)",
    )
    parser.add_argument(
        "--systems",
        default="dlrover,dlfleet,dlfleet-unary",
        help="which to run: dlrover, dlfleet (LeaseStream), dlfleet-unary, dlfleet-observed",
    )
    parser.add_argument(
        "--observe",
        action="store_true",
        help="also run dlfleet observed (its /metrics, status and events polled every second) "
        "and print its throughput against plain dlfleet's",
    )
    parser.add_argument("--size", type=int, default=10**9, help="records per dataset")
    parser.add_argument("--shard-size", type=int, default=1000, help="records per shard")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory check")
    parser.add_argument("--mem-seconds", type=float, default=None, help="memory check leasing")
    parser.add_argument("--keep-logs", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    if args.seconds is None:
        args.seconds = 2.0 if args.quick else 5.0
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.warmup is None:
        args.warmup = 0.5 if args.quick else 1.5
    if args.mem_seconds is None:
        args.mem_seconds = 2.0 if args.quick else 15.0
    args.levels = sorted({int(level) for level in args.clients.split(",")})
    args.wanted = [name.strip() for name in args.systems.split(",") if name.strip()]
    if args.observe:
        args.wanted += [key for key in ("dlfleet", "dlfleet-observed") if key not in args.wanted]
    if not args.wanted or set(args.wanted) - set(SYSTEM_KEYS):
        parser.error(f"--systems takes {', '.join(SYSTEM_KEYS)}")
    if args.shard_size % BATCH_SIZE:
        parser.error(f"--shard-size must be a multiple of the batch size, {BATCH_SIZE}")
    return args


def _poller_for(http_ports: dict[str, int], token: str) -> Callable[[str], Poller]:
    """A master's poller, by its gRPC target."""

    def poller(target: str) -> Poller:
        return Poller(http_ports[target], token)

    return poller


def _systems(wanted: list[str]) -> list[System]:
    systems: list[System] = []
    if "dlrover" in wanted:
        ensure_dlrover_venv()
        systems.append(
            System("dlrover", "DLRover 0.6.1", DLROVER_PYTHON, start_dlrover_master, dlrover_acked)
        )
    modes = [
        ("dlfleet", "dlfleet", "stream"),
        ("dlfleet-unary", "dlfleet unary", "unary"),
        ("dlfleet-observed", "dlfleet observed", "stream"),
    ]
    for key, label, mode in modes:
        if key not in wanted:
            continue
        why = dlfleet_available()
        if why is not None:
            raise BenchError(f"dlfleet's master or client cannot be imported: {why}")
        token = secrets.token_hex(16)
        options = {"token": token, "mode": mode}
        system = System(
            key, label, DLFLEET_PYTHON, make_dlfleet_starter(token, key), dlfleet_acked, options
        )
        if key == "dlfleet-observed":
            http_ports: dict[str, int] = {}
            system.start_master = make_dlfleet_starter(token, key, http_ports)
            system.observe = _poller_for(http_ports, token)
        systems.append(system)
    return systems


def _bench(args: argparse.Namespace, workdir: Path) -> None:
    geometry = Geometry(args.size, BATCH_SIZE, args.shard_size)
    say(
        f"shard-service benchmark: {os.cpu_count()} CPUs, {args.levels} clients, "
        f"{geometry.size:,} records in shards of {geometry.shard_size:,} per dataset "
        f"(a fresh dataset per level), clients in min(N, {args.max_procs}) processes"
    )
    systems = _systems(args.wanted)
    results = bench_levels(systems, args.levels, geometry, args, workdir)
    if not args.no_memory:
        say()
        say(
            f"== memory: master RSS, dataset of {MEMORY_DATASET_SIZE:,} records in shards "
            f"of {MEMORY_SHARD_SIZE:,} ({MEMORY_DATASET_SIZE // MEMORY_SHARD_SIZE:,} shards "
            f"per epoch), 16 clients leasing for {args.mem_seconds:g} s (not in the ratio) =="
        )
        for system in systems:
            memory_check(system, args, workdir)
    if args.keep_logs:
        say(f"logs kept in {workdir}")
    headline = "dlfleet" in results and "dlrover" in results
    if "dlfleet" in results and "dlfleet-observed" in results:
        summarize_observed(
            results["dlfleet"], results["dlfleet-observed"], args.levels, last=not headline
        )
    if headline:
        summarize(results["dlfleet"], results["dlrover"], args.levels, results.get("dlfleet-unary"))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="dlfleet-bench-"))
    try:
        _bench(args, workdir)
    except BenchError as exc:
        say(f"benchmark failed: {exc}")
        say(f"logs kept in {workdir}")
        return 1
    except KeyboardInterrupt:
        say(f"interrupted; logs kept in {workdir}")
        return 130
    if not args.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _counted(levels: list[int]) -> list[int]:
    """The levels a ratio is the minimum over: 16 and 64 clients, where run."""
    return [clients for clients in levels if clients in (16, 64)] or [max(levels)]


def summarize_observed(
    plain: dict[int, LevelResult], observed: dict[int, LevelResult], levels: list[int], last: bool
) -> None:
    """Observed dlfleet over plain dlfleet; `ratio:` last when it is the
    run's headline (no DLRover)."""
    say()
    say(
        f"== the cost of watching: dlfleet with /metrics, status and events polled every "
        f"{POLL_EVERY_S:g} s, against dlfleet alone (budget: within 5%) =="
    )
    say(
        f"{'clients':>8}  {'alone/s':>10}  {'observed/s':>10}  {'ratio':>6}  "
        f"{'p99 ms alone|observed':>22}"
    )
    ratios: dict[int, float] = {}
    for clients in levels:
        a, b = plain[clients], observed[clients]
        ratios[clients] = b.rate / a.rate
        say(
            f"{clients:>8}  {a.rate:>10,.0f}  {b.rate:>10,.0f}  {ratios[clients]:>6.3f}  "
            f"{f'{a.p99_ms:.2f} | {b.p99_ms:.2f}':>22}"
        )
    counted = _counted(levels)
    ratio = min(ratios[clients] for clients in counted)
    which = " and ".join(str(clients) for clients in counted)
    verdict = "within" if ratio >= 0.95 else "OVER"
    say(
        f"observed ratio = observed dlfleet lease+ack/s over dlfleet alone's, the minimum over "
        f"the {which}-client level{'s' if len(counted) > 1 else ''}: {ratio:.3f} "
        f"({verdict} the 5% budget)"
    )
    if last:
        say(f"ratio: {ratio:.3f}")


def summarize(
    ours: dict[int, LevelResult],
    theirs: dict[int, LevelResult],
    levels: list[int],
    unary: dict[int, LevelResult] | None = None,
) -> None:
    say()
    say("== dlfleet vs DLRover (same harness, clients, processes and durations) ==")
    say(
        f"{'clients':>8}  {'dlfleet/s':>10}  {'DLRover/s':>10}  {'ratio':>6}  "
        f"{'p50 ms dlfleet|DLRover':>23}  {'p99 ms dlfleet|DLRover':>23}"
    )
    ratios: dict[int, float] = {}
    for clients in levels:
        a, b = ours[clients], theirs[clients]
        ratios[clients] = a.rate / b.rate
        say(
            f"{clients:>8}  {a.rate:>10,.0f}  {b.rate:>10,.0f}  {ratios[clients]:>6.2f}  "
            f"{f'{a.p50_ms:.2f} | {b.p50_ms:.2f}':>23}  {f'{a.p99_ms:.2f} | {b.p99_ms:.2f}':>23}"
        )
    if unary:
        say(
            "dlfleet unary (lease, then report_done) over DLRover: "
            + ", ".join(
                f"{clients} clients {unary[clients].rate / theirs[clients].rate:.2f}"
                for clients in levels
            )
        )
    counted = _counted(levels)
    ratio = min(ratios[clients] for clients in counted)
    which = " and ".join(str(clients) for clients in counted)
    say(
        f"ratio = dlfleet lease+ack/s over DLRover's, the minimum over the {which}-client "
        f"level{'s' if len(counted) > 1 else ''}"
    )
    say(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())

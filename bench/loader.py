"""Loader benchmark: the same DDP job trained for a fixed number of steps with
torch's `DataLoader` + `DistributedSampler` under `torchrun`, and with dlfleet's
`ShardedDataLoader` under `dlworker` (leasing from a `dlmaster`), side by side.

    python bench/loader.py                  # 5 trials, num_workers 0 and 2
    python bench/loader.py --quick          # 3 trials, num_workers=0
    python bench/loader.py --shard-batches 0,32 --num-workers 0

The job (both systems, same script bench/_loader_train.py, same Python): one
node x 2 processes on this machine, DDP over gloo (GLOO_SOCKET_IFNAME=lo,
OMP_NUM_THREADS=1, one torch thread per process), an MLP 64 -> 256 -> 256 -> 10
with SGD, on a map-style dataset of 60,000 synthetic records whose
`__getitem__` does two rounds of `tanh(x @ W)` (64 x 64): a little CPU work per
record, so loading is part of the step. Per-rank batch 32, shuffling on (seed
0), 20 warm-up steps, then 800 timed steps (about 3 ms each here); the 820
steps of a global batch of 64 fit in one epoch (the bench checks), so what is
measured is the loaders' steady state, not their epoch turnover. Only the
loader differs:

* torchrun: `torchrun --standalone --nnodes 1 --nproc-per-node 2 train.py
  --loader plain`: `DataLoader(dataset, batch_size, sampler=
  DistributedSampler(dataset, shuffle=True, seed=0), num_workers=N)`.
* dlfleet: `dlmaster --port P --state-store sqlite:///<trial>/m.db` (a fresh
  master and store per trial, token in DLFLEET_TOKEN), then `dlworker --master
  127.0.0.1:P --nnodes 1 --nproc-per-node 2 train.py --loader dlfleet`:
  `ShardedDataLoader(dataset, batch_size, shuffle=True, seed=0,
  num_workers=N)`, which leases its shards from the master in sync mode, each
  lease and ack durable in SQLite before the answer, the next shards leased in
  the background while the current one trains (8 shards per round trip, the
  loader's SHARDS_PER_REQUEST). The shard size is the master's
  default (16 global batches: a round trip per 128 steps per rank) unless
  `--shard-batches` lists more variants (`dlfleet-s32`: shard_size = 32 global
  batches). With N > 0 its worker processes start from a forkserver (the
  loader's own default: forking under live gRPC threads is unsafe); torch's
  DataLoader forks them.

Timing is done inside the script, by rank 0: from the end of the last warm-up
step to the end of the last timed step (DDP's all-reduce keeps the ranks in
step). Process start-up, rendezvous, the master's start and the loaders' first
batches are outside the clock. samples/s = timed steps x 32 x 2 / seconds.
Each trial also reports the median step, the share of the timed wall time rank
0 spent waiting for its next batch, rank 0's process CPU time per step (all
its threads), the master's CPU time over the whole trial, and how many cores
the rest of the machine kept busy meanwhile (all busy CPU time from
/proc/stat, less the trial's own processes', over the trial's wall time):
other work on the machine moves single trials by 10-30 %, and this says which.

Configurations: `--num-workers` (default `0,2`) lists the DataLoader worker
counts to run; every configuration runs every system. The headline is
num_workers=0 (`--headline`): the loader's own work in the training process
(sampler, index mapping, lease bookkeeping) is then on the step's critical
path and nothing hides it. With workers, 2 ranks x (1 + N) processes share
this machine's 2 cores, every step is slower and the figures are noisier.

Trials rotate the systems' order (torchrun first in trial 0, dlfleet first in
trial 1, ...), configuration after configuration, so drift in the machine's
load hits all; the load average is printed at the start and the end. Every
trial gets a fresh temporary folder, fresh ports and an environment marker; at its end
every process carrying the marker (agents, workers, DataLoader workers, the
master) is killed, and the bench checks none is left. A trial that times out
or ends without a result fails the bench with its logs' tails; one whose
processes crash in their teardown after rank 0 wrote its result (seen with
gloo under either launcher, about once in 40 runs) counts, with a note.

A trial during which the rest of the machine kept more than
`--max-other-load` cores busy (0.15) measured its neighbours, not the
systems: it is reported, set aside and run again (at most as many re-runs as
planned trials). For that figure to be right, the bench adopts its trials'
orphans (a forkserver and the DataLoader workers it forked outlive the rank
that started them) and reaps them, so their CPU counts as the trial's own.

The last line is `ratio: X`: dlfleet's median samples/s over torchrun's at
the headline configuration (higher is better; the goal is >= 0.98, no slower
than the plain loader). Next to each ratio the bench prints the trial-by-trial
ratios (the two systems' trials of one index ran back to back) as a check on
it. A full run (7 trials per system and configuration) takes 5-6 minutes on a
2-core machine (more when it is busy), `--quick` about 1.

What the figures said on the 2-core machine this was written on (the master on
the same two cores). Before leases came four to a round trip, each lease cost
the training processes 1-2 ms of wall time (the gRPC client's threads take the
GIL from the training thread several times per round trip, and the master
takes CPU): dlfleet / torchrun 0.84-1.00, about 0.95 on a quiet machine. With
four shards per round trip (master CPU per batch 0.09 -> 0.03 ms, lease threads
0.05 -> 0.013 ms), three quiet runs: 1.114 and 0.947 (5 trials), 0.947 (9
trials).

Where rank 0's time went then, measured inside the job (per-step data waits,
DataLoader's index and fetch times, py-spy): the loader's own bookkeeping costs
~20 us a step more than DistributedSampler's 13 us (of a ~4 ms step); every
lease round trip stalled the step that triggered it by 2-12 ms while the lease
thread held the GIL (the aio stream and a unary call alike); mapping the next
8192 positions of the permutation costs 0.5-1 ms every 128 steps. Round trips
now carry eight shards (one per 128 steps). A run of 7 trials a system on
2026-11-23: 0.987 (trial by trial 1.001); the same day, before that change,
1.033 and 0.925: about 1.0, and a single run's figure moves by +-5%, because
the machine's own speed does (rank 0's CPU time per step, the same work,
varies from 3.4 to 4.7 ms between trials with nothing else running). Pinning
each rank to a core did not narrow it (0.874-0.984 in three runs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from _common import (
    BenchError,
    ServerProcess,
    become_subreaper,
    free_port,
    kill_group,
    reap_orphans,
    say,
    tagged_pids,
)

from dlfleet.api.env import TOKEN_ENV

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TRAIN = BENCH / "_loader_train.py"
BIN = Path(sys.executable).parent  # torchrun, dlmaster, dlworker: beside this interpreter
NPROC = 2
GOAL_RATIO = 0.98
TAG_ENV = "LOADER_BENCH_TAG"
CLEANUP_S = 15.0


# --------------------------------------------------------------------------- processes


def tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
    except OSError:
        return f"{path}: (no log)"
    return f"{path}, last lines:\n" + "\n".join(f"    {line[:300]}" for line in text[-lines:])


@dataclass(frozen=True)
class Config:
    num_workers: int

    @property
    def label(self) -> str:
        return f"num_workers={self.num_workers}"


@dataclass(frozen=True)
class System:
    name: str
    launcher: str  # "torchrun" or "dlfleet"
    shard_batches: int = 0  # dlfleet: global batches per shard; 0: the default

    @property
    def loader(self) -> str:
        return "plain" if self.launcher == "torchrun" else "dlfleet"


TORCHRUN = System("torchrun", "torchrun")


def dlfleet_system(shard_batches: int) -> System:
    name = "dlfleet" if shard_batches == 0 else f"dlfleet-s{shard_batches}"
    return System(name, "dlfleet", shard_batches)


@dataclass
class Trial:
    system: System
    config: Config
    index: int
    samples_per_s: float
    step_ms: float
    data_share: float  # of the timed wall time, rank 0 waiting for its batches
    cpu_ms: float  # rank 0's process CPU per timed step
    seconds: float
    master_cpu_s: float | None = None  # the whole trial, start-up included
    note: str = ""
    other_load: float | None = None  # cores busy outside the trial, mean over it


class TrialRun:
    """The processes of one trial of one system: started, waited for, and
    killed to the last one."""

    def __init__(
        self, system: System, config: Config, index: int, args: argparse.Namespace, root: Path
    ) -> None:
        self.system = system
        self.config = config
        self.index = index
        self.args = args
        self.dir = root / f"{config.num_workers}w-{index:02d}-{system.name}"
        attempt = 1
        while self.dir.exists():  # a disturbed trial run again
            attempt += 1
            self.dir = root / f"{config.num_workers}w-{index:02d}-{system.name}-{attempt}"
        self.dir.mkdir(parents=True)
        self.result_path = self.dir / "result.json"
        self.tag = secrets.token_hex(8)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        for name in [k for k in env if k.startswith("DLFLEET_")]:
            env.pop(name)
        env.update(
            {
                TAG_ENV: self.tag,
                TOKEN_ENV: secrets.token_hex(16),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        # torch's TCPStore looks up 127.0.0.1's name on connect; one short try.
        env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
        self.env = env
        self.master: ServerProcess | None = None
        self.job: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    @property
    def where(self) -> str:
        return f"{self.system.name} trial {self.index} ({self.config.label})"

    script = TRAIN

    def train_args(self) -> list[str]:
        a = self.args
        return [
            str(self.script),
            "--loader",
            self.system.loader,
            "--result",
            str(self.result_path),
            "--batch-size",
            str(a.batch_size),
            "--num-workers",
            str(self.config.num_workers),
            "--warmup",
            str(a.warmup),
            "--steps",
            str(a.steps),
            *self.data_args(),
        ]

    def data_args(self) -> list[str]:
        """The training script's arguments for its data."""
        a = self.args
        shard_size = self.system.shard_batches * a.batch_size * NPROC
        return [
            "--records",
            str(a.records),
            "--item-work",
            str(a.item_work),
            "--shard-size",
            str(shard_size),
        ]

    def argv(self) -> list[str]:
        if self.system.launcher == "torchrun":
            return [
                str(BIN / "torchrun"),
                "--standalone",
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(NPROC),
                "--log-dir",
                str(self.dir / "worker-logs"),
                *self.train_args(),
            ]
        port = free_port()
        self.master = ServerProcess(
            "dlmaster",
            [
                str(BIN / "dlmaster"),
                "--port",
                str(port),
                "--state-store",
                f"sqlite:///{self.dir / 'm.db'}",
            ],
            self.dir / "master.log",
            ready_text="listening on",
            env=self.env,
        )
        self.master.wait_ready(port)
        return [
            str(BIN / "dlworker"),
            "--master",
            f"127.0.0.1:{port}",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(NPROC),
            "--log-dir",
            str(self.dir / "worker-logs"),
            *self.train_args(),
        ]

    def run(self) -> Trial:
        argv = self.argv()
        log = open(self.dir / "job.log", "wb")  # noqa: SIM115 - closed in cleanup()
        self._logs.append(log)
        self.job = subprocess.Popen(
            argv,
            cwd=self.dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = self.job.wait(timeout=self.args.timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"{self.where} did not finish within {self.args.timeout:.0f} s; {self.logs()}"
            ) from None
        if not self.result_path.exists():
            raise BenchError(f"{self.where} exited with {code}, no result; {self.logs()}")
        result: dict[str, Any] = json.loads(self.result_path.read_text(encoding="utf-8"))
        expected = {
            "loader": self.system.loader,
            "world_size": NPROC,
            "batch_size": self.args.batch_size,
            "num_workers": self.config.num_workers,
            "steps": self.args.steps,
        }
        wrong = {k: result.get(k) for k, v in expected.items() if result.get(k) != v}
        if wrong:
            raise BenchError(f"{self.where}: result {wrong}, not {expected}")
        master_cpu = None
        if self.master is not None and self.master.proc.poll() is None:
            master_cpu = self.master.cpu_seconds()
        return Trial(
            self.system,
            self.config,
            self.index,
            float(result["samples_per_s"]),
            float(result["step_ms_median"]),
            float(result["data_share"]),
            float(result["cpu_ms_per_step"]),
            float(result["seconds"]),
            master_cpu,
            # Rank 0 writes its result after the last timed step: a crash in
            # the teardown after it (seen with gloo, under either launcher,
            # about once in 40 runs) leaves the figure valid; it is reported.
            note="" if code == 0 else f"exited with {code} after writing its result",
        )

    def logs(self) -> str:
        paths = [self.dir / "job.log"]
        if self.master is not None:
            paths.append(self.master.log_path)
        paths += sorted(self.dir.glob("worker-logs/**/*.log"))
        return "\n".join(tail(p) for p in paths)

    def cleanup(self) -> None:
        """Kill every process of the trial; raise if one survives."""
        if self.job is not None:
            kill_group(self.job, grace=3.0)
        if self.master is not None:
            self.master.stop()
        deadline = time.monotonic() + CLEANUP_S
        left = tagged_pids(TAG_ENV, self.tag)
        while left and time.monotonic() < deadline:
            for pid in left:
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
            reap_orphans()
            left = tagged_pids(TAG_ENV, self.tag)
        reap_orphans()
        for log in self._logs:
            log.close()
        if left:
            raise BenchError(f"processes {left} of {self.where} survived")


def run_trial(
    system: System,
    config: Config,
    index: int,
    args: argparse.Namespace,
    root: Path,
    kind: type[TrialRun] = TrialRun,
) -> Trial:
    trial = kind(system, config, index, args, root)
    busy, children, began = busy_cpu_s(), children_cpu_s(), time.monotonic()
    try:
        result = trial.run()
    finally:
        trial.cleanup()
    # What the rest of the machine did meanwhile: all CPU time spent, less the
    # trial's own (its processes are reaped by now, their times in ours).
    other = (busy_cpu_s() - busy) - (children_cpu_s() - children)
    result.other_load = max(0.0, other) / max(time.monotonic() - began, 1e-9)
    if not args.keep and not result.note:
        shutil.rmtree(trial.dir, ignore_errors=True)
    return result


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (not idle, not waiting on I/O)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def paired(trials: list[Trial], system: System, config: Config) -> str:
    """The ratio within each trial index (the two systems ran back to back),
    as a check on the headline: slow drift of the machine cancels in it."""
    by_index = {
        (t.system, t.index): t.samples_per_s
        for t in trials
        if t.config == config and t.system in (system, TORCHRUN)
    }
    pairs = sorted(
        by_index[system, i] / by_index[TORCHRUN, i]
        for s, i in by_index
        if s == system and (TORCHRUN, i) in by_index
    )
    if not pairs:
        return ""
    return (
        f"; trial by trial: median {statistics.median(pairs):.3f}, {pairs[0]:.3f}..{pairs[-1]:.3f}"
    )


def describe(trial: Trial) -> str:
    master = "" if trial.master_cpu_s is None else f", master CPU {trial.master_cpu_s:.2f} s"
    note = f"; NOTE: {trial.note}" if trial.note else ""
    if trial.other_load is not None:
        master += f"; other load {trial.other_load:.2f} cores"
    return (
        f"{trial.samples_per_s:.0f} samples/s ({trial.seconds:.2f} s; median step "
        f"{trial.step_ms:.2f} ms, {trial.data_share:.1%} waiting for data, rank 0 CPU "
        f"{trial.cpu_ms:.2f} ms/step{master}){note}"
    )


# --------------------------------------------------------------------------- report


def report(
    trials: list[Trial], systems: list[System], configs: list[Config]
) -> dict[tuple[str, Config], float]:
    """Print the table; each dlfleet system's median over torchrun's, per config."""
    say()
    say(
        f"{'config':14s} {'system':12s} {'trials':>6s} {'samples/s':>10s} {'step ms':>8s} "
        f"{'data':>6s} {'CPU ms':>7s} {'other':>6s}  samples/s per trial"
    )
    ratios: dict[tuple[str, Config], float] = {}
    for config in configs:
        medians: dict[str, float] = {}
        for system in systems:
            these = [t for t in trials if t.system == system and t.config == config]
            if not these:
                continue
            medians[system.name] = statistics.median(t.samples_per_s for t in these)
            step = statistics.median(t.step_ms for t in these)
            data = statistics.median(t.data_share for t in these)
            cpu = statistics.median(t.cpu_ms for t in these)
            other = statistics.median(t.other_load or 0.0 for t in these)
            each = " ".join(f"{t.samples_per_s:.0f}" for t in these)
            say(
                f"{config.label:14s} {system.name:12s} {len(these):>6d} "
                f"{medians[system.name]:>10.0f} {step:>8.2f} {data:>6.1%} {cpu:>7.2f} "
                f"{other:>6.2f}  {each}"
            )
        base = medians.get(TORCHRUN.name)
        for system in systems:
            if system == TORCHRUN or base is None or system.name not in medians:
                continue
            ratios[system.name, config] = medians[system.name] / base
            say(
                f"{config.label:14s} {system.name} / torchrun: {ratios[system.name, config]:.3f}"
                f" (median over median){paired(trials, system, config)}"
            )
    say(
        "(samples/s: median over the trials of timed steps x batch x ranks / seconds, timed "
        "by rank 0 inside the script; step ms: median of the trials' median step times; "
        "data: median share of the timed wall time rank 0 waited for its next batch; CPU ms: "
        "median of rank 0's process CPU time per timed step, all its threads; other: "
        "median of the cores the rest of the machine kept busy during a trial)"
    )
    notes = [t for t in trials if t.note]
    if notes:
        say()
        for t in notes:
            say(f"note: {t.system.name} trial {t.index} ({t.config.label}): {t.note}")
    return ratios


# --------------------------------------------------------------------------- main


def int_list(text: str, what: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        parser.error(f"{what} wants comma-separated integers")
    if not values or min(values) < 0:
        parser.error(f"{what} wants non-negative integers")
    return list(dict.fromkeys(values))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=None, help="trials per system (7)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 trials, the headline num_workers only (unless --num-workers says)",
    )
    parser.add_argument(
        "--num-workers", default=None, help="comma-separated DataLoader worker counts (0,2)"
    )
    parser.add_argument("--headline", type=int, default=0, help="num_workers of the ratio (0)")
    parser.add_argument(
        "--shard-batches",
        default="0",
        help="comma-separated dlfleet variants: global batches per shard, 0 for the "
        "master's default (0); the first is the headline",
    )
    parser.add_argument("--records", type=int, default=60_000, help="dataset size (60000)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch (32)")
    parser.add_argument("--item-work", type=int, default=2, help="tanh(x @ W) per record (2)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps (20)")
    parser.add_argument("--steps", type=int, default=800, help="timed steps (800)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per trial (180)")
    parser.add_argument("--keep", action="store_true", help="keep every trial's logs")
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=0.15,
        help="run a trial again (each system, bounded) when the rest of the machine kept "
        "more cores busy than this during it (0.15)",
    )
    args = parser.parse_args(argv)
    if args.trials is None:
        args.trials = 3 if args.quick else 7
    if args.num_workers is None:
        args.num_workers = str(args.headline) if args.quick else "0,2"
    args.configs = [Config(n) for n in int_list(args.num_workers, "--num-workers", parser)]
    shard_batches = int_list(args.shard_batches, "--shard-batches", parser)
    args.systems = [TORCHRUN, *(dlfleet_system(n) for n in shard_batches)]
    if args.trials < 1 or args.steps < 2 or args.warmup < 1 or args.batch_size < 1:
        parser.error("--trials, --steps, --warmup and --batch-size must be positive")
    per_epoch = -(-args.records // (args.batch_size * NPROC))
    if args.warmup + args.steps > per_epoch:
        parser.error(
            f"{args.warmup} + {args.steps} steps do not fit in one epoch of {args.records} "
            f"records ({per_epoch} steps of {args.batch_size} x {NPROC}): raise --records"
        )
    return args


def _terminate(signum: int, frame: FrameType | None) -> None:
    del frame
    raise KeyboardInterrupt(f"signal {signum}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    become_subreaper()  # the trials' orphans count as the trials' CPU, not the machine's
    configs: list[Config] = args.configs
    systems: list[System] = args.systems
    headline_config = Config(args.headline) if Config(args.headline) in configs else configs[0]
    headline_system = systems[1]
    root = Path(tempfile.mkdtemp(prefix="dlfleet-loader-bench-"))
    names = ", ".join(s.name for s in systems)
    say(
        f"loader benchmark: {args.trials} trial(s) per system ({names}) "
        f"and config ({', '.join(c.label for c in configs)}); 1 node x {NPROC} processes, "
        f"gloo, {args.records} records, batch {args.batch_size} per rank, {args.warmup} warm-up "
        f"+ {args.steps} timed steps; load average {load()}; logs in {root}"
    )
    started = time.monotonic()
    trials: list[Trial] = []
    disturbed: list[Trial] = []
    reruns_left = args.trials * len(systems) * len(configs)
    try:
        for index in range(args.trials):
            for config in configs:
                turn = index % len(systems)  # each system takes each place in turn
                for system in systems[turn:] + systems[:turn]:
                    trial = run_trial(system, config, index, args, root)
                    while (trial.other_load or 0.0) > args.max_other_load and reruns_left:
                        say(f"  {config.label} {system.name:12s} trial {index}: "
                            f"{describe(trial)}; DISTURBED, run again")  # fmt: skip
                        disturbed.append(trial)
                        reruns_left -= 1
                        trial = run_trial(system, config, index, args, root)
                    trials.append(trial)
                    say(f"  {config.label} {system.name:12s} trial {index}: {describe(trial)}")
    except BenchError as error:
        say(f"FAILED: {error}")
        say(f"(logs kept in {root})")
        say("ratio: n/a (a trial failed)")
        return 1
    except KeyboardInterrupt:
        say("interrupted; reporting the trials done so far")
    say(f"(the bench took {time.monotonic() - started:.0f} s; load average now {load()})")
    ratios = report(trials, systems, configs)
    if disturbed:
        say(
            f"({len(disturbed)} trial(s) run again: the rest of the machine kept more than "
            f"{args.max_other_load:g} cores busy during them)"
        )
    if not args.keep and not any(t.note for t in trials):
        shutil.rmtree(root, ignore_errors=True)
    say()
    ratio = ratios.get((headline_system.name, headline_config))
    if ratio is None:
        say(f"ratio: n/a (no {headline_config.label} trials of both systems)")
        return 1
    goal = "yes" if ratio >= GOAL_RATIO else "NO"
    say(
        f"goal: {headline_system.name}'s samples/s >= {GOAL_RATIO} x torchrun's at "
        f"{headline_config.label}: {goal}"
    )
    say(f"ratio: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

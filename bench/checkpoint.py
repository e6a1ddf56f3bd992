"""Checkpoint benchmark: how long a save holds the training step, dlfleet's
in-memory save against `torch.save` to the workdir and against
`torch.distributed.checkpoint.async_save`, with over 1 GB of model and
optimizer state per rank; and how long the restore takes, from memory and from
disk.

    python bench/checkpoint.py            # 3 trials, 4096 x 6 layers (~1.2 GB per rank)
    python bench/checkpoint.py --quick    # 2 trials, 2048 x 6 layers (~0.3 GB per rank)
    python bench/checkpoint.py --methods dlfleet,torch_save,torch_save_nosync,dcp_async
    python bench/checkpoint.py --device cuda      # the model on the GPU
    python bench/checkpoint.py --threads 4        # torch threads per rank (the copy uses them)
    python bench/checkpoint.py --sweep    # 4 state sizes, 2 trials each (~10 min)

The job (bench/_checkpoint_train.py, under the Python that runs this bench):
2 ranks on this machine under dlfleet's `dlworker` agent (`--nnodes 1:1
--nproc-per-node 2 --spares 0`) and a dlfleet master (`--min-nodes 1
--max-nodes 1`), gloo, one thread each: `--layers` Linear(`--width`,
`--width`) layers trained with AdamW on a batch of 4, replicated on both ranks
(no DDP: a one-element all_reduce per step keeps the ranks in lockstep; the
cost measured is the checkpoint's). The state saved is the parameters and
AdamW's two moments, 12 bytes per parameter (the exact size is printed):
dlfleet is given `{"model": model, "optim": optimizer}` (so that it may copy
them while the next step runs), the others `{"model": model.state_dict(),
"optim": optimizer.state_dict()}`.

Per method, a trial runs `--warmup` untimed saves (the first saves allocate:
dlfleet's image slots, the page cache) and then `--saves` timed ones, one
training step before each. The blocking time of a save is what the training
thread waits for:

* dlfleet: `Checkpointer.save(step, state)` (persist_every=0, in memory only),
  under the real agent and master, so its path includes the wait for a free
  image slot (the agent's word that an older step is committed and
  replicated: with states this large only two or three slots fit the slots'
  memory bound); plus the time the next step's optimizer.step() waited for
  the overlapped copy;
* torch_save: on rank 0 only, as DDP users do (the state is replicated; the
  other rank waits at the next step's all_reduce), `torch.save` into a new
  file in the trial's workdir (`--workdir`, default the system's temporary
  folder, on disk here) followed by flush and fsync;
* dcp_async: `dcp.async_save(state, checkpoint_id=<new folder in the
  workdir>)` with its defaults, on both ranks: the time until it returns (a
  fresh CPU staging copy); the upload then overlaps the next training step, and
  its future is waited for before the next save (reported apart);
* torch_save_nosync (only when asked for): torch.save without fsync (the fsync
  follows, untimed).

A save's figure is the slower rank's. Every method runs in the same processes
of the same trial; the order rotates from trial to trial so that the machine's
drift hits every method.

Restore, once per method and trial, into the live model and optimizer (one
more training step before, so that the restore has to bring the state back;
checked against a fingerprint of the saved state): `Checkpointer.load(template)`
from the agent's memory; `torch.load` + `load_state_dict` of the torch.save
file and `dcp.load` of the DCP folder, each first with the files evicted from
the page cache (a cold read from the disk, posix_fadvise DONTNEED) and then
again (from the page cache). Times are the slower rank's.

Memory: per method, the peak anonymous and shared-memory resident set of a
rank, and the peak size of the agent's image folder in /dev/shm (its image slots
per rank stay allocated for the whole run).

Per trial also: a plain memcpy of the state (one thread), the copy's limit
here; and steps/s with a checkpoint after every step — none, dlfleet, and
dcp.async_save (each waiting for the previous upload) — `--throughput-steps`
timed steps each, on a batch of `--throughput-batch` (512): the saves' batch
of 4 makes a step almost all `optimizer.step()`, which nothing trains like;
at 512 forward and backward are ~98% of a step on one CPU thread (printed),
still far more optimizer per step than an LLM's thousands of tokens per rank.
Smaller batches show the copy's cost on CPU, where it takes cores from the
training (`--throughput-batch 128`).

`--sweep` runs the trials at four state sizes (SWEEP: the quickstart's model
of ~5,400 parameters, then ~10 MB, ~100 MB and ~0.3 GB of parameters and
AdamW moments), with torch.save and DCP writing to /dev/shm (memory, as
dlfleet's images: the fastest a file can be written here), and the
throughput phase twice: on batches of 32 (a short step: milliseconds for the
small states) and with 0.1 s of sleep added to every step (a long step whose
compute runs on a device while the CPU idles). It prints one row per size
(median blocking per save of each method; steps/s with a save every step
over steps/s with none, short | long, for dlfleet and dcp.async_save), the
goal line (dlfleet blocks less than torch.save to /dev/shm at every size) and
`ratio: X`, X the smallest over the sizes of torch.save's median blocking
over dlfleet's.

Printed: per trial a line, then the tables (median, min, max over all timed
saves of all trials), dlfleet's copy beside memcpy, the per-step throughput,
the goal lines (torch.save / dlfleet >= 30x; a dlfleet save every step costs
at most 3% of the steps/s) and, last, `ratio: X` with X = median
dcp.async_save blocking time / median dlfleet blocking time (higher is
better; goal >= 5). Each trial has fresh ports, folders and an environment
marker; at its end every process carrying the marker is SIGKILLed and its
files (workdir and /dev/shm) are removed. A full run takes about 11 minutes on
a 2-core machine; `--quick` about 2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from _common import (
    BenchError,
    TrialError,
    exit_on_sigterm,
    kill_tagged,
    listening_port,
    log_tails,
    say,
    spawn_logged,
    trial_env,
)

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bench" / "_checkpoint_train.py"
PYTHON = Path(sys.executable)
METHODS = ("dlfleet", "torch_save", "dcp_async")
OPTIONAL = ("torch_save_nosync",)
NPROC = 2
TAG_ENV = "CHECKPOINT_BENCH_TAG"
GOAL_RATIO = 5.0  # dcp.async_save / dlfleet, median blocking per save
GOAL_TORCH_SAVE = 30.0  # torch.save / dlfleet
GOAL_THROUGHPUT = 0.97  # steps/s with a dlfleet save every step over steps/s with none
MASTER_READY_S = 30.0
CLEANUP_S = 15.0
POLL_S = 0.1
SLOTS = 2  # image slots per rank (dlfleet's ImageWriter)
SLOT_GROWTH = 1.125  # a slot's spare room (image.py's _GROWTH)
GB = 1e9
BUSY_CPUS = 0.25  # other work above this many CPUs on average skews a trial
MIB = 2**20
# --sweep's states, (name, width, layers): the quickstart's model (about 5,400
# parameters), then about 10 MB, 100 MB and 0.3 GB of parameters and moments.
SWEEP = (
    ("qs", 72, 1),
    ("10MB", 512, 3),
    ("100MB", 1024, 8),
    ("0.3GB", 2048, 6),
)
# A size's row: name, state bytes, median blocking per method, steps/s ratios short and long.
SweepRow = tuple[str, int, dict[str, float | None], dict[str, float], dict[str, float]]


def state_bytes(width: int, layers: int) -> int:
    """Parameters plus AdamW's two moments, float32 (the step counters aside)."""
    params = layers * (width * width + width)
    return 3 * 4 * params


# --------------------------------------------------------------------------- space


@dataclass(frozen=True)
class Needs:
    shm: int
    disk: int
    memory: int


def needs(nbytes: int, methods: list[str]) -> Needs:
    """What a trial takes at its peak: dlfleet's image slots in /dev/shm; two
    checkpoints on disk at once (the new one is written before the old is
    removed); per rank the live state and gradients, plus one staged copy (DCP)
    or loaded copy (torch.load)."""
    shm = int(NPROC * SLOTS * nbytes * SLOT_GROWTH) + 64 * MIB if "dlfleet" in methods else 0
    disk = 2 * nbytes + 256 * MIB
    per_rank = nbytes + nbytes // 3 + nbytes  # state, gradients, one copy
    return Needs(shm=shm, disk=disk, memory=shm + NPROC * per_rank + 512 * MIB)


def mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise BenchError("no MemAvailable in /proc/meminfo")


def check_space(need: Needs, workdir: Path, shm: Path) -> None:
    problems = []
    shm_free = shutil.disk_usage(shm).free
    disk_free = shutil.disk_usage(workdir).free
    memory = mem_available()
    if need.shm > shm_free:
        problems.append(
            f"{shm} has {shm_free / GB:.2f} GB free, the images need {need.shm / GB:.2f}"
        )
    if need.disk > disk_free:
        problems.append(
            f"{workdir} has {disk_free / GB:.2f} GB free, the checkpoints need {need.disk / GB:.2f}"
        )
    if need.memory > memory:
        problems.append(
            f"{memory / GB:.2f} GB of memory available, the run needs about {need.memory / GB:.2f}"
        )
    if problems:
        raise BenchError(
            "not enough room: "
            + "; ".join(problems)
            + " (check `df -h /dev/shm /tmp`; try --quick, a smaller --width/--layers, or "
            "--workdir/--shm-dir elsewhere)"
        )


# --------------------------------------------------------------------------- one trial


@dataclass
class TrialResult:
    index: int
    order: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    others: float = 0.0  # CPUs that work outside this bench kept busy, on average
    error: str = ""
    details: list[str] = field(default_factory=list)


class Trial:
    """The master, the agent and its two ranks of one trial, and their files."""

    def __init__(
        self, index: int, order: list[str], args: argparse.Namespace, root: Path, shm: Path
    ) -> None:
        self.index = index
        self.order = order
        self.args = args
        self.dir = root / f"trial-{index:02d}"
        self.dir.mkdir(parents=True)
        self.workdir = self.dir / "work"
        self.workdir.mkdir()
        self.shm = shm / f"trial-{index:02d}"
        self.shm.mkdir(parents=True)
        self.results = self.dir / "results.jsonl"
        self.tag = secrets.token_hex(8)
        self.env = trial_env(TAG_ENV, self.tag, DLFLEET_SHM_DIR=str(self.shm))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        proc, log = spawn_logged(argv, cwd=self.dir, env=self.env, log_path=self.log_path(name))
        self._logs.append(log)  # closed in cleanup()
        self.procs[name] = proc
        return proc

    def run(self, result: TrialResult) -> None:
        started = time.monotonic()
        self.spawn(
            "master",
            [
                str(PYTHON),
                "-m",
                "dlfleet.master",
                "--port",
                "0",
                "--store",
                f"sqlite:///{self.dir / 'm.db'}",
                "--min-nodes",
                "1",
                "--max-nodes",
                "1",
                "--last-call-timeout",
                "0.1",
            ],
        )
        port = self._master_port()
        agent = self.spawn(
            "agent",
            [
                str(PYTHON),
                "-m",
                "dlfleet.worker.agent.loop",
                "--nnodes",
                "1:1",
                "--nproc-per-node",
                str(NPROC),
                "--spares",
                "0",
                "--max-restarts",
                "0",
                "--master",
                f"127.0.0.1:{port}",
                "--node-name",
                "n0",
                "--log-dir",
                str(self.dir / "worker-logs"),
                str(TRAIN),
                "--results",
                str(self.results),
                "--workdir",
                str(self.workdir),
                "--methods",
                ",".join(self.order),
                "--trial",
                str(self.index),
                "--width",
                str(self.args.width),
                "--layers",
                str(self.args.layers),
                "--warmup",
                str(self.args.warmup),
                "--saves",
                str(self.args.saves),
                "--shm-dir",
                str(self.shm),
                "--device",
                self.args.device,
                "--threads",
                str(self.args.threads),
                "--throughput-steps",
                str(self.args.throughput_steps),
                "--throughput-batch",
                str(self.args.throughput_batch),
                "--long-step-s",
                str(self.args.long_step_s),
            ],
        )
        try:
            code = agent.wait(timeout=self.args.timeout)
        except subprocess.TimeoutExpired as exc:
            raise TrialError(
                f"the trial did not finish within {self.args.timeout:.0f} s", self.log_tails()
            ) from exc
        result.seconds = time.monotonic() - started
        result.records = read_results(self.results)
        if code != 0:
            raise TrialError(f"the agent exited with {code}", self.log_tails())
        done = {r["rank"] for r in result.records if r["kind"] == "done"}
        if done != set(range(NPROC)):
            raise TrialError(f"ranks {sorted(done)} of {NPROC} finished", self.log_tails())

    def _master_port(self) -> int:
        try:
            return listening_port(self.log_path("master"), self.procs["master"], MASTER_READY_S)
        except BenchError as exc:
            raise TrialError(str(exc), self.log_tails()) from None

    def log_tails(self, lines: int = 12) -> list[str]:
        paths = [self.log_path(name) for name in self.procs]
        paths += sorted((self.dir / "worker-logs").glob("**/*.log"))
        return log_tails(self.dir, paths, lines)

    def cleanup(self) -> list[int]:
        """SIGKILL every process of the trial; the pids still alive after CLEANUP_S."""
        left = kill_tagged(list(self.procs.values()), TAG_ENV, self.tag, CLEANUP_S)
        for log in self._logs:
            log.close()
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return left


def read_results(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    with suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with suppress(ValueError):
                records.append(json.loads(line))
    return records


def busy_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy since boot (iowait counts as idle)."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time of this process and of its reaped descendants (the agent reaps
    its workers, this bench the agent and the master)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


class OtherWork:
    """How many CPUs, on average, work other than this bench kept busy since
    its creation: the machine's busy time minus this bench's own."""

    def __init__(self) -> None:
        self._wall = time.monotonic()
        self._busy = busy_cpu_seconds()
        self._own = own_cpu_seconds()

    def cpus(self) -> float:
        busy = busy_cpu_seconds() - self._busy
        own = own_cpu_seconds() - self._own
        return max(0.0, busy - own) / max(time.monotonic() - self._wall, 1e-9)


def run_trial(
    index: int, order: list[str], args: argparse.Namespace, root: Path, shm: Path
) -> TrialResult:
    result = TrialResult(index, order)
    trial = Trial(index, order, args, root, shm)
    others = OtherWork()
    try:
        trial.run(result)
    except TrialError as exc:
        result.error, result.details = exc.reason, exc.details
    finally:
        left = trial.cleanup()
    result.others = others.cpus()
    if left:
        raise BenchError(f"trial {index}: processes {left} survived SIGKILL")
    if not result.error and not args.keep:
        shutil.rmtree(trial.dir, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- figures


def save_times(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per method, each timed save's blocking time (the slower rank's)."""
    per_save: dict[tuple[str, int, int], float] = defaultdict(float)
    for r in records:
        if r["kind"] == "save" and not r["warmup"]:
            key = (r["method"], r["trial"], r["index"])
            per_save[key] = max(per_save[key], float(r["blocked_s"]))
    out: dict[str, list[float]] = defaultdict(list)
    for (method, _, _), seconds in sorted(per_save.items()):
        out[method].append(seconds)
    return out


def slowest(records: list[dict[str, Any]], method: str, name: str) -> list[float]:
    """Per timed save of `method`, the largest `name` over the ranks."""
    found: dict[tuple[int, int], float] = {}
    for r in records:
        if r["kind"] == "save" and r["method"] == method and not r["warmup"] and name in r:
            key = (r["trial"], r["index"])
            found[key] = max(found.get(key, 0.0), float(r[name]))
    return list(found.values())


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def describe(result: TrialResult) -> str:
    load = f"other work {result.others:.2f} CPUs"
    if result.error:
        return f"FAILED: {result.error} ({load})"
    times = save_times(result.records)
    parts = [f"{m} {fmt(median(times.get(m, [])))} s" for m in result.order]
    return f"{result.seconds:.0f} s, {load}; median blocking per save: " + ", ".join(parts)


def report(results: list[TrialResult], args: argparse.Namespace, nbytes: int) -> None:
    records = [r for result in results for r in result.records]
    say()
    states = [r for r in records if r["kind"] == "state"]
    if states:
        s = states[0]
        say(
            f"state per rank: {s['bytes']} bytes ({s['bytes'] / GB:.3f} GB, "
            f"{s['bytes'] / 2**30:.3f} GiB): {s['params']} parameters + AdamW's 2 moments, "
            f"{s['tensors']} tensors; {s['world']} ranks; model built in {s['built_s']:.1f} s"
        )
        nbytes = int(s["bytes"])
    times = save_times(records)
    report_saves(records, times, args.methods, nbytes)
    report_copy(records, nbytes)
    throughput = report_throughput(records)
    report_restores(records, args.methods)
    report_memory(records, args.methods)
    sound = report_failures(results, records)
    busiest = max((r.others for r in results), default=0.0)
    if busiest > BUSY_CPUS:
        say()
        say(
            f"note: work outside this bench kept up to {busiest:.2f} of the "
            f"{os.cpu_count()} CPUs busy during a trial: a save that copies in memory "
            "(CPU-bound) loses more to that than one that waits for the disk, so the ratio "
            "is likely skewed against dlfleet; rerun on a quiet machine"
        )
    report_ratio(times, throughput, sound)


def report_saves(
    records: list[dict[str, Any]], times: dict[str, list[float]], methods: list[str], nbytes: int
) -> None:
    say()
    say(
        "blocking time per save (timed saves of all trials; each the slower rank's; cpu: the "
        "saving thread's CPU time, of the slower rank, median)"
    )
    say(
        f"{'method':18s} {'saves':>5s} {'median s':>9s} {'min s':>7s} {'max s':>7s} "
        f"{'GB/s':>6s} {'cpu s':>6s}"
    )
    for method in methods:
        values = times.get(method, [])
        med = median(values)
        rate = f"{nbytes / GB / med:.2f}" if med else "-"
        cpu = median(slowest(records, method, "cpu_s"))
        say(
            f"{method:18s} {len(values):>5d} {fmt(med):>9s} "
            f"{fmt(min(values) if values else None):>7s} "
            f"{fmt(max(values) if values else None):>7s} {rate:>6s} {fmt(cpu):>6s}"
        )
    if "dlfleet" in methods:
        own = slowest(records, "dlfleet", "checkpointer_blocked_s")
        say(f"  dlfleet: its own Checkpointer.blocked_s per save, median {fmt(median(own))} s")
    if "dcp_async" in methods:
        upload = slowest(records, "dcp_async", "upload_s")
        wait = slowest(records, "dcp_async", "upload_wait_s")
        say(
            f"  dcp_async: the upload after async_save returned took {fmt(median(upload))} s "
            f"(median, in the background); still to wait for when the next save came, "
            f"{fmt(median(wait))} s"
        )


RESTORE_SOURCES = {
    "memory": "memory (agent's /dev/shm)",
    "disk-cold": "disk, evicted from cache",
    "disk-warm": "disk, in the page cache",
}


def report_restores(records: list[dict[str, Any]], methods: list[str]) -> None:
    say()
    say("restore into the live model and optimizer (per trial, the slower rank's)")
    say(f"{'method':18s} {'from':26s} {'n':>3s} {'median s':>9s} {'min s':>7s} {'max s':>7s} ok")
    for method in methods:
        for source, label in RESTORE_SOURCES.items():
            rows = [
                r
                for r in records
                if r["kind"] == "restore" and r["method"] == method and r["source"] == source
            ]
            if not rows:
                continue
            per_trial: dict[int, float] = {}
            for r in rows:
                per_trial[r["trial"]] = max(per_trial.get(r["trial"], 0.0), float(r["seconds"]))
            values = list(per_trial.values())
            ok = sum(1 for r in rows if r["ok"])
            say(
                f"{method:18s} {label:26s} {len(values):>3d} {fmt(median(values)):>9s} "
                f"{fmt(min(values)):>7s} {fmt(max(values)):>7s} {ok}/{len(rows)}"
            )


def report_memory(records: list[dict[str, Any]], methods: list[str]) -> None:
    say()
    say(
        "memory during a method's saves (MiB, the larger rank, worst trial): resident "
        "anonymous memory at its peak and above its level when the method began; resident "
        "shared memory; the agent's image folder; the newest checkpoint on disk"
    )
    say(
        f"{'method':18s} {'RssAnon':>8s} {'added':>7s} {'RssShmem':>9s} "
        f"{'/dev/shm images':>16s} {'on disk':>8s}"
    )
    for method in methods:
        rows = [r for r in records if r["kind"] == "memory" and r["method"] == method]
        if not rows:
            continue
        anon = max(float(r.get("RssAnon", 0.0)) for r in rows)
        added = max(float(r.get("RssAnon", 0.0)) - float(r.get("start_RssAnon", 0.0)) for r in rows)
        shmem = max(float(r.get("RssShmem", 0.0)) for r in rows)
        folder = max(float(r.get("shm_folder", 0.0)) for r in rows)
        disk = max(int(r.get("disk_bytes", 0)) for r in rows)
        say(
            f"{method:18s} {anon:>8.0f} {added:>7.0f} {shmem:>9.0f} {folder:>16.0f} "
            f"{disk / MIB if disk else 0:>8.0f}"
        )


def report_failures(results: list[TrialResult], records: list[dict[str, Any]]) -> bool:
    """Print the failed trials and unsound restores; whether there were none."""
    failures = [r for r in results if r.error]
    bad = [r for r in records if r["kind"] == "restore" and not r["ok"]]
    if failures:
        say()
        say("failed trials:")
        for result in failures:
            say(f"  trial {result.index} ({','.join(result.order)}): {result.error}")
            for line in result.details:
                say(f"    {line}")
    if bad:
        say()
        say(f"restores that did not bring back the saved state: {len(bad)}")
        for r in bad:
            say(f"  trial {r['trial']} rank {r['rank']} {r['method']} {r['source']}")
    last_saved = {
        (r["trial"], r["rank"], r["method"]): r["step"] for r in records if r["kind"] == "save"
    }
    older = [
        r
        for r in records
        if r["kind"] == "restore" and r.get("step", -1) < last_saved.get(_key(r), -1)
    ]
    if older:
        say()
        say(
            f"restores of a step before the last save (its commit was still on its way; "
            f"load() restores only committed steps): {len(older)}"
        )
    return not failures and not bad


def _key(record: dict[str, Any]) -> tuple[Any, Any, Any]:
    return record["trial"], record["rank"], record["method"]


def report_copy(records: list[dict[str, Any]], nbytes: int) -> None:
    """dlfleet's overlapped copy beside a plain memcpy of the same bytes."""
    memcpy = [float(r["seconds"]) for r in records if r["kind"] == "memcpy"]
    copied = slowest(records, "dlfleet", "copied_s")
    ready = slowest(records, "dlfleet", "ready_s")
    held = slowest(records, "dlfleet", "held_s")
    if not memcpy or not copied:
        return
    say()
    say(
        "dlfleet's image, from the start of its copy (median over timed saves, the slower rank): "
        f"copied in {fmt(median(copied))} s ({nbytes / GB / (median(copied) or 1):.2f} GB/s, "
        f"while the next step's forward and backward ran), ready (checksums, header) in "
        f"{fmt(median(ready))} s; the next optimizer.step waited {fmt(median(held))} s for it"
    )
    fastest = min(memcpy)
    say(
        f"plain memcpy of the same bytes (one thread, nothing else running, best): "
        f"{fmt(fastest)} s, {nbytes / GB / fastest:.2f} GB/s"
    )


def throughput_ratios(records: list[dict[str, Any]], pace: str = "short") -> dict[str, float]:
    """Steps/s with a checkpoint every step over steps/s with none, per mode
    (the slower rank of each trial, median over trials), at `pace`."""
    per_trial: dict[tuple[str, int], float] = {}
    for r in records:
        if r["kind"] == "throughput" and r.get("pace", "short") == pace:
            key = (r["mode"], r["trial"])
            per_trial[key] = max(per_trial.get(key, 0.0), float(r["seconds"]) / r["steps"])
    rates = {}
    for mode in ("none", "dlfleet", "dcp_async"):
        seconds = [v for (m, _), v in per_trial.items() if m == mode]
        if seconds:
            rates[mode] = 1.0 / statistics.median(seconds)
    if "none" not in rates:
        return {}
    return {mode: rate / rates["none"] for mode, rate in rates.items()}


def report_throughput(records: list[dict[str, Any]]) -> dict[str, float]:
    """Steps/s with a checkpoint every step, per mode (the slower rank of each
    trial, median over trials); the ratios to no checkpoint."""
    per_trial: dict[tuple[str, int], float] = {}
    optimizer_share: list[float] = []  # of the step, with no checkpoint
    batch = None
    for r in records:
        if r["kind"] == "throughput" and r.get("pace", "short") == "short":
            key = (r["mode"], r["trial"])
            per_trial[key] = max(per_trial.get(key, 0.0), float(r["seconds"]) / r["steps"])
            batch = r.get("batch", batch)
            if r["mode"] == "none" and "optimizer_s" in r:
                optimizer_share.append(float(r["optimizer_s"]) / float(r["seconds"]))
    rates: dict[str, float] = {}
    for mode in ("none", "dlfleet", "dcp_async"):
        seconds = [v for (m, _), v in per_trial.items() if m == mode]
        if seconds:
            rates[mode] = 1.0 / statistics.median(seconds)
    if "none" not in rates:
        return {}
    say()
    say(
        f"training with a checkpoint after every step (steps/s, median over trials; batch {batch}"
        + (
            f": optimizer.step() {statistics.median(optimizer_share):.1%} of a step with no "
            "checkpoint, forward and backward the rest)"
            if optimizer_share
            else ")"
        )
    )
    for mode, rate in rates.items():
        say(f"  {mode:10s} {rate:7.3f} steps/s  {rate / rates['none']:.3f} of no checkpoint")
    return {mode: rate / rates["none"] for mode, rate in rates.items()}


def report_ratio(times: dict[str, list[float]], throughput: dict[str, float], sound: bool) -> None:
    say()
    dl = median(times.get("dlfleet", []))
    ts = median(times.get("torch_save", []))
    da = median(times.get("dcp_async", []))
    if dl and ts is not None:
        verdict = "yes" if ts / dl >= GOAL_TORCH_SAVE else "NO"
        say(
            f"torch.save / dlfleet (median blocking per save): {ts / dl:.2f}x, goal >= "
            f"{GOAL_TORCH_SAVE:.0f}x: {verdict}"
        )
    if "dlfleet" in throughput:
        verdict = "yes" if throughput["dlfleet"] >= GOAL_THROUGHPUT else "NO"
        say(
            f"steps/s with a dlfleet save every step / with none: {throughput['dlfleet']:.3f}, "
            f"goal >= {GOAL_THROUGHPUT}: {verdict}"
        )
    if not dl or da is None:
        say(f"goal: dcp.async_save / dlfleet >= {GOAL_RATIO:.0f}x: NO (no figure)")
        say("ratio: n/a (needs timed dlfleet and dcp_async saves)")
        return
    ratio = da / dl
    goal = "yes" if ratio >= GOAL_RATIO and sound else "NO"
    say(
        f"goal: dcp.async_save / dlfleet (median blocking per save) >= {GOAL_RATIO:.0f}x, every "
        f"trial and restore sound: {goal}"
    )
    say(f"ratio: {ratio:.2f}")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 trials of 3 saves, ~0.3 GB")
    parser.add_argument("--trials", type=int, default=None, help="trials (3; quick 2)")
    parser.add_argument("--saves", type=int, default=None, help="timed saves per method (5; 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed saves per method (2)")
    parser.add_argument("--width", type=int, default=None, help="layer width (4096; 2048)")
    parser.add_argument("--layers", type=int, default=6, help="Linear layers (6)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per trial (400)")
    parser.add_argument("--workdir", default=None, help="where trials write (system temp)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the images go (/dev/shm)")
    parser.add_argument("--keep", action="store_true", help="keep the trials' logs")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the model lives (cpu)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    parser.add_argument(
        "--throughput-steps",
        type=int,
        default=None,
        help="timed steps per mode with a checkpoint every step (6; quick 8; 0: none)",
    )
    parser.add_argument(
        "--throughput-batch",
        type=int,
        default=None,
        help="the batch of the throughput phase (512: forward and backward most of the step; "
        "sweep 32)",
    )
    parser.add_argument(
        "--long-step-s",
        type=float,
        default=None,
        help="a second throughput phase with this much sleep added to each step (0; sweep 0.1)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="state sizes from the quickstart's model to 0.3 GB; torch.save to /dev/shm",
    )
    args = parser.parse_args(argv)
    _defaults(args)
    _check(args, parser)
    return args


def _defaults(args: argparse.Namespace) -> None:
    if args.throughput_batch is None:
        args.throughput_batch = 32 if args.sweep else 512
    if args.long_step_s is None:
        args.long_step_s = 0.1 if args.sweep else 0.0
    if args.sweep and args.trials is None:
        args.trials = 2
    if args.sweep and args.workdir is None:
        args.workdir = args.shm_dir  # torch.save and DCP write to memory too
    if args.trials is None:
        args.trials = 2 if args.quick else 3
    if args.saves is None:
        args.saves = 3 if args.quick else 5
    if args.width is None:
        args.width = 2048 if args.quick else 4096
    if args.timeout is None:
        args.timeout = 150.0 if args.quick else 400.0
    if args.throughput_steps is None:
        args.throughput_steps = 8 if args.quick else 6
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    known = METHODS + OPTIONAL
    if not args.methods or any(m not in known for m in args.methods):
        parser.error(f"--methods wants some of {', '.join(known)}")
    if len(set(args.methods)) != len(args.methods):
        parser.error("--methods names a method twice")
    if args.trials < 1 or args.saves < 1 or args.warmup < 0:
        parser.error("--trials and --saves must be positive, --warmup not negative")
    if args.threads < 1:
        parser.error("--threads must be positive")
    if args.throughput_batch < 1:
        parser.error("--throughput-batch must be positive")
    if args.long_step_s < 0:
        parser.error("--long-step-s must not be negative")
    if args.width < 1 or args.layers < 1 or args.timeout <= 0:
        parser.error("--width, --layers and --timeout must be positive")


def run_trials(
    args: argparse.Namespace, root: Path, shm: Path, results: list[TrialResult] | None = None
) -> list[TrialResult]:
    """`args.trials` trials, appended to `results` as each ends (kept if interrupted)."""
    results = [] if results is None else results
    for index in range(args.trials):
        shift = index % len(args.methods)
        order = args.methods[shift:] + args.methods[:shift]
        result = run_trial(index, order, args, root, shm)
        results.append(result)
        say(f"  trial {index} ({', '.join(order)}): {describe(result)}")
    return results


def sweep(args: argparse.Namespace) -> int:
    """Per state size of SWEEP: median blocking per save of every method,
    and steps/s with a save every step over none, on short and long steps.
    The headline: the smallest ratio over the sizes of torch.save's blocking
    (to /dev/shm) to dlfleet's (goal: above 1 at every size)."""
    say(
        f"checkpoint sweep: {len(SWEEP)} sizes x {args.trials} trial(s) x {len(args.methods)} "
        f"methods ({', '.join(args.methods)}), {args.warmup} warm-up + {args.saves} timed saves "
        f"each; torch.save and DCP write to {args.workdir}; steps/s on batches of "
        f"{args.throughput_batch} (short) and with {args.long_step_s:.2f} s of sleep added "
        f"to each step (long: a device's compute)"
    )
    started = time.monotonic()
    rows: list[SweepRow] = []
    failed = False
    for name, width, layers in SWEEP:
        args.width, args.layers = width, layers
        nbytes = state_bytes(width, layers)
        workdir, shm_base = Path(args.workdir), Path(args.shm_dir)
        try:
            check_space(needs(nbytes, args.methods), workdir, shm_base)
        except BenchError as exc:
            say(f"  {name}: skipped: {exc}")
            failed = True
            continue
        say(f"{name} state: {layers} x Linear({width}, {width}) + AdamW, ~{nbytes / 1e6:.2f} MB")
        root = Path(tempfile.mkdtemp(prefix="dlfleet-ckpt-sweep-", dir=workdir))
        shm = Path(tempfile.mkdtemp(prefix="dlfleet-ckpt-sweep-", dir=shm_base))
        try:
            results = run_trials(args, root, shm)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
        failed = failed or any(r.error for r in results)
        records = [r for result in results for r in result.records]
        states = [r for r in records if r["kind"] == "state"]
        size = int(states[0]["bytes"]) if states else nbytes
        times = save_times(records)
        medians = {m: median(times.get(m, [])) for m in args.methods}
        short, long_ = throughput_ratios(records, "short"), throughput_ratios(records, "long")
        rows.append((name, size, medians, short, long_))
    say(f"(the sweep took {time.monotonic() - started:.0f} s)")
    return report_sweep(rows, args, failed)


def report_sweep(rows: list[SweepRow], args: argparse.Namespace, failed: bool) -> int:
    say()
    say("median blocking per save (ms; the slower rank) and steps/s with a save every step")
    say("over steps/s with none (short step | long step):")
    head = "  ".join(f"{m:>14s}" for m in args.methods)
    say(f"  {'state':>14s}  {head}  {'dlfleet steps/s':>21s}  {'dcp_async steps/s':>21s}")
    ratios = []
    for name, size, medians, short, long_ in rows:
        cells = "  ".join(
            f"{'-' if v is None else f'{v * 1000:.2f}':>14s}" for v in medians.values()
        )
        paces = [
            f"{fmt(short.get(m))} | {fmt(long_.get(m))}".rjust(21) for m in ("dlfleet", "dcp_async")
        ]
        say(f"  {name:>7s} {size / 1e6:6.2f}MB  {cells}  {paces[0]}  {paces[1]}")
        dl, ts = medians.get("dlfleet"), medians.get("torch_save")
        if dl and ts is not None:
            ratios.append(ts / dl)
    say()
    if not ratios or len(ratios) < len(SWEEP):
        say("goal: dlfleet blocks less than torch.save to /dev/shm at every size: NO (no figure)")
        say("ratio: n/a (needs timed dlfleet and torch_save saves at every size)")
        return 1
    verdict = "yes" if min(ratios) > 1 and not failed else "NO"
    say(
        "goal: dlfleet blocks less than torch.save to /dev/shm at every size (torch.save / "
        f"dlfleet: {', '.join(f'{r:.1f}x' for r in ratios)}): {verdict}"
    )
    say(f"ratio: {min(ratios):.2f}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    if args.sweep:
        return sweep(args)
    nbytes = state_bytes(args.width, args.layers)
    workdir = Path(args.workdir or tempfile.gettempdir())
    shm_base = Path(args.shm_dir)
    try:
        check_space(needs(nbytes, args.methods), workdir, shm_base)
    except BenchError as exc:
        say(f"checkpoint benchmark: {exc}")
        return 2
    root = Path(tempfile.mkdtemp(prefix="dlfleet-ckpt-bench-", dir=workdir))
    shm = Path(tempfile.mkdtemp(prefix="dlfleet-ckpt-bench-", dir=shm_base))
    say(
        f"checkpoint benchmark: {args.trials} trial(s) x {len(args.methods)} methods "
        f"({', '.join(args.methods)}), {args.warmup} warm-up + {args.saves} timed saves each; "
        f"{NPROC} ranks under dlworker, gloo, {args.layers} x Linear({args.width}, {args.width}) "
        f"+ AdamW on {args.device} ({args.threads} torch thread(s) per rank): "
        f"~{nbytes / GB:.2f} GB of state per rank; workdir {root}, images in {shm}"
    )
    started = time.monotonic()
    results: list[TrialResult] = []
    try:
        run_trials(args, root, shm, results)
    except KeyboardInterrupt:
        say("interrupted; reporting the trials done so far")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if not args.keep and not any(r.error for r in results):
            shutil.rmtree(root, ignore_errors=True)
    say(f"(the bench took {time.monotonic() - started:.0f} s)")
    report(results, args, nbytes)
    return 0 if results and not any(r.error for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Frameworks benchmark: a Hugging Face `Trainer` job and a PyTorch Lightning
job, each alone (stock torchrun, the framework's own checkpoints) and with
dlfleet's integration (dlworker agents and a dlfleet master), side by side,
through a killed worker and a lost node.

    python bench/frameworks.py               # 2 trials of each case
    python bench/frameworks.py --quick       # 1 trial of each case
    python bench/frameworks.py --frameworks hf --faults worker --keep

The jobs: tests/e2e/scripts/hf_ledger_train.py (a tiny GPT-2 built from a
config, `DLFleetTrainer`, or HF's `Trainer` with `--stock`) and
tests/e2e/scripts/lightning_ledger_train.py (a small MLP, Lightning's
`DLFleetTrainer` and the loader, or with `--stock` a DataLoader,
Lightning's own environment and a `ModelCheckpoint`), under the Python that
runs this bench. Every rank logs the records it trains at every step, with a
wall-clock stamp (the ledger of tests/e2e/ledger.py). 2 nodes x 1 process on
this machine over 127.0.0.1, gloo.

* stock: two `torchrun --nnodes 1:2 --nproc-per-node 1 --max-restarts 3
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P --monitor-interval 0.1`,
  the script with `--stock`: the framework checkpoints every `--save-every`
  steps and a restarted script resumes from its newest checkpoint (HF's
  `resume_from_checkpoint`, Lightning's `ckpt_path` of `last.ckpt`).
* dlfleet: `python -m dlfleet.master --min-nodes 1 --max-nodes 2` and two
  `dlworker --nnodes 1:2 --nproc-per-node 1 --max-restarts 3` agents, the
  script as it is (every step checkpointed in memory, replicated to the peer).

A trial: start, wait until rank 0 logged `--kill-after` steps, then SIGKILL
rank 1's worker process (fault "worker") or every process of node B (fault
"node": its agent or torchrun with its worker; nothing replaces it, the
world goes on at 1), and wait for node A's launcher to exit. Then:
- recovered: node A's launcher exited 0 and a step was logged after the kill
  by a newer attempt;
- twice / never: records of the epochs trained more than once / never by the
  model that finished (the ledger's final lineage: a step rolled back by a
  restore does not count);
- kill -> next step: from the kill to the first step logged by a newer
  attempt;
- steps/s: rank 0's steps before the kill, after the first `--warmup` (100):
  the rate over most of a job's life. The kill comes at step `--kill-after`
  (1200, of 1600 a data epoch at world size 2, 2 epochs; failures come at
  any time in a long job, seldom in its first seconds). The first steps of a
  process (DDP's first buckets, and for dlfleet the round's first 16 saves,
  which every="auto" makes at every step to measure their cost) are not
  counted. dlworker's spare is primed with the first workers (it imports
  what the script imports while they import it); what it does once the
  script opts in (runs up to `elastic.run`) is counted.
- start -> step: from starting the launchers to rank 0's first step; a
  primed spare's imports compete with the workers' own there.
- steps/s after: rank 0's rate after the kill (newer attempt, its first
  `--warmup` steps not counted). For dlfleet it includes the new spare
  started 3 s into the round that replaces the one used (its start takes
  CPU from the ranks on this 2-core machine).

Printed per framework, fault and system: trials recovered, medians of those
figures; then dlfleet's steps/s over the stock job's (goal >= 0.97), and,
last, `ratio: X`: the median over the framework x fault cases of the stock
job's kill -> next step over dlfleet's (a stock trial that did not recover
counts as `--timeout`, so X is then a lower bound). Goals: 0 twice and 0
never for dlfleet in every trial; X >= 5.
"""

from __future__ import annotations

import argparse
import json
import os
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
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
for _extra in (ROOT / "bench", ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from _common import (  # noqa: E402
    BenchError,
    exit_on_sigterm,
    free_port,
    kill_tagged,
    listening_port,
    log_tails,
    say,
    spawn_logged,
    tagged_pids,
    trial_env,
)
from e2e.ledger import check, read_ledger  # noqa: E402

PYTHON = Path(sys.executable)
SCRIPTS = ROOT / "tests" / "e2e" / "scripts"
SCRIPT = {"hf": SCRIPTS / "hf_ledger_train.py", "lightning": SCRIPTS / "lightning_ledger_train.py"}
TAG_ENV = "DLFLEET_BENCH_FRAMEWORKS"
NODE_ENV = "DLFLEET_BENCH_NODE"
NODES = ("node-a", "node-b")
EPOCHS = 2


@dataclass
class Outcome:
    framework: str
    fault: str
    system: str
    recovered: bool
    twice: int | None = None
    never: int | None = None
    kill_to_step_s: float | None = None
    steps_per_s: float | None = None
    start_to_step_s: float | None = None
    steps_per_s_after: float | None = None
    note: str = ""


class Trial:
    def __init__(
        self,
        root: Path,
        index: int,
        framework: str,
        fault: str,
        system: str,
        args: argparse.Namespace,
    ) -> None:
        self.framework, self.fault, self.system, self.args = framework, fault, system, args
        self.dir = root / f"{index:02d}-{framework}-{fault}-{system}"
        self.dir.mkdir(parents=True)
        self.ledger = self.dir / "ledger"
        self.tag = secrets.token_hex(8)
        self.env = trial_env(TAG_ENV, self.tag)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started = 0.0  # wall clock: when the launchers were started
        self._logs: list[IO[bytes]] = []

    def spawn(self, name: str, argv: list[str]) -> None:
        # Every process of a node (launcher, workers, spares) carries its name.
        env = {**self.env, NODE_ENV: name}
        proc, log = spawn_logged(argv, cwd=self.dir, env=env, log_path=self.dir / f"{name}.log")
        self._logs.append(log)
        self.procs[name] = proc

    def script(self) -> list[str]:
        argv = [
            str(SCRIPT[self.framework]),
            "--ledger-dir", str(self.ledger),
            "--size", str(self.args.size),
            "--batch-size", str(self.args.batch_size),
            "--epochs", str(EPOCHS),
        ]  # fmt: skip
        if self.system == "stock":
            flag = "--save-steps" if self.framework == "hf" else "--save-every"
            argv += ["--stock", flag, str(self.args.save_every)]
        return argv

    def start(self) -> None:
        self.started = time.time()
        if self.system == "dlfleet":
            self.spawn(
                "master",
                [
                    str(PYTHON), "-m", "dlfleet.master", "--port", "0",
                    "--store", f"sqlite:///{self.dir / 'm.db'}",
                    "--min-nodes", "1", "--max-nodes", "2", "--last-call-timeout", "0.5",
                ],
            )  # fmt: skip
            port = listening_port(self.dir / "master.log", self.procs["master"], 60)
            for node in NODES:
                self.spawn(
                    node,
                    [
                        str(PYTHON), "-m", "dlfleet.worker.agent.loop",
                        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
                        "--monitor-interval", "0.1", "--master", f"127.0.0.1:{port}",
                        "--node-name", node, *self.script(),
                    ],
                )  # fmt: skip
            return
        port = free_port()
        for node in NODES:
            self.spawn(
                node,
                [
                    str(PYTHON), "-m", "torch.distributed.run",
                    "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", f"frameworks-{self.tag}",
                    "--rdzv-conf", f"is_host={1 if node == NODES[0] else 0}",
                    "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
                    *self.script(),
                ],
            )  # fmt: skip

    def steps(self) -> list[tuple[int, int, float]]:
        """(attempt, rank, t) of every step logged so far."""
        if not self.ledger.exists():
            return []
        entries, _, _ = read_ledger(self.ledger)
        return [(e.attempt, e.rank, e.t or 0.0) for e in entries]

    def rank0_steps(self) -> int:
        """Rank 0's steps logged so far (its lines counted, not parsed: the
        bench polls while the job trains, on the same cores)."""
        total = 0
        for path in self.ledger.glob("ledger-*-r0.jsonl"):
            with suppress(OSError), path.open("rb") as lines:
                total += sum(1 for _ in lines)
        return total

    def wait_steps(self, count: int) -> None:
        deadline = time.monotonic() + self.args.timeout
        while self.rank0_steps() < count:
            if time.monotonic() > deadline:
                raise BenchError(f"fewer than {count} steps within {self.args.timeout:.0f} s")
            if any(self.procs[n].poll() is not None for n in NODES):
                raise BenchError("a node ended before the kill")
            time.sleep(0.1)

    def worker_pid(self, rank: int) -> int:
        """The training process of `rank` (not a launcher, not a spare)."""
        script = str(SCRIPT[self.framework]).encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            mine = f"{TAG_ENV}={self.tag}".encode() in environ
            is_rank = f"RANK={rank}".encode() in environ and comm != "dlfleet-spare"
            launcher = (
                b"torch.distributed.run" in cmdline or b"dlfleet.worker.agent.loop" in cmdline
            )
            if mine and is_rank and script in cmdline and not launcher:
                return int(entry)
        raise BenchError(f"no worker process of rank {rank}")

    def kill(self) -> float:
        if self.fault == "worker":
            pid = self.worker_pid(1)
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            return killed
        # The machine is lost: every process of node B at once (torchrun's
        # workers live in sessions of their own, a killpg would miss them).
        pids = [pid for pid in tagged_pids(TAG_ENV, self.tag) if self._on_node(pid, NODES[1])]
        killed = time.time()
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    @staticmethod
    def _on_node(pid: int, node: str) -> bool:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return f"{NODE_ENV}={node}".encode() in environ

    def run(self) -> Outcome:
        outcome = Outcome(self.framework, self.fault, self.system, recovered=False)
        try:
            self.start()
            self.wait_steps(self.args.kill_after)
            killed = self.kill()
            survivor = self.procs[NODES[0]]
            try:
                code = survivor.wait(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:
                code = None
            if self.fault == "worker" and code == 0:
                with suppress(subprocess.TimeoutExpired):
                    self.procs[NODES[1]].wait(timeout=30)
            self.measure(outcome, killed, code)
        except BenchError as exc:
            outcome.note = str(exc)
        finally:
            kill_tagged(list(self.procs.values()), TAG_ENV, self.tag, 15)
            for log in self._logs:
                log.close()
        if not outcome.recovered and self.args.verbose:
            paths = [self.dir / f"{n}.log" for n in ("master", *NODES)]
            for line in log_tails(self.dir, paths, 15):
                say(line)
        return outcome

    def measure(self, outcome: Outcome, killed: float, code: int | None) -> None:
        steps = self.steps()
        before = sorted(t for a, r, t in steps if r == 0 and t < killed)
        warmup = self.args.warmup
        if len(before) > warmup + 1:
            outcome.steps_per_s = (len(before) - warmup - 1) / (before[-1] - before[warmup])
        if before:
            outcome.start_to_step_s = before[0] - self.started
        kill_attempt = max((a for a, _, t in steps if t < killed), default=0)
        after = [t for a, _, t in steps if a > kill_attempt and t > killed]
        rank0_after = sorted(t for a, r, t in steps if r == 0 and a > kill_attempt and t > killed)
        if len(rank0_after) > warmup + 1:
            outcome.steps_per_s_after = (len(rank0_after) - warmup - 1) / (
                rank0_after[-1] - rank0_after[warmup]
            )
        if after:
            outcome.kill_to_step_s = min(after) - killed
        outcome.recovered = code == 0 and bool(after)
        if code != 0:
            outcome.note = f"node A's launcher exited {code}" if code is not None else "timed out"
        if outcome.recovered:
            report = check(self.ledger, size=self.args.size, epochs=EPOCHS)
            outcome.twice = sum(n - 1 for e in report.epochs for n in e.duplicates.values())
            outcome.never = sum(len(e.missing) for e in report.epochs)
            if report.problems:
                outcome.note = "; ".join(report.problems[:2])


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(outcomes: list[Outcome], args: argparse.Namespace) -> int:
    say()
    say(
        "framework  fault   system   recovered  twice  never  kill->step s  steps/s"
        "  start->step s  steps/s after  notes"
    )
    ratios: list[float] = []
    speed: list[float] = []
    exact = True
    for framework in args.frameworks:
        for fault in args.faults:
            medians: dict[str, float | None] = {}
            rates: dict[str, float | None] = {}
            for system in ("stock", "dlfleet"):
                mine = [
                    o
                    for o in outcomes
                    if (o.framework, o.fault, o.system) == (framework, fault, system)
                ]
                ok = [o for o in mine if o.recovered]
                times = [o.kill_to_step_s for o in ok if o.kill_to_step_s is not None]
                if system == "stock":  # a stock job that never recovered: the whole limit
                    times += [args.timeout] * (len(mine) - len(ok))
                medians[system] = median(times)
                rates[system] = median([o.steps_per_s for o in mine if o.steps_per_s])
                start = median([o.start_to_step_s for o in mine if o.start_to_step_s])
                after = median([o.steps_per_s_after for o in ok if o.steps_per_s_after])
                twice = median([float(o.twice) for o in ok if o.twice is not None])
                never = median([float(o.never) for o in ok if o.never is not None])
                if system == "dlfleet" and (
                    len(ok) < len(mine) or any(o.twice or o.never for o in ok)
                ):
                    exact = False
                notes = "; ".join(sorted({o.note for o in mine if o.note}))[:120]
                say(
                    f"{framework:<10} {fault:<7} {system:<8} {len(ok)}/{len(mine):<8} "
                    f"{fmt(twice, 0):>5}  {fmt(never, 0):>5}  {fmt(medians[system]):>12}  "
                    f"{fmt(rates[system], 1):>7}  {fmt(start):>13}  {fmt(after, 1):>13}  {notes}"
                )
            stock_t, fleet_t = medians["stock"], medians["dlfleet"]
            if stock_t is not None and fleet_t:
                ratios.append(stock_t / fleet_t)
            if rates["stock"] and rates["dlfleet"]:
                speed.append(rates["dlfleet"] / rates["stock"])
    say()
    speed_ratio = median(speed)
    say(
        f"steps/s with dlfleet / stock (median over cases): {fmt(speed_ratio, 3)}, goal >= 0.97: "
        f"{'yes' if speed_ratio is not None and speed_ratio >= 0.97 else 'no'}"
    )
    say(f"dlfleet exactly once and recovered in every trial: {'yes' if exact else 'no'}")
    ratio = median(ratios)
    say(f"stock kill->step / dlfleet's per case: {', '.join(f'{r:.2f}' for r in ratios)}")
    say(f"goal: ratio >= 5: {'yes' if ratio is not None and ratio >= 5 else 'no'}")
    say(f"ratio: {fmt(ratio)}")
    return 0 if ratio is not None else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 trial of each case")
    parser.add_argument("--frameworks", nargs="+", default=["hf", "lightning"])
    parser.add_argument("--faults", nargs="+", default=["worker", "node"])
    parser.add_argument("--size", type=int, default=12800, help="records (a multiple of 8)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=20, help="the stock checkpoints' steps")
    parser.add_argument("--kill-after", type=int, default=1200, help="rank 0's steps")
    parser.add_argument(
        "--warmup", type=int, default=100, help="rank 0's first steps, not in steps/s"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds, per wait")
    parser.add_argument("--keep", action="store_true", help="keep the trials' folders")
    parser.add_argument("--verbose", action="store_true", help="log tails of failed trials")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.kill_after - 1:
        parser.error(f"--warmup must be >= 0 and below --kill-after - 1, got {args.warmup}")
    if args.quick:
        args.trials = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="dlfleet-bench-frameworks-"))
    say(f"bench/frameworks.py: {args.trials} trial(s) of each case in {root}")
    outcomes: list[Outcome] = []
    index = 0
    try:
        for trial in range(args.trials):
            for framework in args.frameworks:
                for fault in args.faults:
                    # Alternate which system goes first, so machine drift hits both.
                    order = ("stock", "dlfleet") if trial % 2 == 0 else ("dlfleet", "stock")
                    for system in order:
                        outcome = Trial(root, index, framework, fault, system, args).run()
                        index += 1
                        outcomes.append(outcome)
                        say(f"  {json.dumps(outcome.__dict__)}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return report(outcomes, args)


if __name__ == "__main__":
    sys.exit(main())

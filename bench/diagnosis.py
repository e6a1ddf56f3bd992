"""Diagnosis benchmark: a node's GPU breaks mid-run; how long until the job
trains again on a healthy node, when the failure is diagnosed and the node
replaced at once (dlfleet), against the restart-in-place policy (restart on
the same node until `max_restarts` are spent, then replace it), same job,
same machine, trials alternating.

    python bench/diagnosis.py             # 4 trials per policy
    python bench/diagnosis.py --trials 2  # quicker

The job (bench/_diagnosis_train.py, under the Python that runs this bench): a
dlfleet master (`--min-nodes 2 --max-nodes 2`: a job of fixed size, which
cannot train without its second node) and two `dlworker` agents, nodeA and
nodeB, one DDP rank each over gloo, trained through `dlfleet.elastic.run`
with an in-memory checkpoint every step, 50 ms steps; all on this machine.

A trial: wait until both nodes trained 10 steps together, then break nodeB's
"GPU" (a file the training script looks for: every process of nodeB from then
on fails as one on a GPU that fell off the bus, with the driver's Xid line on
stderr and "CUDA error: unspecified launch failure"), noting the time. The
bench plays the platform: when nodeB's agent exits, for whatever reason, it
starts nodeC, a healthy replacement, at once. Measured: from the fault to the
first step completed by nodeC (the job training again at its full size, on
healthy nodes only), and to nodeB's exit.

Policies (only the agents' flags differ; `--max-restarts 3` for all):

* dlfleet: diagnosis on (the default): nodeB's first failure matches the rule
  `gpu-hardware`, its agent leaves at once (exit 4: replace me), and nodeC
  joins warm (its process pre-started while it registers).
* restart-in-place, torchrun-style (`--diagnosis off --spares 0`): nodeB's
  workers are restarted on nodeB, cold, three times (each fails again),
  then its agent exits 1 and nodeC replaces it; the reference of the issue.
* restart-in-place, warm (`--diagnosis off`, a spare process): the same with
  dlfleet's pre-started spares, so that a restart costs no cold start:
  printed for comparison.

Printed: a line per trial; per policy the median and range of both times;
then `ratio (warm restarts): X` and, last, `ratio: X` with X = the median
fault-to-training time of the torchrun-style policy / dlfleet's (higher is
better; goal >= 3). Each trial has fresh ports, folders and an environment
marker; at its end every process carrying the marker is SIGKILLed. A run of
4 trials per policy takes about 5 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from _common import (
    BenchError,
    TrialError,
    exit_on_sigterm,
    kill_tagged,
    listening_port,
    say,
    spawn_logged,
)

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bench" / "_diagnosis_train.py"
PYTHON = Path(sys.executable)
TAG_ENV = "DIAGNOSIS_BENCH_TAG"
POLICIES = {
    "dlfleet": [],
    "in-place-cold": ["--diagnosis", "off", "--spares", "0"],
    "in-place-warm": ["--diagnosis", "off"],
}
REFERENCE = "in-place-cold"
GOAL_RATIO = 3.0
WARM_STEPS = 10  # steps both nodes train together before the fault
MASTER_READY_S = 30.0
CLEANUP_S = 15.0
POLL_S = 0.05


@dataclass
class Result:
    policy: str
    index: int
    to_training_s: float | None = None  # fault -> first step of nodeC
    to_exit_s: float | None = None  # fault -> nodeB's agent exited
    exit_code: int | None = None  # nodeB's agent's
    error: str = ""
    details: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    at: float
    node: str
    step: int


def read_steps(path: Path) -> list[Step]:
    steps = []
    with suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                steps.append(Step(float(parts[0]), parts[4].partition("#")[0], int(parts[3])))
    return steps


class Trial:
    def __init__(self, policy: str, index: int, root: Path) -> None:
        self.policy = policy
        self.dir = Path(tempfile.mkdtemp(prefix=f"{index:02d}-{policy}-", dir=root))
        self.tag = secrets.token_hex(8)
        self.steps = self.dir / "steps.log"
        self.fault = self.dir / "fault"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self.env = {
            **os.environ,
            TAG_ENV: self.tag,
            "DLFLEET_TOKEN": secrets.token_hex(16),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        proc, log = spawn_logged(argv, cwd=self.dir, env=self.env, log_path=self.log(name))
        self._logs.append(log)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def agent(self, name: str, port: int) -> subprocess.Popen[bytes]:
        return self.spawn(
            name,
            [
                str(PYTHON), "-m", "dlfleet.worker.agent.loop",
                "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "3",
                "--monitor-interval", "0.1", "--master", f"127.0.0.1:{port}",
                "--node-name", name, "--log-dir", str(self.dir / "worker-logs" / name),
                "--tee", "3", *POLICIES[self.policy],
                str(TRAIN), "--step-log", str(self.steps), "--fault-file", str(self.fault),
                "--bad-node", "nodeB",
            ],
        )  # fmt: skip

    def run(self, result: Result, timeout_s: float) -> None:
        master = self.spawn(
            "master",
            [
                str(PYTHON), "-m", "dlfleet.master", "--port", "0",
                "--store", f"sqlite:///{self.dir / 'm.db'}", "--min-nodes", "2",
                "--max-nodes", "2", "--last-call-timeout", "0.3",
            ],
        )  # fmt: skip
        try:
            port = listening_port(self.log("master"), master, MASTER_READY_S)
        except BenchError as exc:
            raise TrialError(str(exc), self.tails()) from None
        self.agent("nodeA", port)
        bad = self.agent("nodeB", port)
        self.wait(
            lambda: (
                {s.node for s in read_steps(self.steps) if s.step >= WARM_STEPS - 1}
                >= {"nodeA", "nodeB"}
            ),
            timeout_s,
            f"both nodes at step {WARM_STEPS}",
        )
        self.fault.touch()
        fault_at = time.time()
        self.wait(lambda: bad.poll() is not None, timeout_s, "nodeB's agent to exit")
        result.to_exit_s = time.time() - fault_at
        result.exit_code = bad.returncode
        self.agent("nodeC", port)  # the platform replaces the node at once

        def trained() -> float | None:
            late = [s.at for s in read_steps(self.steps) if s.node == "nodeC" and s.at > fault_at]
            return min(late) if late else None

        self.wait(lambda: trained() is not None, timeout_s, "nodeC to train")
        first = trained()
        assert first is not None
        result.to_training_s = first - fault_at

    def wait(self, done: object, timeout_s: float, what: str) -> None:
        assert callable(done)
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TrialError(f"no {what} within {timeout_s:.0f} s", self.tails())
            dead = [n for n, p in self.procs.items() if n == "master" and p.poll() is not None]
            if dead:
                raise TrialError("the master exited", self.tails())
            time.sleep(POLL_S)

    def tails(self, lines: int = 8) -> list[str]:
        out: list[str] = []
        paths = [self.log(name) for name in self.procs]
        paths += sorted((self.dir / "worker-logs").glob("**/*.log"))
        for path in paths:
            with suppress(OSError):
                text = path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
                if text:
                    out.append(f"--- {path.relative_to(self.dir)}")
                    out.extend(f"    {line[:240]}" for line in text[-lines:])
        return out

    def cleanup(self) -> list[int]:
        left = kill_tagged(list(self.procs.values()), TAG_ENV, self.tag, CLEANUP_S)
        for log in self._logs:
            log.close()
        return left


def run_trial(policy: str, index: int, root: Path, args: argparse.Namespace) -> Result:
    result = Result(policy, index)
    trial = Trial(policy, index, root)
    try:
        trial.run(result, args.timeout)
    except TrialError as exc:
        result.error, result.details = exc.reason, exc.details
    finally:
        left = trial.cleanup()
        if left:
            result.error = result.error or f"processes survived the cleanup: {left}"
        if not args.keep and not result.error:
            shutil.rmtree(trial.dir, ignore_errors=True)
    return result


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def report(results: list[Result]) -> None:
    say()
    say("policy            trials  fault -> nodeC trains (median, min-max)   fault -> nodeB exits")
    medians: dict[str, float] = {}
    for policy in POLICIES:
        rows = [r for r in results if r.policy == policy]
        good = [r for r in rows if r.to_training_s is not None]
        times = [r.to_training_s for r in good if r.to_training_s is not None]
        exits = [r.to_exit_s for r in good if r.to_exit_s is not None]
        if not times:
            say(f"{policy:17s} {len(good)}/{len(rows)}")
            continue
        medians[policy] = statistics.median(times)
        say(
            f"{policy:17s} {len(good)}/{len(rows):<5d} {medians[policy]:6.2f} s "
            f"({min(times):.2f}-{max(times):.2f})                "
            f"{statistics.median(exits):6.2f} s"
        )
    failed = [r for r in results if r.error]
    if failed:
        say()
        say("failed trials:")
        for r in failed:
            say(f"  {r.policy} trial {r.index}: {r.error}")
            for line in r.details:
                say(f"    {line}")
    say()
    ours = medians.get("dlfleet")
    warm = medians.get("in-place-warm")
    reference = medians.get(REFERENCE)
    if ours and warm:
        say(f"ratio (warm restarts): {warm / ours:.2f}")
    if not ours or not reference:
        say("ratio: n/a (needs a recovered trial of dlfleet and of the reference)")
        return
    ratio = reference / ours
    met = ratio >= GOAL_RATIO and not failed
    verdict = "yes" if met else "NO"
    say(f"goal: {REFERENCE} / dlfleet >= {GOAL_RATIO:g}, every trial recovered: {verdict}")
    say(f"ratio: {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=4, help="trials per policy (4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per phase (120)")
    parser.add_argument("--keep", action="store_true", help="keep the trials' folders")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.timeout <= 0:
        parser.error("--trials and --timeout must be positive")
    exit_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="dlfleet-diagnosis-bench-"))
    say(
        f"diagnosis benchmark: {args.trials} trial(s) per policy ({', '.join(POLICIES)}), "
        f"2 nodes x 1 rank, gloo, a GPU fault on nodeB after {WARM_STEPS} steps; folder {root}"
    )
    results: list[Result] = []
    started = time.monotonic()
    try:
        for index in range(args.trials):
            order = list(POLICIES)
            shift = index % len(order)
            for policy in order[shift:] + order[:shift]:
                result = run_trial(policy, index, root, args)
                results.append(result)
                say(
                    f"  trial {index} {policy:14s} nodeC trains {fmt(result.to_training_s)} "
                    f"after the fault; nodeB exited {fmt(result.to_exit_s)} after it "
                    f"(code {result.exit_code}){'; ' + result.error if result.error else ''}"
                )
    except KeyboardInterrupt:
        say("interrupted; reporting the trials done so far")
    finally:
        if not args.keep and not any(r.error for r in results):
            shutil.rmtree(root, ignore_errors=True)
    say(f"(the bench took {time.monotonic() - started:.0f} s)")
    report(results)
    return 0 if results and not any(r.error for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

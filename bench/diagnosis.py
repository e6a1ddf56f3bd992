"""Diagnosis benchmark: a node's GPU breaks mid-run; how long until the job
trains again on healthy nodes, when the failure is diagnosed and the node
replaced at once (dlfleet), against the restart-in-place policy (restart on
the same node until `max_restarts` are spent, then replace it), same job,
same machine, trials alternating.

    python bench/diagnosis.py             # 3 trials per policy and job shape
    python bench/diagnosis.py --trials 1 --shapes elastic

The job (bench/_diagnosis_train.py, under the Python that runs this bench): a
dlfleet master and two `dlworker` agents, nodeA and nodeB, one DDP rank each
over gloo, trained through `dlfleet.elastic.run` with an in-memory checkpoint
every step, 50 ms steps; all on this machine. Two shapes of job:

* elastic (`--min-nodes 1 --max-nodes 2`, dlfleet's usual job): it can go
  on without nodeB; measured: from the fault to the first step completed by
  a healthy node (nodeA alone, or with the replacement);
* fixed (`--min-nodes 2 --max-nodes 2`): it cannot train without a second
  node; measured: from the fault to the first step of the replacement.

A trial: wait until both nodes trained 60 steps together (3 s) and, where
the policy keeps spare processes, both spares are up; then break nodeB's
"GPU" (a file the training script looks for: every process of nodeB from
then on fails as one on a GPU that fell off the bus, with the driver's Xid
line on stderr and "CUDA error: unspecified launch failure"), noting the
time. The bench plays the platform: when nodeB's agent exits, for whatever
reason, it starts nodeC, a healthy replacement, at once. Also noted: the
time to nodeB's exit, and to nodeC's first step.

Policies (only the agents' flags differ; `--max-restarts 3` for all):

* dlfleet: diagnosis on (the default): nodeB's first failure matches the rule
  `gpu-hardware`, its agent leaves at once (exit 4: replace me).
* restart-in-place, torchrun-style (`--diagnosis off --spares 0`): nodeB's
  workers are restarted on nodeB, cold, three times (each fails again),
  then its agent exits 1 and nodeC replaces it; the reference of the issue.
* restart-in-place, warm (`--diagnosis off`, a spare process): the same with
  dlfleet's pre-started spares: printed for comparison.

Printed: a line per trial; per shape and policy the medians and ranges; the
fixed job's ratio; and, last, `ratio: X` with X = the elastic job's median
fault-to-training time under the torchrun-style policy / under dlfleet's
(higher is better; goal >= 3). Each trial has fresh ports, folders and an
environment marker; at its end every process carrying the marker is
SIGKILLed. The default run (18 trials) takes about 8 minutes on 2 cores.
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
    log_tails,
    say,
    spawn_logged,
)

from dlfleet.api.env import TOKEN_ENV

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
SHAPES = {"elastic": 1, "fixed": 2}  # the job's --min-nodes (of 2)
GOAL_RATIO = 3.0
WARM_STEPS = 60  # steps both nodes train together before the fault (3 s)
MASTER_READY_S = 30.0
CLEANUP_S = 15.0
POLL_S = 0.05


@dataclass
class Result:
    shape: str
    policy: str
    index: int
    to_healthy_s: float | None = None  # fault -> first step of a node other than nodeB
    to_replacement_s: float | None = None  # fault -> first step of nodeC
    to_exit_s: float | None = None  # fault -> nodeB's agent exited
    exit_code: int | None = None  # nodeB's agent's
    error: str = ""
    details: list[str] = field(default_factory=list)

    @property
    def measured_s(self) -> float | None:
        """The trial's figure: the elastic job trains on healthy nodes, the
        fixed one needs its replacement."""
        return self.to_healthy_s if self.shape == "elastic" else self.to_replacement_s


@dataclass(frozen=True)
class Step:
    at: float
    round: int
    node: str
    step: int


def read_steps(path: Path) -> list[Step]:
    steps = []
    with suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                at, round_, node = float(parts[0]), int(parts[1]), parts[4].partition("#")[0]
                steps.append(Step(at, round_, node, int(parts[3])))
    return steps


class Trial:
    def __init__(self, shape: str, policy: str, index: int, root: Path) -> None:
        self.shape = shape
        self.policy = policy
        self.dir = Path(tempfile.mkdtemp(prefix=f"{index:02d}-{shape}-{policy}-", dir=root))
        self.tag = secrets.token_hex(8)
        self.steps = self.dir / "steps.log"
        self.fault = self.dir / "fault"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self.env = {
            **os.environ,
            TAG_ENV: self.tag,
            TOKEN_ENV: secrets.token_hex(16),
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
                "--nnodes", f"{SHAPES[self.shape]}:2", "--nproc-per-node", "1",
                "--max-restarts", "3",
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
                "--store", f"sqlite:///{self.dir / 'm.db'}",
                "--min-nodes", str(SHAPES[self.shape]),
                "--max-nodes", "2", "--last-call-timeout", "0.3",
            ],
        )  # fmt: skip
        try:
            port = listening_port(self.log("master"), master, MASTER_READY_S)
        except BenchError as exc:
            raise TrialError(str(exc), self.tails()) from None
        self.agent("nodeA", port)
        bad = self.agent("nodeB", port)
        spares = "--spares" not in POLICIES[self.policy]

        def warm() -> bool:
            stepped = {s.node for s in read_steps(self.steps) if s.step >= WARM_STEPS - 1}
            ready = all(
                not spares or b"attached as a spare" in self.log(name).read_bytes()
                for name in ("nodeA", "nodeB")
            )
            return stepped >= {"nodeA", "nodeB"} and ready

        self.wait(warm, timeout_s, f"both nodes at step {WARM_STEPS}, spares up")
        self.fault.touch()
        fault_at = time.time()
        fault_round = max(s.round for s in read_steps(self.steps))
        self.wait(lambda: bad.poll() is not None, timeout_s, "nodeB's agent to exit")
        result.to_exit_s = time.time() - fault_at
        result.exit_code = bad.returncode
        self.agent("nodeC", port)  # the platform replaces the node at once

        def first_step(nodes: set[str]) -> float | None:
            """Of a round after the fault's: nodeB's steps in flight then may
            still let its round's last steps complete."""
            late = [
                s.at for s in read_steps(self.steps) if s.node in nodes and s.round > fault_round
            ]
            return min(late) if late else None

        self.wait(lambda: first_step({"nodeC"}) is not None, timeout_s, "nodeC to train")
        healthy, replaced = first_step({"nodeA", "nodeC"}), first_step({"nodeC"})
        assert healthy is not None and replaced is not None
        result.to_healthy_s = healthy - fault_at
        result.to_replacement_s = replaced - fault_at

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
        paths = [self.log(name) for name in self.procs]
        paths += sorted((self.dir / "worker-logs").glob("**/*.log"))
        return log_tails(self.dir, paths, lines, width=240)

    def cleanup(self) -> list[int]:
        left = kill_tagged(list(self.procs.values()), TAG_ENV, self.tag, CLEANUP_S)
        for log in self._logs:
            log.close()
        return left


def run_trial(shape: str, policy: str, index: int, root: Path, args: argparse.Namespace) -> Result:
    result = Result(shape, policy, index)
    trial = Trial(shape, policy, index, root)
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
    medians: dict[tuple[str, str], float] = {}
    for shape, min_nodes in SHAPES.items():
        rows = [r for r in results if r.shape == shape]
        if not rows:
            continue
        say()
        what = "a healthy node" if shape == "elastic" else "the replacement"
        say(f"{shape} job (min {min_nodes} of 2 nodes): fault -> {what} trains")
        say("  policy            trials   median  (min-max)        nodeB exits  nodeC trains")
        for policy in POLICIES:
            mine = [r for r in rows if r.policy == policy]
            good = [r for r in mine if r.measured_s is not None]
            if not mine:
                continue
            if not good:
                say(f"  {policy:17s} 0/{len(mine)}")
                continue
            times = [r.measured_s for r in good if r.measured_s is not None]
            exits = [r.to_exit_s for r in good if r.to_exit_s is not None]
            joins = [r.to_replacement_s for r in good if r.to_replacement_s is not None]
            medians[(shape, policy)] = statistics.median(times)
            say(
                f"  {policy:17s} {len(good)}/{len(mine):<6d} {medians[(shape, policy)]:6.2f} s "
                f"({min(times):5.2f}-{max(times):5.2f})  {statistics.median(exits):8.2f} s "
                f"{statistics.median(joins):10.2f} s"
            )
    failed = [r for r in results if r.error]
    if failed:
        say()
        say("failed trials:")
        for r in failed:
            say(f"  {r.shape} {r.policy} trial {r.index}: {r.error}")
            for line in r.details:
                say(f"    {line}")
    say()
    ratios: dict[str, float] = {}
    for shape in SHAPES:
        ours, reference = medians.get((shape, "dlfleet")), medians.get((shape, REFERENCE))
        warm = medians.get((shape, "in-place-warm"))
        if ours and warm:
            say(f"{shape}: in-place-warm / dlfleet {warm / ours:.2f}")
        if ours and reference:
            ratios[shape] = reference / ours
            say(f"{shape}: {REFERENCE} / dlfleet {ratios[shape]:.2f}")
    if "elastic" not in ratios:
        say("ratio: n/a (needs recovered elastic trials of dlfleet and of the reference)")
        return
    met = all(r >= GOAL_RATIO for r in ratios.values()) and not failed
    verdict = "yes" if met else "NO"
    say(f"goal: {REFERENCE} / dlfleet >= {GOAL_RATIO:g}, every trial recovered: {verdict}")
    say(f"ratio: {ratios['elastic']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=3, help="trials per policy and shape (3)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="elastic,fixed (both)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per phase (120)")
    parser.add_argument("--keep", action="store_true", help="keep the trials' folders")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    if not args.policies or any(p not in POLICIES for p in args.policies):
        parser.error(f"--policies wants some of {', '.join(POLICIES)}")
    args.shapes = [p for p in args.shapes.split(",") if p]
    if not args.shapes or any(p not in SHAPES for p in args.shapes):
        parser.error(f"--shapes wants some of {', '.join(SHAPES)}")
    if args.trials < 1 or args.timeout <= 0:
        parser.error("--trials and --timeout must be positive")
    exit_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="dlfleet-diagnosis-bench-"))
    say(
        f"diagnosis benchmark: {args.trials} trial(s) per policy ({', '.join(args.policies)}), "
        f"{', '.join(args.shapes)} job(s) of 2 nodes x 1 rank, gloo, a GPU fault on nodeB "
        f"after {WARM_STEPS} steps; folder {root}"
    )
    results: list[Result] = []
    started = time.monotonic()
    try:
        for index in range(args.trials):
            order = list(args.policies)
            shift = index % len(order)
            for shape in args.shapes:
                for policy in order[shift:] + order[:shift]:
                    result = run_trial(shape, policy, index, root, args)
                    results.append(result)
                    say(
                        f"  trial {index} {shape:7s} {policy:14s} after the fault: nodeB exited "
                        f"{fmt(result.to_exit_s)} (code {result.exit_code}), healthy nodes "
                        f"trained {fmt(result.to_healthy_s)}, nodeC "
                        f"{fmt(result.to_replacement_s)}"
                        f"{'; ' + result.error if result.error else ''}"
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

"""Node check benchmark: the pre-flight node check's wall time at 2, 4 and 8
nodes, each trial with one node made slow, and whether the check found it
(it must, every trial).

    python bench/node_check.py                  # 3 trials at each of 2, 4 and 8 nodes
    python bench/node_check.py --quick          # 1 trial each
    python bench/node_check.py --sizes 4 --trials 5 --factor 2.5 --keep

A trial runs a real job: `python -m dlfleet.master --job-config job.yaml`
(the Python that runs this bench) with `nodes: {min: N, max: N}`,
`node_check: {enabled: true, slow_factor: 2}` and a training script that
needs no torch; the local platform starts N real `dlworker` agents on this
machine, each of which runs its check process (`python -m
dlfleet.worker.nodecheck`: torch, a 512 x 512 matmul, 4 MiB gloo
all-reduces over 127.0.0.1) before it would train. One node, picked at
random per trial (seeded), is made `--factor` times slower by the test hook
($DLFLEET_NODE_CHECK_SLOWDOWN: its matmul and its all-reduce iterations are
each followed by a sleep of (factor - 1) x their own time). The bench reads
the verdicts from the job's status (`dlmaster status`: each node's check)
until every one of the N first nodes has one, then stops the job (the replacement the runner
starts for the slow node is not waited for).

Per trial it prints, from the master's verdicts:
- wall: from the first node's check beginning (its agent registered) to the
  last verdict: what the check costs the job's start, the check processes'
  start-up (interpreter, torch import: all N at once on this machine's cores)
  included;
- measure: from the cohort forming (every check process up) to the verdicts:
  the matmuls and the pairs alone. All the nodes share one host here, so they
  are measured one at a time (the board's rule for a shared host); on
  separate hosts the matmuls run at once and a round's pairs in parallel;
- found: the slow node's verdict is faulty (its rule and numbers shown), and
  no other node was faulted.

Every trial gets a fresh temporary folder, fresh ports (the job picks free
ones) and an environment marker; at its end the job's process group is
stopped and every process carrying the marker (agents, check processes,
workers) is killed, and the bench checks none is left. SIGTERM ends the bench
like Ctrl-C: the trial under way is cleaned up.

Last line: `ratio: X`, X = the fraction of trials in which the slow node was
found and no healthy node faulted (1.00 is the goal: every trial). It is not
a speed ratio: nothing in the same run can honestly say how long training
would have taken to expose the slow node instead (the brain's straggler rule
needs minutes of training at the default settings, by configuration, not by
measurement). The wall times above are the check's cost.

Expect about 1 minute per 3 trials at 2 nodes and 2 minutes per 3 at 8 on a
2-core machine (torch imports dominate); --quick about 1.5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

ROOT = Path(__file__).resolve().parent.parent
if _QUIET_GRPC := "GRPC_VERBOSITY" not in os.environ:
    os.environ["GRPC_VERBOSITY"] = "ERROR"  # no INFO lines from this process's gRPC core
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

from _common import exit_on_sigterm, kill_tagged, say  # noqa: E402

from dlfleet.api.client import MasterClient, RetryPolicy  # noqa: E402
from dlfleet.api.env import NODE_CHECK_SLOWDOWN_ENV  # noqa: E402
from dlfleet.api.errors import DlfleetError  # noqa: E402
from dlfleet.api.v1 import nodecheck_pb2  # noqa: E402

TAG_ENV = "DLFLEET_NODE_CHECK_BENCH_TAG"
START_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_S = 240.0
WORKER = """
import os, sys, time
deadline = time.monotonic() + 120
while time.monotonic() < deadline and not os.path.exists(sys.argv[1]):
    time.sleep(0.2)
"""


@dataclass
class Trial:
    nodes: int
    index: int
    slow: str  # the node made slow, name#1
    wall_s: float = 0.0
    measure_s: float = 0.0
    found: bool = False
    faulted: list[str] = field(default_factory=list)  # healthy nodes found faulty
    verdict: str = ""  # the slow node's rule and reason
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.found and not self.faulted


def job_config(name: str, nodes: int, slow: str, factor: float, stop: Path) -> dict[str, object]:
    return {
        "name": name,
        "command": "worker.py",
        "args": [str(stop)],
        "nodes": {"min": nodes, "max": nodes},
        "node_check": {"enabled": True, "slow_factor": 2.0, "timeout_s": 30},
        "env": {NODE_CHECK_SLOWDOWN_ENV: f"{slow}:{factor:g}"},
        "display": "plain",
        "http": None,
        "rendezvous": {"last_call_timeout_s": 0.5},
        "heartbeat": {"interval_s": 1.0, "timeout_s": 20.0},
        "brain": {"mode": "off"},
        "max_node_relaunches": 1,
    }


def run_trial(trial: Trial, factor: float, keep: Path | None) -> None:
    folder = Path(tempfile.mkdtemp(prefix=f"nodecheck-{trial.nodes}-{trial.index}-"))
    tag = secrets.token_hex(8)
    name = f"nc-{trial.nodes}-{trial.index}"
    stop = folder / "stop"
    (folder / "worker.py").write_text(WORKER)
    (folder / "job.yaml").write_text(
        json.dumps(job_config(name, trial.nodes, trial.slow, factor, stop))
    )
    env = {**os.environ, TAG_ENV: tag, "PYTHONUNBUFFERED": "1"}
    if _QUIET_GRPC:
        env.pop("GRPC_VERBOSITY", None)
    log = (folder / "dlmaster.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlfleet.master", "--job-config", str(folder / "job.yaml")],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client: MasterClient | None = None
    try:
        client = connect(folder / ".dlfleet" / name, proc)
        verdicts = wait_for_verdicts(client, trial.nodes, proc)
        judge(trial, verdicts)
    except (RuntimeError, DlfleetError) as error:
        trial.error = str(error)
    finally:
        stop.write_text("")
        if client is not None:
            client.close()
        left = kill_tagged([proc], TAG_ENV, tag, timeout_s=20.0)
        log.close()
        if left:
            trial.error = trial.error or f"processes outlived the trial: {left}"
        if keep is not None:
            shutil.copytree(folder, keep / folder.name, dirs_exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


def connect(job_dir: Path, proc: subprocess.Popen[bytes]) -> MasterClient:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dlmaster exited with {proc.returncode}")
        with suppress(OSError, ValueError, KeyError):
            address = str(json.loads((job_dir / "master.json").read_text())["address"])
            token = (job_dir / "token").read_text().strip()
            retry = RetryPolicy(attempts=3, max_backoff_s=0.2, total_budget_s=2.0)
            return MasterClient(address, token=token, timeout_s=2.0, retry=retry)
        time.sleep(0.1)
    raise RuntimeError(f"the job did not start within {START_TIMEOUT_S:g}s")


def wait_for_verdicts(
    client: MasterClient, nodes: int, proc: subprocess.Popen[bytes]
) -> dict[str, nodecheck_pb2.NodeCheckVerdict]:
    """The verdicts of node-0#1 .. node-{N-1}#1, once every one has one."""
    wanted = {f"node-{i}#1" for i in range(nodes)}
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    found: dict[str, nodecheck_pb2.NodeCheckVerdict] = {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended with {proc.returncode} before every verdict")
        with suppress(DlfleetError):  # asked while it starts
            for node in client.job_status().nodes:
                if node.check.node_id in wanted:
                    found[node.check.node_id] = node.check
        if len(found) == nodes:
            return found
        time.sleep(0.2)
    raise RuntimeError(f"{nodes - len(found)} verdicts missing after {TRIAL_TIMEOUT_S:g}s")


def judge(trial: Trial, verdicts: dict[str, nodecheck_pb2.NodeCheckVerdict]) -> None:
    begun = min(v.at_ms - v.took_ms for v in verdicts.values())
    decided = max(v.at_ms for v in verdicts.values())
    trial.wall_s = (decided - begun) / 1000
    trial.measure_s = max(v.measure_ms for v in verdicts.values()) / 1000
    slow = verdicts[trial.slow]
    trial.found = slow.faulty
    trial.verdict = f"{slow.rule}: {slow.reason}"
    trial.faulted = sorted(n for n, v in verdicts.items() if v.faulty and n != trial.slow)


def summarize(trials: list[Trial]) -> None:
    say("")
    say("nodes  trials  found  wall s (median, min-max)  measure s (median)")
    for size in sorted({t.nodes for t in trials}):
        group = [t for t in trials if t.nodes == size]
        done = [t for t in group if not t.error]
        walls = [t.wall_s for t in done] or [0.0]
        measures = [t.measure_s for t in done] or [0.0]
        found = sum(t.ok for t in group)
        say(
            f"{size:>5}  {len(group):>6}  {found:>5}  "
            f"{statistics.median(walls):6.1f} ({min(walls):.1f}-{max(walls):.1f})"
            f"{'':10}{statistics.median(measures):6.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="2,4,8", help="node counts (2,4,8)")
    parser.add_argument("--trials", type=int, default=3, help="trials per size (3)")
    parser.add_argument("--quick", action="store_true", help="1 trial per size")
    parser.add_argument("--factor", type=float, default=3.0, help="the slow node's slowdown (3)")
    parser.add_argument("--seed", type=int, default=0, help="which node is slow, per trial (0)")
    parser.add_argument("--keep", type=Path, help="copy each trial's folder (logs) here")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    trials_per_size = 1 if args.quick else args.trials
    rng = random.Random(args.seed)
    say(
        f"node check: {trials_per_size} trial(s) at {', '.join(map(str, sizes))} nodes, one node "
        f"{args.factor:g}x slower per trial, slow_factor 2, on {os.cpu_count()} cores"
    )
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    trials: list[Trial] = []
    for size in sizes:
        for index in range(trials_per_size):
            trial = Trial(size, index, f"node-{rng.randrange(size)}#1")
            run_trial(trial, args.factor, args.keep)
            trials.append(trial)
            if trial.error:
                say(f"{size} nodes, trial {index}: FAILED: {trial.error}")
                continue
            outcome = "found" if trial.found else "NOT FOUND"
            if trial.faulted:
                outcome += f", but also faulted {', '.join(trial.faulted)}"
            say(
                f"{size} nodes, trial {index}: slow {trial.slow} {outcome}; wall "
                f"{trial.wall_s:.1f}s, measure {trial.measure_s:.2f}s; {trial.verdict[:160]}"
            )
    summarize(trials)
    ratio = sum(t.ok for t in trials) / len(trials) if trials else 0.0
    say(f"ratio: {ratio:.2f}")
    return 0 if ratio == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())

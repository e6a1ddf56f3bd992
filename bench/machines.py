"""Across machines: the time to the first step and the recovery from a lost
machine, dlfleet beside stock torchrun (c10d rendezvous), in one run, on the
test lab's machines (tests/netns.py: a network namespace each, with its own
hostname, /etc/hosts, /tmp and /dev/shm; root needed).

    python bench/machines.py            # 3 trials per system, alternating
    python bench/machines.py --quick    # 1 each

Hosts m, a, b, c. The job: tests/e2e/scripts/host_steps.py (DDP over gloo, a small MLP,
steps padded to --step-ms), one process per node, two nodes, no checkpoint
(torchrun has no in-memory one: both restart the script from scratch).

* dlfleet, README's "Across machines" commands: `dlmaster --host 0.0.0.0
  --port 50051 --min-nodes 2 --max-nodes 3` on m; `dlworker --master
  hostm:50051 --nnodes 2:3 --nproc-per-node 1 --max-restarts 3 ...` on a, b.
* torchrun: `torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 3
  --rdzv-backend c10d --rdzv-endpoint hosta:29400 --rdzv-id <fresh>
  --rdzv-conf last_call_timeout=3 ...` on a and b (a hosts the store; the
  last call is dlmaster's default, 3 s).

A trial: launch the two nodes (and the master), note when the first step of
the world of two is logged (time to first step, from the launch); after 10
steps SIGKILL every process of host b (the machine is lost) and at once start
the same command on host c; recovery = when the first step of the new world
(a and c) is logged, from the kill. Medians over the trials; the headline is
torchrun's median recovery over dlfleet's. A third system for reference:
stock torchrun with `--rdzv-backend dlfleet --rdzv-endpoint hostm:50051`
(README's torchrun command), through the same master.

Seen on 2026-11-26 (2 cores, 3 trials): torchrun's c10d rendezvous did not
recover from the lost machine in any trial: the new node waited for a
MASTER_ADDR key that the round's rank 0 never wrote (`DistStoreError: wait
timeout after 60000ms, keys: .../MASTER_ADDR`), node a for the others'
role_info keys, and torchrun gave up (our reading, not checked in torch's
code: the round formed with the lost node still counted, as c10d keeps a
participant until its keep-alives lapse). A failed recovery counts as
--timeout in the medians, so the ratio is then a lower bound, and the lines
above it say so.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from e2e.scripts.host_steps import read_steps  # noqa: E402
from netns import NetLab, Output, netns_unavailable, user_env  # noqa: E402

HOSTS = {"m": "10.233.0.1", "a": "10.233.0.2", "b": "10.233.0.3", "c": "10.233.0.4"}
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "host_steps.py"
TOKEN = secrets.token_hex(16)
MASTER = [
    "dlmaster",
    "--host",
    "0.0.0.0",
    "--port",
    "50051",
    "--min-nodes",
    "2",
    "--max-nodes",
    "3",
]


def commands(system: str, trial: int, out: Path, step_s: float) -> tuple[list[str], list[str]]:
    """(the master's command or [], a node's command)."""
    script = [str(SCRIPT), str(out), str(step_s)]
    if system == "torchrun-dlfleet":
        node = (
            "torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 3 --rdzv-backend dlfleet "
            "--rdzv-endpoint hostm:50051 --rdzv-id job"
        )
        return MASTER, [*node.split(), *script]
    if system == "dlfleet":
        node = "dlworker --master hostm:50051 --nnodes 2:3 --nproc-per-node 1 --max-restarts 3"
        return MASTER, [*node.split(), *script]
    node = (
        "torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d "
        f"--rdzv-endpoint hosta:29400 --rdzv-id bench{trial} --rdzv-conf last_call_timeout=3"
    )
    return [], [*node.split(), *script]


Steps = list[tuple[float, int, str]]


def wait(
    out: Path,
    what: str,
    done: Callable[[Steps], float | None],
    timeout: float,
    outputs: list[Output],
) -> float:
    """Until `done(steps)` gives a time; that time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = done(read_steps(out))
        if at is not None:
            return float(at)
        time.sleep(0.05)
    tails = "\n".join(f"--- {o.name}\n{o.tail(15)}" for o in outputs)
    raise RuntimeError(f"no {what} within {timeout}s\n{tails}")


def trial(
    lab: NetLab, system: str, number: int, step_s: float, timeout: float
) -> tuple[float, float | None]:
    """(time to the first step, recovery or None if it did not within `timeout`)."""
    out = lab.shared / f"{system}-{number}"
    out.mkdir()
    master_cmd, node_cmd = commands(system, number, out, step_s)
    env = user_env(DLFLEET_TOKEN=TOKEN)
    outputs: list[Output] = []
    try:
        launched = time.time()
        if master_cmd:
            outputs.append(Output("master", lab.popen("m", master_cmd, env, cwd=str(out))))
            outputs[-1].wait_for("listening on", timeout=60)
        outputs += [Output(f"node {h}", lab.popen(h, node_cmd, env)) for h in "ab"]
        first = wait(
            out, "first step of two",
            lambda s: next((t for t, w, _ in s if w == 2), None), 180, outputs,
        )  # fmt: skip
        wait(out, "10 steps", lambda s: s[-1][0] if len(s) >= 20 else None, 120, outputs)
        lab.kill_host("b")
        killed = time.time()
        outputs.append(Output("node c", lab.popen("c", node_cmd, env)))
        try:
            back = wait(
                out, "a step of a and c",
                lambda s: next((t for t, w, h in s if h == "hostc" and t > killed), None),
                timeout, outputs,
            )  # fmt: skip
        except RuntimeError as error:
            print(f"{system} trial {number}: {error}", file=sys.stderr)
            return first - launched, None
        return first - launched, back - killed
    finally:
        lab.kill_processes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 trial per system")
    parser.add_argument("--step-ms", type=float, default=100)
    parser.add_argument(
        "--timeout", type=float, default=90, help="seconds a recovery may take (else failed)"
    )
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    reason = netns_unavailable()
    if reason is not None:
        print(f"machines.py: cannot build the lab here: {reason}", file=sys.stderr)
        return 2
    systems = ["dlfleet", "torchrun", "torchrun-dlfleet"]
    results: dict[str, list[tuple[float, float | None]]] = {s: [] for s in systems}
    lab = NetLab(dict(HOSTS)).start()
    try:
        for number in range(trials):
            for system in systems if number % 2 == 0 else systems[::-1]:
                first, recovery = trial(lab, system, number, args.step_ms / 1000, args.timeout)
                results[system].append((first, recovery))
                said = f"{recovery:5.1f}s" if recovery is not None else "none (failed)"
                print(f"{system:16} trial {number}: first step {first:5.1f}s, "
                      f"recovery from a lost machine {said}", flush=True)  # fmt: skip
    finally:
        lab.close()
    # A recovery that failed counts as the timeout: the ratio is then a lower bound.
    medians = {
        system: (
            statistics.median(f for f, _ in r),
            statistics.median(args.timeout if v is None else v for _, v in r),
        )
        for system, r in results.items()
    }
    for system, (first, recovery) in medians.items():
        failed = sum(1 for _, v in results[system] if v is None)
        note = f" ({failed} of {trials} failed: counted as {args.timeout:g}s)" if failed else ""
        print(f"{system:16} median: first step {first:5.1f}s, recovery {recovery:5.1f}s{note}")
    print(f"first step, torchrun / dlfleet: {medians['torchrun'][0] / medians['dlfleet'][0]:.2f}")
    print(f"ratio: {medians['torchrun'][1] / medians['dlfleet'][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

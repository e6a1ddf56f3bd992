"""The agent harness of the rendezvous benchmark: one process of agent threads.

Standard library only, and no dlfleet or torch import of its own: the measuring
loop, its clock and its bookkeeping are the same code for every system. What
differs is only the *driver*, a module `bench/_rdzv_driver_<name>.py` with

    make_agent(target, nodes, run_id, index, options) -> Agent
    server_command(python, port, nodes, workdir, options) -> (argv, ready_text)

where an Agent is one simulated node: `setup()` builds its client and connects
(not timed), `join()` joins the rendezvous and returns once this node has its
result (timed), as a dict with `round`, `rank` (the node's group rank),
`world_size` (the group's) and `group` (a string every member of one world
must agree on), and `close()`.

    run --driver D --target HOST:PORT --nodes N --run-id R --first I --threads T
        --deadline S [--option KEY=VALUE ...]

builds T agents, indices I..I+T-1 of the N, one thread each, calls their
setup() one by one, prints `READY`, then waits for a line `GO <t0>` on stdin,
where t0 is a `time.monotonic()` instant: CLOCK_MONOTONIC, one clock for every
process of the machine, so the orchestrator gives all processes of a run the
same start. Every thread sleeps until t0, calls join() once and records when
it returned, in seconds after t0. A thread without a result S seconds after t0
counts as failed. The process then prints exactly one `RESULT <json>` line on
the original stdout (library output goes to stderr) and exits at once, without
waiting for threads the libraries leave behind (heartbeats, stuck joins).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Protocol, cast

from _common import load_driver, parse_options


class Agent(Protocol):
    def setup(self) -> None: ...

    def join(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _agent_thread(agent: Agent, index: int, t0: float, out: dict[str, Any]) -> None:
    time.sleep(max(0.0, t0 - time.monotonic()))
    started = time.monotonic()
    try:
        result = agent.join()
    except Exception as exc:  # noqa: BLE001 - any failure is reported; the run then fails
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["t_s"] = time.monotonic() - t0
        return
    done = time.monotonic()
    out.update(result)
    out["agent"] = index
    out["start_lag_s"] = started - t0
    out["t_s"] = done - t0


def _run(args: argparse.Namespace, emit: Any) -> int:
    module = load_driver("_rdzv_driver_", args.driver)
    options = parse_options(args.option)
    indices = range(args.first, args.first + args.threads)
    agents = [
        cast(Agent, module.make_agent(args.target, args.nodes, args.run_id, index, options))
        for index in indices
    ]
    for agent in agents:
        agent.setup()
    emit("READY")
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "GO":
        raise SystemExit(f"expected 'GO <t0>' on stdin, got {line!r}")
    t0 = float(line[1])
    go_margin_s = t0 - time.monotonic()
    results: list[dict[str, Any]] = [{"agent": index} for index in indices]
    threads = [
        threading.Thread(
            target=_agent_thread, args=(agent, index, t0, out), daemon=True, name=f"agent-{index}"
        )
        for agent, index, out in zip(agents, indices, results, strict=True)
    ]
    cpu = os.times()
    for thread in threads:
        thread.start()
    deadline = t0 + args.deadline
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    cpu_end = os.times()
    for thread, out in zip(threads, results, strict=True):
        if thread.is_alive():
            out["error"] = f"no result {args.deadline:.0f} s after the start"
        elif "t_s" not in out:
            out["error"] = "the agent's thread ended without a result"
    report = {
        "first": args.first,
        "threads": args.threads,
        # How long before t0 this process had the GO (negative: late).
        "go_margin_s": go_margin_s,
        # CPU of this process (all its threads) from the GO to the last result.
        "cpu_s": (cpu_end.user - cpu.user) + (cpu_end.system - cpu.system),
        "agents": results,
    }
    emit("RESULT " + json.dumps(report, separators=(",", ":")))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--driver", required=True)
    parser.add_argument("--target", required=True, help="HOST:PORT of the server")
    parser.add_argument("--nodes", type=int, required=True, help="N, the world's size")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--first", type=int, default=0, help="index of this process's first agent")
    parser.add_argument("--threads", type=int, default=1, help="agents in this process")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds after the start")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for the driver")
    args = parser.parse_args(argv)

    # The protocol goes to the original stdout; whatever the libraries print
    # goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def emit(line: str) -> None:
        protocol.write(line + "\n")
        protocol.flush()

    code = _run(args, emit)
    protocol.flush()
    sys.stderr.flush()
    # Do not wait for the threads the libraries leave running (torch's
    # keep-alive timers, a join that never returned) or their finalizers.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

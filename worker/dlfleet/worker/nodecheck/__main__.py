"""`python -m dlfleet.worker.nodecheck`: measure this node for its pre-flight
check, as the master orders, until its verdict (started by the node's agent).

    python -m dlfleet.worker.nodecheck --master HOST:PORT --node-id NAME#N \\
        --incarnation N --host ADDR --check-id ID --result FILE
    python -m dlfleet.worker.nodecheck ... --helper-pair HEX   # one pair for a late node

The job token comes from $DLFLEET_TOKEN. Each report to the master's NodeCheck
service carries what was measured for the last order (and a free port, should
this node host its next pair's store); the answer is the next order: a
matmul, a pair, "wait", or the verdict, written to --result as JSON. A master
that restarted answers under a new check id: the node starts over with it.
Exit codes: see `dlfleet.worker.nodecheck`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

from dlfleet.api.client import CheckCompute, CheckPair, CheckVerdict, MasterClient, RetryPolicy
from dlfleet.api.env import TOKEN_ENV
from dlfleet.api.errors import NotFound, StaleError, Unavailable
from dlfleet.api.v1 import nodecheck_pb2
from dlfleet.worker.nodecheck import (
    EXIT_FAULTY,
    EXIT_HEALTHY,
    EXIT_LOST,
    slowdown_for,
)
from dlfleet.worker.nodecheck.probe import Probe

_log = logging.getLogger("nodecheck")

NEXT_TIMEOUT_S = 30.0  # the master answers within its poll time (seconds)
RETRY = RetryPolicy(attempts=60, max_backoff_s=2.0, total_budget_s=60.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dlfleet.worker.nodecheck")
    p.add_argument("--master", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--incarnation", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="where this node's stores listen")
    p.add_argument("--check-id", default="")
    p.add_argument("--result", type=Path, help="where the verdict goes, as JSON")
    p.add_argument("--helper-pair", help="run this serialized PairOrder (hex) and report it")
    return p


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class CheckProcess:
    def __init__(self, client: MasterClient, args: argparse.Namespace, probe: Probe) -> None:
        self.client = client
        self.args = args
        self.probe = probe
        self.check_id: str = args.check_id

    def report(self, done: int, **result: object) -> nodecheck_pb2.NodeCheckReport:
        return nodecheck_pb2.NodeCheckReport(
            node_id=self.args.node_id,
            incarnation=self.args.incarnation,
            check_id=self.check_id,
            done_order=done,
            host=self.args.host,
            store_port=free_port(self.args.host),
            **result,  # type: ignore[arg-type]
        )

    def run(self) -> int:
        """Carry out orders until the verdict."""
        done = 0
        report = self.report(0, ready=nodecheck_pb2.NodeCheckPoll())
        while True:
            order = self.client.next_check_order(report, timeout_s=NEXT_TIMEOUT_S)
            if order.check_id != self.check_id:
                _log.info("a new check (%s): starting over", order.check_id)
                self.check_id, done = order.check_id, 0
            if isinstance(order, CheckVerdict):
                return self.conclude(order.verdict)
            if isinstance(order, CheckCompute):
                done = order.order
                report = self.measure_compute(done, order)
            elif isinstance(order, CheckPair):
                done = order.order
                ok, ms, error = self.probe.pair(order.pair)
                how = f"{ms:.2f} ms" if ok else f"failed: {error}"
                _log.info("pair %d with %s: %s", order.pair.pair, order.pair.peer, how)
                result = nodecheck_pb2.PairResult(
                    pair=order.pair.pair, ok=ok, allreduce_ms=ms, error=error
                )
                report = self.report(done, pair=result)
            else:
                report = self.report(done, poll=nodecheck_pb2.NodeCheckPoll())

    def measure_compute(self, done: int, order: CheckCompute) -> nodecheck_pb2.NodeCheckReport:
        try:
            ms = self.probe.compute(order.size, order.repeats)
        except RuntimeError as error:  # a broken device
            return self.report(done, failed=f"matmul on {self.probe.device_name}: {error}")
        _log.info("matmul %dx%d on %s: %.2f ms", order.size, order.size,
                  self.probe.device_name, ms)  # fmt: skip
        computed = nodecheck_pb2.ComputeResult(best_ms=ms, device=self.probe.device_name)
        return self.report(done, compute=computed)

    def conclude(self, verdict: nodecheck_pb2.NodeCheckVerdict) -> int:
        state = "faulty" if verdict.faulty else "healthy"
        # The agent says the verdict (it acts on it): once in the node's output.
        _log.debug("verdict: %s (%s): %s", state, verdict.rule, verdict.reason)
        if self.args.result is not None:
            document = {
                "faulty": verdict.faulty,
                "rule": verdict.rule,
                "reason": verdict.reason,
                "took_ms": verdict.took_ms,
            }
            self.args.result.write_text(json.dumps(document))
        return EXIT_FAULTY if verdict.faulty else EXIT_HEALTHY


def run_helper_pair(client: MasterClient, args: argparse.Namespace, probe: Probe) -> int:
    """One side of a pair for a late node's check, reported as a helper's."""
    order = nodecheck_pb2.PairOrder.FromString(bytes.fromhex(args.helper_pair))
    ok, ms, error = probe.pair(order)
    _log.info("helper pair %d with %s: %s", order.pair, order.peer,
              f"{ms:.2f} ms" if ok else f"failed: {error}")  # fmt: skip
    result = nodecheck_pb2.PairResult(pair=order.pair, ok=ok, allreduce_ms=ms, error=error)
    report = nodecheck_pb2.NodeCheckReport(
        node_id=args.node_id,
        incarnation=args.incarnation,
        check_id=order.check_id,
        helper=True,
        pair=result,
    )
    client.node_check_next(report, timeout_s=NEXT_TIMEOUT_S)
    return EXIT_HEALTHY


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s nodecheck %(levelname)s %(message)s"
    )
    probe = Probe(slowdown_for(args.node_id, os.environ))
    client = MasterClient(
        args.master, token=os.environ.get(TOKEN_ENV, ""), timeout_s=NEXT_TIMEOUT_S, retry=RETRY
    )
    try:
        if args.helper_pair:
            return run_helper_pair(client, args, probe)
        return CheckProcess(client, args, probe).run()
    except (Unavailable, StaleError, NotFound) as error:
        _log.error("the master is gone, or no longer knows %s: %s", args.node_id, error)
        return EXIT_LOST
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())

"""`dlmaster`: run a job, or the master's gRPC server alone.

    dlmaster --job-config job.yaml          # run a whole job (see job/jobconfig.py)
    dlmaster scale --job-config job.yaml --nodes 2
    dlmaster status --job-config job.yaml
    dlmaster --port 50051 --state-store sqlite:///job.db --token-file token.txt
    dlmaster --port 50051 --http-port 8080 ...   # also /metrics and /api/v1/status

Serve mode prints `listening on HOST:PORT` once it accepts requests (after
`http on URL` when --http-port is given). A store holds one job: a master
started again on the same store with --resume continues where the last one
stopped (the job supervisor restarts its master so); without --resume, a
store that holds a job is refused. Bad flags or a bad job.yaml exit with
code 2 before anything starts, and so do a port that is in use and a store
that is refused (one line naming it and its flag or setting).

This module only parses the flags and dispatches: serve mode becomes the master
service process (`dlfleet.master.service.app`); `--job-config` the job
supervisor process (`dlfleet.master.job.run_job`); `scale` and `status` a
short-lived client (`dlfleet.master.job.control`). The supervisor's modules are
imported only when asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from dlfleet.api.env import TOKEN_ENV
from dlfleet.api.errors import DlfleetError
from dlfleet.api.serving.flags import TokenFlags, add_tls_flags, tls_from_flags
from dlfleet.api.serving.ports import Endpoint, PortInUse
from dlfleet.master.core.job_identity import StoreClaimError, StoreHoldsAnotherJob
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.node_check import NodeCheckSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.core.restart_loop import BreakerSettings
from dlfleet.master.core.shards import ShardSettings
from dlfleet.master.service.app import serve
from dlfleet.master.service.http_api import HttpSettings
from dlfleet.master.service.state import MasterSettings
from dlfleet.master.settings import RunSettings

DEFAULT_STORE = "sqlite:///dlfleet-master.db"
TOKEN_FLAGS = TokenFlags(env=TOKEN_ENV)
PORT_FLAGS = {Endpoint.GRPC: "--port", Endpoint.HTTP: "--http-port"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlmaster",
        description=__doc__.split("\n\n")[0],
        epilog="Also: `dlmaster scale ...` and `dlmaster status ...` (see --help of each).",
    )
    p.add_argument(
        "--job-config",
        type=Path,
        help="run the job this job.yaml describes, to its end (other flags are ignored)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    p.add_argument(
        "--state-store",
        "--store",
        dest="store",
        default=DEFAULT_STORE,
        help=f"SQLAlchemy URL of the durable store of this job (default {DEFAULT_STORE}, in "
        "the current directory). A store holds one job: a store that already holds one is "
        "refused unless --resume is given",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the job the state store holds (a master restarted after a crash); "
        "it must be the job of --job-name. Without it a new job starts, on a store that "
        "holds none",
    )
    p.add_argument("--job-name", default="job", help="nodes of other jobs are rejected")
    TOKEN_FLAGS.add_to(p)
    RunSettings.add_arguments(p)
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve /metrics and /api/v1/status over HTTP(S) on this port; 0 picks a free one "
        "(default: no HTTP endpoint)",
    )
    p.add_argument(
        "--http-host", default="127.0.0.1", help="address of the HTTP endpoint (default 127.0.0.1)"
    )
    p.add_argument(
        "--http-open-metrics",
        action="store_true",
        help="serve /metrics without the job token (everything else still needs it)",
    )
    add_tls_flags(p)
    p.add_argument(
        "--forget-nodes",
        action="store_true",
        help="drop the nodes recovered from the store at once (they are known dead)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def _settings(run: RunSettings, job_name: str) -> MasterSettings:
    return MasterSettings(
        job_name=job_name,
        shard=ShardSettings(lease_timeout_ms=run.lease_timeout_ms),
        liveness=LivenessSettings(
            heartbeat_interval_ms=run.heartbeat_interval_ms,
            heartbeat_timeout_ms=run.heartbeat_timeout_ms,
        ),
        rendezvous=RendezvousSettings(
            min_nodes=run.min_nodes,
            max_nodes=run.world_max,
            node_unit=run.node_unit,
            last_call_timeout_ms=run.last_call_timeout_ms,
            join_timeout_ms=run.join_timeout_ms,
        ),
        node_check=NodeCheckSettings(
            slow_factor=run.node_check_slow_factor,
            step_timeout_ms=run.node_check_timeout_ms,
            expected_nodes=run.world_max,
        ),
        restart_loop=BreakerSettings(
            failures=run.restart_loop_failures, window=run.restart_loop_window
        ),
    )


def _http(args: argparse.Namespace) -> HttpSettings | None:
    if args.http_port is None:
        return None
    return HttpSettings(
        host=args.http_host, port=args.http_port, open_metrics=args.http_open_metrics
    )


def _claim_advice(exc: StoreClaimError, args: argparse.Namespace) -> str:
    """How to go on from a store this master may not take (after its reason)."""
    new_job = "or another --state-store (a new file or database) to start a new job"
    if isinstance(exc, StoreHoldsAnotherJob):
        return f": pass --job-name {exc.held_name} --resume to continue that job, {new_job}"
    default = (
        f" (the default store: {DEFAULT_STORE} in the current directory, {os.getcwd()})"
        if args.store == DEFAULT_STORE
        else ""
    )
    return f", and a store holds one job: pass --resume to continue that job, {new_job}{default}"


def _print_crd(argv: list[str]) -> int:
    """`dlmaster crd`: the DLFleetJob CustomResourceDefinition, as YAML, for
    `kubectl apply -f -` (deploy/crd/dlfleetjob.yaml holds the same)."""
    parser = argparse.ArgumentParser(
        prog="dlmaster crd", description="Print the DLFleetJob CustomResourceDefinition (YAML)."
    )
    parser.parse_args(argv)
    import yaml

    from dlfleet.master.job.crd import definition

    sys.stdout.write("# Made by `dlmaster crd` from job.yaml's schema (JobConfig): do not edit.\n")
    sys.stdout.write(yaml.safe_dump(definition(), sort_keys=False, width=100))
    return 0


def _operator(argv: list[str]) -> int:
    """`dlmaster operator`: the DLFleetJob controller, until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(
        prog="dlmaster operator",
        description="Run the DLFleetJob controller: for each DLFleetJob, its master Job, "
        "job.yaml and token, owned by the resource; its status kept.",
    )
    parser.add_argument("--image", required=True, help="the master image of the jobs' masters")
    parser.add_argument("--namespace", help="watch this namespace only (default: all)")
    parser.add_argument("--kubeconfig", help="default: in-cluster, else $KUBECONFIG")
    parser.add_argument(
        "--service-account", default="dlfleet-master", help="the masters' (dlfleet-master)"
    )
    parser.add_argument(
        "--master-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable set in every master's container (repeat for more)",
    )
    parser.add_argument("--period", type=float, default=2.0, help="seconds between passes (2)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if not args.period > 0:
        parser.error(f"--period must be > 0 seconds, got {args.period}")
    master_env = {}
    for item in args.master_env:
        name, equals, value = item.partition("=")
        if not equals or not name:
            parser.error(f"--master-env {item!r}: expected NAME=VALUE")
        master_env[name] = value
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    import signal
    import threading

    from dlfleet.master.job.platform.kubernetes import connect
    from dlfleet.master.operator.controller import Operator
    from dlfleet.master.operator.plan import OperatorSettings

    settings = OperatorSettings(
        master_image=args.image, service_account=args.service_account, master_env=master_env
    )
    try:
        api = connect(args.kubeconfig)
    except DlfleetError as exc:
        print(f"dlmaster operator: {exc}", file=sys.stderr)
        return 2
    operator = Operator(api, settings, args.namespace)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    where = f"namespace {args.namespace}" if args.namespace else "every namespace"
    logging.getLogger("dlfleet.operator").info("watching DLFleetJobs in %s", where)
    operator.run(stop, args.period)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("scale", "status"):
        from dlfleet.master.job.control import control_main

        return control_main(argv)
    if argv and argv[0] == "crd":
        return _print_crd(argv[1:])
    if argv and argv[0] == "operator":
        return _operator(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.job_config is not None:
        from dlfleet.master.job.run_job import run_job_main

        return run_job_main(args.job_config, args.log_level)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.http_port is not None and not 0 <= args.http_port <= 65535:
        parser.error(f"--http-port must be in 0..65535, got {args.http_port}")
    try:
        settings = _settings(RunSettings.from_args(args), args.job_name)
    except DlfleetError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    token = TOKEN_FLAGS.token(args, parser)
    args.tls = tls_from_flags(args, parser)
    try:
        asyncio.run(
            serve(
                settings,
                store_url=args.store,
                token=token,
                host=args.host,
                port=args.port,
                tls=args.tls,
                forget_nodes=args.forget_nodes,
                http=_http(args),
                resume=args.resume,
            )
        )
    except StoreClaimError as exc:
        print(f"dlmaster: --state-store {exc}{_claim_advice(exc, args)}", file=sys.stderr)
        return 2
    except PortInUse as exc:
        flag = PORT_FLAGS[exc.endpoint]
        print(
            f"dlmaster: {exc} ({flag} {exc.port}): stop what holds it, or pass another "
            f"{flag} (0 picks a free one)",
            file=sys.stderr,
        )
        return 2
    except DlfleetError as exc:
        print(f"dlmaster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

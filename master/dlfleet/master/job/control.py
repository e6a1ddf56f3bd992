"""`dlmaster scale` and `dlmaster status`: talk to a running job's master.

    dlmaster scale --job-config job.yaml --nodes 2
    dlmaster status --job-config job.yaml [--json]
    dlmaster status --master HOST:PORT --token-file FILE

With --job-config, the master's address and the token come from the job's
workdir (written by the running `dlmaster --job-config`). A master started
alone (`dlmaster --port ...`) runs no job supervisor, so it answers neither:
`--master` at one is told so, and where to look instead.

Runs in its own short-lived process, a client of the running job: the
supervisor answers (its Job service, at the address in the job's workdir).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.env import TOKEN_ENV
from dlfleet.api.errors import DlfleetError, Unimplemented
from dlfleet.api.status_document import status_document
from dlfleet.master.job.display import status_lines
from dlfleet.master.job.jobconfig import load_job_config
from dlfleet.master.job.runner import job_token, read_master_file


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlmaster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("scale", "change the number of nodes"), ("status", "show the job")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("--job-config", type=Path, help="the job.yaml of the running job")
        c.add_argument("--master", help="HOST:PORT of the master (instead of --job-config)")
        c.add_argument("--token-file", type=Path, help=f"the job token (or ${TOKEN_ENV})")
        if name == "scale":
            c.add_argument("--nodes", type=int, required=True, help="nodes wanted")
        else:
            c.add_argument("--json", action="store_true", help="print the status as JSON")
        c.add_argument("--tls-ca", type=Path, help="PEM root certificate of a TLS master")
    return p


def no_supervisor(command: str, master: str) -> str:
    """What `dlmaster status|scale` says to a master that serves no Job service."""
    instead = (
        "its status is at /api/v1/status of its HTTP endpoint (--http-port)"
        if command == "status"
        else "its node range is its --min-nodes and --max-nodes"
    )
    return (
        f"dlmaster {command}: {master} is a master without a job supervisor: `dlmaster "
        f"{command}` is served only by a job run with `dlmaster --job-config job.yaml` (pass "
        f"that job.yaml as --job-config here); for a master started alone, {instead}"
    )


def control_main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.job_config is not None:
            config = load_job_config(args.job_config)
            master, token = read_master_file(config), job_token(config)
            ca_file = config.tls_ca_file
        elif args.master:
            master = args.master
            ca_file = args.tls_ca
            token = (
                args.token_file.read_text().strip()
                if args.token_file
                else os.environ.get(TOKEN_ENV, "")
            )
        else:
            parser.error("give --job-config or --master")
    except (DlfleetError, OSError) as exc:
        print(f"dlmaster {args.command}: {exc}", file=sys.stderr)
        return 2
    retry = RetryPolicy(attempts=3, max_backoff_s=0.5, total_budget_s=5.0)
    tls_ca = ca_file.read_bytes() if ca_file is not None else None
    with MasterClient(master, token=token, retry=retry, tls_ca=tls_ca) as client:
        try:
            if args.command == "scale":
                answer = client.scale(args.nodes)
                print(f"scaled from {answer.previous} to {answer.nodes} nodes")
                return 0
            status = client.job_status()
        except Unimplemented:
            print(no_supervisor(args.command, master), file=sys.stderr)
            return 1
        except DlfleetError as exc:
            print(f"dlmaster {args.command}: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(status_document(status), indent=2))
    else:
        print("\n".join(status_lines(status)))
        if status.http_url:
            print(f"  http: {status.http_url} (/metrics, /api/v1/status)")
    return 0

"""`dlbrain`: the brain as a standalone gRPC service, and its reports.

    dlbrain --db postgresql+psycopg://brain@db/brain --port 50052 --token-file token.txt
    dlbrain report JOB --db URL [--svg chart.svg]
    dlbrain migrate --db URL

The service migrates the database to the current schema, then serves until
SIGTERM or SIGINT (exit 0). Bad flags exit 2; a database or bind failure
exits 1 with the reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from dlfleet.api.env import BRAIN_DB_ENV, BRAIN_TOKEN_ENV
from dlfleet.api.errors import DlfleetError
from dlfleet.api.serving.flags import TokenFlags, add_tls_flags, tls_from_flags
from dlfleet.brain.api import DEFAULT_DB_URL

# Flags are checked before the database and gRPC libraries are imported (in
# the commands), so a mistake is answered at once.

DEFAULT_PORT = 50052
TOKEN_FLAGS = TokenFlags(env=BRAIN_TOKEN_ENV, noun="token", both_refused=True)


def _db_default() -> str:
    return os.environ.get(BRAIN_DB_ENV, DEFAULT_DB_URL)


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlbrain",
        description="The dlfleet brain: job metrics in a database, resource plans over gRPC. "
        "Also: `dlbrain report JOB`, `dlbrain migrate`.",
    )
    p.add_argument(
        "--db",
        default=_db_default(),
        help=f"database URL (default ${BRAIN_DB_ENV} or {DEFAULT_DB_URL})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"0 = any (default {DEFAULT_PORT})"
    )
    TOKEN_FLAGS.add_to(p)
    add_tls_flags(p)
    p.add_argument("--workers", type=int, default=8, help="RPC threads (default 8)")
    p.add_argument("--log-level", default="INFO")
    return p


def _report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlbrain report",
        description="A job's throughput per node count and the brain's decisions.",
    )
    p.add_argument("job", help="the job's name")
    p.add_argument("--db", default=_db_default(), help="database URL")
    p.add_argument("--svg", type=Path, help="also write a chart to this SVG file")
    return p


def _migrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlbrain migrate", description="Upgrade the database to the current schema."
    )
    p.add_argument("--db", default=_db_default(), help="database URL")
    return p


def serve(argv: Sequence[str]) -> int:
    parser = _serve_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: not a port")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    token = TOKEN_FLAGS.token(args, parser)
    tls = tls_from_flags(args, parser)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from dlfleet.brain.local import LocalBrain
    from dlfleet.brain.server import BrainServer

    brain = LocalBrain.open(args.db)
    server = BrainServer(
        brain, token=token, host=args.host, port=args.port, max_workers=args.workers, tls=tls
    )
    try:
        port = server.start()
        print(
            f"dlbrain: listening on {args.host}:{port}, database {brain.repository.url}", flush=True
        )
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        stop.wait()
        print("dlbrain: stopping", flush=True)
    finally:
        server.stop(grace_s=2.0)
        brain.close()
    return 0


def report(argv: Sequence[str]) -> int:
    args = _report_parser().parse_args(argv)
    from dlfleet.brain.local import LocalBrain
    from dlfleet.brain.report import render_svg, render_text

    brain = LocalBrain.open(args.db)
    try:
        job_report = brain.report(args.job)
    finally:
        brain.close()
    sys.stdout.write(render_text(job_report))
    if args.svg is not None:
        args.svg.write_text(render_svg(job_report))
        print(f"chart: {args.svg}")
    return 0


def migrate(argv: Sequence[str]) -> int:
    args = _migrate_parser().parse_args(argv)
    from dlfleet.brain import schema

    print(f"schema at revision {schema.migrate(args.db)}")
    return 0


COMMANDS = {"report": report, "migrate": migrate, "serve": serve}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = serve
    if args and args[0] in COMMANDS:
        command = COMMANDS[args.pop(0)]
    try:
        return command(args)
    except DlfleetError as error:
        print(f"dlbrain: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

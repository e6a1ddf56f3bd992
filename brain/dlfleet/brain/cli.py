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
from dlfleet.brain.api import DEFAULT_DB_URL

# Flags are checked before the database and gRPC libraries are imported (in
# the commands), so a mistake is answered at once.

DEFAULT_PORT = 50052


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
    p.add_argument(
        "--token",
        help=f"the token every RPC must carry (prefer --token-file or ${BRAIN_TOKEN_ENV})",
    )
    p.add_argument("--token-file", type=Path, help="file holding the token")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS only")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
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


def _token(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    if args.token is not None and args.token_file is not None:
        parser.error("pass --token or --token-file, not both")
    if args.token_file is not None:
        try:
            token = str(args.token_file.read_text()).strip()
        except OSError as exc:
            parser.error(f"--token-file {args.token_file}: {exc.strerror}")
    else:
        token = str(args.token or os.environ.get(BRAIN_TOKEN_ENV, ""))
    if not token:
        parser.error(f"no token: pass --token-file, --token, or set ${BRAIN_TOKEN_ENV}")
    return token


def _tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[bytes, bytes] | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return None
    pair = []
    for flag, path, marker in (
        ("--tls-cert", args.tls_cert, b"-----BEGIN CERTIFICATE-----"),
        ("--tls-key", args.tls_key, b"PRIVATE KEY-----"),
    ):
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            parser.error(f"{flag} {path}: {exc.strerror}")
        if marker not in data:
            parser.error(f"{flag} {path}: not PEM")
        pair.append(data)
    return pair[0], pair[1]


def serve(argv: Sequence[str]) -> int:
    parser = _serve_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: not a port")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    token = _token(args, parser)
    tls = _tls(args, parser)
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

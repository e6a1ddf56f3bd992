"""The token and TLS flags of a server's command line (`dlmaster`, `dlbrain`),
and how they become a token and a TLS pair: one wording, one precedence, one
exit (the parser's usage error, status 2) for every mistake."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from dlfleet.api.errors import DlfleetError
from dlfleet.api.serving.tls import TlsPair, load_tls_pair


@dataclass(frozen=True)
class TokenFlags:
    """`--token` and `--token-file` of one program."""

    env: str  # the environment variable read when neither flag is given
    noun: str = "job token"  # what the token is called in help and errors
    both_refused: bool = False  # both flags: an error (else the file wins)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--token-file", type=Path, help=f"file holding the {self.noun}")
        parser.add_argument(
            "--token",
            help=f"the {self.noun} every RPC must carry (prefer --token-file or ${self.env})",
        )

    def token(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
        """The token the flags or the environment give; a usage error if none."""
        if self.both_refused and args.token is not None and args.token_file is not None:
            parser.error("pass --token or --token-file, not both")
        if args.token_file is not None:
            try:
                token = str(args.token_file.read_text()).strip()
            except OSError as exc:
                parser.error(f"--token-file {args.token_file}: {exc.strerror}")
        else:
            token = str(args.token or os.environ.get(self.env, ""))
        if not token:
            parser.error(f"no {self.noun}: pass --token-file, --token, or set ${self.env}")
        return token


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS only")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def tls_from_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TlsPair | None:
    """The pair `--tls-cert`/`--tls-key` name, None without them; a usage error
    for one without the other or a file that is not PEM."""
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return None
    try:
        return load_tls_pair(args.tls_cert, args.tls_key)
    except DlfleetError as exc:
        parser.error(str(exc))

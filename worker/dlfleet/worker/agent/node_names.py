"""The default name of a node: its host's name, told apart when several
`dlworker`s of one job run on the host.

At the master a name is a node: an agent registering under a name in use is
that node's new incarnation, and the one before it is dropped. Two agents of
one job on one host, both named after the host, would so replace each other.
The first agent of a job on a host is named after the host, as it always was;
each further agent running beside it gets the lowest number no running agent
of the job there holds: `HOST_1`, `HOST_2`, ...

A number is held by an advisory lock (flock) on a file under the temp dir,
taken when the agent's settings are parsed and kept until its process ends:
the kernel lets go of it however the process ends, SIGKILL included. An agent
started again after its predecessor died takes the number back, so it keeps
its predecessor's name and replaces it at the master at once (as a lone agent
on a host always did), rather than leaving it to be dropped for missed
heartbeats.

Numbers are kept apart per job name, per user and per temp dir: agents of
different users, or in containers with /tmp of their own, are not told apart
(containers have hostnames of their own too). `--node-name` is the way out.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path

_log = logging.getLogger(__name__)

# No hostname has one (RFC 1123), so `HOST_1` is never another host's name.
SEPARATOR = "_"
MAX_AGENTS = 1024  # of one job on one host


def numbered(hostname: str, number: int) -> str:
    """The name of the agent that holds `number` on `hostname`."""
    return hostname if number == 0 else f"{hostname}{SEPARATOR}{number}"


def lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"dlfleet-{os.getuid()}" / "node-names"


def claim_number(job_name: str, directory: Path | None = None) -> int:
    """The lowest number no other running agent of `job_name` holds on this
    host, held by this process from now until it ends (asked again: the lowest
    number it holds or can take). 0 (the hostname alone) when the locks cannot
    be kept: the agent then runs as it did before there were numbers."""
    directory = directory or lock_dir()
    stem = _stem(job_name)
    me = str(os.getpid()).encode()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for number in range(MAX_AGENTS):
            if _hold(directory / f"{stem}.{number}.lock", me):
                return number
    except OSError as exc:
        _log.warning(
            "cannot tell this node's name apart from other dlworkers' on this host (%s: %s): "
            "naming it after the host; pass --node-name to be sure",
            directory, exc.strerror,
        )  # fmt: skip
        return 0
    _log.warning(
        "%d dlworkers of job %s already run on this host: naming this one after the host; "
        "pass --node-name",
        MAX_AGENTS, job_name,
    )  # fmt: skip
    return 0


def _hold(path: Path, me: bytes) -> bool:
    """Whether this process holds the lock on `path` (taken now, or before)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).strip()
        finally:
            os.close(fd)  # a flock belongs to the holder's open file: this close keeps it
        return holder == me
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, me, 0)
    # `fd` stays open, on purpose: the lock lasts as long as this process.
    return True


def _stem(job_name: str) -> str:
    """A file name for the job's locks, readable and never two jobs'."""
    readable = re.sub(r"[^A-Za-z0-9.-]", "-", job_name)[:48]
    return f"{readable}-{hashlib.sha256(job_name.encode()).hexdigest()[:12]}"

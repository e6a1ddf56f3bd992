"""Child processes that die with their parent (Linux's parent-death signal).

Shared by the agent (its training processes must not outlive it: an orphan
would keep training in a stale round) and the master's local platform (the
dlworker processes of a local job end with the master that spawned them).
"""

from __future__ import annotations

import os
import shutil
import sys


def die_with_parent(command: list[str]) -> list[str]:
    """Prefix `command` so the child gets SIGKILL when this process dies. The
    signal is set by util-linux's `setpriv` right before it execs. Not
    `preexec_fn`: running Python in a child forked from a process whose gRPC
    threads are live can crash that child before it execs. Without setpriv (or
    off Linux) the command is returned unchanged."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or not sys.platform.startswith("linux") or not os.path.exists("/bin/sh"):
        return command
    if shutil.which(command[0]) is None:
        return command  # let Popen report the missing program itself
    # setpriv arms the signal after the fork: a parent killed in between would
    # leave the child orphaned with no signal armed. The shell checks, once the
    # signal is armed, that its parent is still this process, and only then
    # execs the command (same pid throughout).
    guard = 'test "$PPID" = "$0" || exit 137; exec "$@"'
    return [
        setpriv,
        "--pdeathsig",
        "KILL",
        "--",
        "/bin/sh",
        "-c",
        guard,
        str(os.getpid()),
        *command,
    ]

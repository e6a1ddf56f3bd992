"""Child processes that die with their parent (Linux's parent-death signal),
and the names processes give themselves.

Shared by the agent (its training processes must not outlive it: an orphan
would keep training in a stale round) and the master's local platform (the
dlworker processes of a local job end with the master that spawned them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys

# Process names (/proc/<pid>/comm) of a worker's Python: tools tell spares
# (primed by the agent, or waiting in `dlfleet.elastic.run`) from ranks.
SPARE_NAME = "dlfleet-spare"
RANK_NAME = "dlfleet-rank"


def name_process(name: str) -> None:
    """Set this process's name as `ps` and /proc/<pid>/comm show it."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name)


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

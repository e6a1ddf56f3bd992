"""The node check process: what measures a node for its pre-flight check
(SPEC section 11), a matmul on its device and all-reduces with the peers the
master pairs it with. Started by the node's agent as
`python -m dlfleet.worker.nodecheck` (see `__main__`); the agent never imports
the measuring part (`probe`, which imports torch), only this module's exit
codes and names.

Test hook: `$DLFLEET_NODE_CHECK_SLOWDOWN` makes nodes slow, for tests and
benchmarks: `3` (every node that reads it) or `node-2#1:3,node-5:2.5` (by node
id, or by name for every incarnation). Each matmul and each all-reduce
iteration is then followed by a sleep of (factor - 1) x its own time, as on a
device or a link that much slower. A cgroup CPU quota needs no hook: it
stretches the measured wall time by itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from dlfleet.api.env import NODE_CHECK_SLOWDOWN_ENV

MODULE = "dlfleet.worker.nodecheck"

EXIT_HEALTHY = 0
EXIT_BROKEN = 1  # the check itself could not run (reported to the master when it could be)
EXIT_LOST = 3  # the master could not be reached, or no longer knows this node
EXIT_FAULTY = 6  # the master's verdict: this node is faulty


def slowdown_for(node_id: str, environ: Mapping[str, str]) -> float:
    """The test hook's factor for `node_id` (1.0: none). A value that does
    not parse is an error: a test that means to slow a node must."""
    text = environ.get(NODE_CHECK_SLOWDOWN_ENV, "").strip()
    if not text:
        return 1.0
    if ":" not in text:
        return _factor(text)
    name = node_id.rpartition("#")[0]
    for item in text.split(","):
        who, _, factor = item.strip().rpartition(":")
        if who in (node_id, name):
            return _factor(factor)
    return 1.0


def _factor(text: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(f"${NODE_CHECK_SLOWDOWN_ENV}: {text!r} is not a factor") from None
    if not 1.0 <= factor <= 1000.0:
        raise ValueError(f"${NODE_CHECK_SLOWDOWN_ENV}: a factor must be in 1..1000, got {factor}")
    return factor

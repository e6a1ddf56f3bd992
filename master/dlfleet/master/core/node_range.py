"""A node's --nnodes against the master's node range: which decides, and what
each side is told.

torchrun's nodes each carry `--nnodes MIN:MAX`; here the master's rendezvous
settings (`--min-nodes`, `--max-nodes`; job.yaml's `nodes`) decide the world
size, and a node's own range is only what its user believed. So a range that
differs is a warning, on both sides, naming both ranges and the one that
decides; a range that cannot overlap the master's (a MIN above its max: the
world the node asks for never forms; a MAX below its min: every world that
forms is larger than the node allows) is refused at registration, with the
flag that would fix it. A node that gave no range is told nothing.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.rendezvous import RendezvousSettings


@dataclass(frozen=True)
class NodeRange:
    min_nodes: int
    max_nodes: int

    def __str__(self) -> str:
        """As --nnodes takes it: N, or MIN:MAX."""
        if self.min_nodes == self.max_nodes:
            return str(self.min_nodes)
        return f"{self.min_nodes}:{self.max_nodes}"

    def in_words(self) -> str:
        if self.min_nodes == self.max_nodes:
            return f"{self.min_nodes} node{'s' if self.min_nodes > 1 else ''}"
        return f"{self.min_nodes} to {self.max_nodes} nodes"


def requested_range(min_nodes: int, max_nodes: int) -> NodeRange | None:
    """A registration's range from the wire: None where the node gave none
    (both 0); InvalidArgument where it is no range."""
    if min_nodes == max_nodes == 0:
        return None
    if not 1 <= min_nodes <= max_nodes:
        raise InvalidArgument(
            f"--nnodes must be MIN:MAX with 1 <= MIN <= MAX, got {min_nodes}:{max_nodes}"
        )
    return NodeRange(min_nodes, max_nodes)


def judge_range(requested: NodeRange | None, settings: RendezvousSettings) -> str:
    """What a node started with `requested` is told: "" when it gave none or
    it matches the master's; else a warning (one line, for the node's log and
    the master's). Raises InvalidArgument when the two cannot overlap."""
    if requested is None:
        return ""
    master = NodeRange(settings.min_nodes, settings.max_nodes)
    if requested == master:
        return ""
    decides = (
        f"the master's --min-nodes {master.min_nodes} --max-nodes {master.max_nodes} "
        "decide the world size"
    )
    if requested.min_nodes > master.max_nodes:
        raise InvalidArgument(
            f"--nnodes {requested} cannot be met: {decides}, and a round of "
            f"{requested.min_nodes} or more nodes never forms there; start the node with "
            f"--nnodes {master} (or the master with --max-nodes {requested.min_nodes})"
        )
    if requested.max_nodes < master.min_nodes:
        raise InvalidArgument(
            f"--nnodes {requested} cannot be met: {decides}, and every round has at least "
            f"{master.min_nodes} nodes there; start the node with --nnodes {master} "
            f"(or the master with --min-nodes {requested.max_nodes})"
        )
    return (
        f"--nnodes {requested} is not the master's node range: {decides} "
        f"(rounds of {master.in_words()}); this node's --nnodes is ignored"
    )

"""Which nodes publish an address the rest of their round cannot reach.

A node publishes the address its store, its checkpoint keeper and its
collectives listen on. A loopback address (127.0.0.0/8, ::1) reaches only
the node's own machine: published into a round that has nodes on other
machines, every one of them would wait on its own loopback for a store that
is not there, silently, until a timeout (what torchrun does when a hostname
resolves to 127.0.1.1). So such a round must not form, and the node is told
why at once.

Which machine a node is on is what the master saw: the IP its connection
came from. Nodes seen from one IP are one machine; a node whose connection
the master did not see (a master restart before the node's next session)
counts as no machine of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dlfleet.api.addresses import is_loopback


@dataclass(frozen=True)
class Published:
    """One node's side: what it publishes, and where the master saw it from."""

    host: str
    seen_from: str  # "" when unknown


def unreachable(nodes: Mapping[str, Published]) -> dict[str, str]:
    """node id -> why, for each node publishing a loopback address while the
    nodes are on more than one machine. Empty when all can reach each other
    as far as the master can tell."""
    machines = {p.seen_from for p in nodes.values() if p.seen_from}
    if len(machines) < 2:
        return {}
    refused: dict[str, str] = {}
    for node_id, published in nodes.items():
        if not is_loopback(published.host):
            continue
        others = sorted(machines - {published.seen_from})
        refused[node_id] = (
            f"node {node_id} publishes {published.host}, a loopback address that the nodes on "
            f"other machines ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) "
            "cannot reach: start its dlworker with --local-addr ADDR (its address on the "
            "network the nodes share), or give --master the master's network address, "
            "not a loopback one"
        )
    return refused

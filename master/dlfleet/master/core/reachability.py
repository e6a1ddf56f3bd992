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

from collections.abc import Callable, Mapping
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


class Publishers:
    """What the nodes of the rendezvous publish, kept as they join, so that a
    join asks `unreachable` only when a refusal is possible: the nodes span
    two machines or more and one of them publishes a loopback address. At
    ten thousand nodes, building the whole mapping at every join took the
    master's loop for seconds at a time (O(nodes) per join).

    Nodes are not told to leave: whoever asks says which are still in the
    rendezvous (`present`), and the others are forgotten as they are met
    (each once), so a join costs O(1) amortized."""

    def __init__(self) -> None:
        self._machine_of: dict[str, str] = {}  # node id -> seen from ("" unknown)
        self._by_machine: dict[str, set[str]] = {}  # seen from -> node ids
        self._loopback: set[str] = set()  # node ids publishing a loopback address

    def joined(self, node_id: str, published: Published) -> None:
        self._forget(node_id)
        self._machine_of[node_id] = published.seen_from
        if published.seen_from:
            self._by_machine.setdefault(published.seen_from, set()).add(node_id)
        if is_loopback(published.host):
            self._loopback.add(node_id)

    def may_refuse(self, present: Callable[[str], bool]) -> bool:
        """Whether `unreachable` over the present nodes can refuse any: some
        present node publishes a loopback address, and the present nodes
        were seen from two machines or more."""
        gone: list[str] = []
        try:
            if not self._first_present(self._loopback, present, gone):
                return False
            machines = 0
            for nodes in self._by_machine.values():
                if self._first_present(nodes, present, gone):
                    machines += 1
                    if machines >= 2:
                        return True
            return False
        finally:
            for node_id in gone:
                self._forget(node_id)

    @staticmethod
    def _first_present(nodes: set[str], present: Callable[[str], bool], gone: list[str]) -> bool:
        """Whether one of `nodes` is present; those met that are not go to
        `gone` (forgotten after: the sets are not changed while walked)."""
        for node_id in nodes:
            if present(node_id):
                return True
            gone.append(node_id)
        return False

    def _forget(self, node_id: str) -> None:
        machine = self._machine_of.pop(node_id, None)
        if machine:
            nodes = self._by_machine[machine]
            nodes.discard(node_id)
            if not nodes:
                del self._by_machine[machine]
        self._loopback.discard(node_id)

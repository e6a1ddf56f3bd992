"""Network failures, counted against the node they point at.

A worker that fails with a network error (the diagnosis's `network`
category) often names the peer it lost: gloo's "Connection closed by peer
[10.0.0.3]:41022", "Read error [10.0.0.3]:...", NCCL's socket warnings. The
master knows the host of every member of the round, so it can tell which
nodes a failure names. A node with a flaky link makes the others fail round
after round, all naming it; it names each of them once at most.

- A failure *names* a member of its round when that member's host appears in
  its text as a whole address, and the member is not the reporter and not on
  the reporter's host (a failure cannot tell two nodes of one host apart).
- A round *blames* the member named by the most reporters (distinct nodes),
  when no other member is named by as many: between two nodes that name each
  other nobody can be told, and nobody is blamed. A member that itself failed
  for another reason in that round (killed, out of memory...) explains its
  peers' errors: it is not blamed for them.
- Only closed rounds count (a newer round has formed: every survivor reported
  its failure before it rejoined). A member blamed in `suspect_after` rounds is
  a *suspect*: the job's supervisor replaces it.

Bounded: the last `keep_rounds` rounds with network failures are kept. Pure:
no clock, no I/O; the master feeds it the failure reports of its rounds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dlfleet.api.errors import InvalidArgument

NETWORK = "network"  # the diagnosis category that counts
SUSPECT_AFTER_ROUNDS = 2
KEEP_ROUNDS = 64


@dataclass(frozen=True)
class Suspect:
    node_id: str
    rounds: tuple[int, ...]  # the closed rounds that blamed it, oldest first

    def describe(self) -> str:
        rounds = ", ".join(str(r) for r in self.rounds)
        return f"network errors of other nodes named it in rounds {rounds}"


@dataclass
class _Round:
    named: dict[str, set[str]] = field(default_factory=dict)  # member -> reporters naming it
    failed_otherwise: set[str] = field(default_factory=set)  # members with non-network failures

    def blamed(self) -> str | None:
        counts = {
            node: len(reporters)
            for node, reporters in self.named.items()
            if node not in self.failed_otherwise
        }
        if not counts:
            return None
        most = max(counts.values())
        leaders = [node for node, count in counts.items() if count == most]
        if len(leaders) > 1:
            return None
        # Named as often as a member left out above: nobody can be told apart.
        if any(len(self.named[node]) >= most for node in self.failed_otherwise & self.named.keys()):
            return None
        return leaders[0]


class NetworkSuspicion:
    def __init__(
        self, suspect_after: int = SUSPECT_AFTER_ROUNDS, keep_rounds: int = KEEP_ROUNDS
    ) -> None:
        if suspect_after < 1:
            raise InvalidArgument(f"suspect_after must be at least 1, got {suspect_after}")
        if keep_rounds < suspect_after:
            raise InvalidArgument(
                f"keep_rounds ({keep_rounds}) must be at least suspect_after ({suspect_after})"
            )
        self.suspect_after = suspect_after
        self.keep_rounds = keep_rounds
        self._rounds: dict[int, _Round] = {}

    def failed(
        self,
        round_: int,
        reporter: str,
        category: str,
        text: str,
        hosts: Mapping[str, str],
    ) -> tuple[str, ...]:
        """A worker of `reporter` failed in `round_` (whose members' hosts are
        `hosts`, node id -> host). Returns the members its failure names (none
        unless it is a network failure)."""
        if round_ < 1:
            raise InvalidArgument(f"a failure's round must be >= 1, got {round_}")
        if reporter not in hosts:
            raise InvalidArgument(f"{reporter} is not a member of round {round_}")
        record = self._round(round_)
        if category != NETWORK:
            record.failed_otherwise.add(reporter)
            return ()
        named = names(text, reporter, hosts)
        for node in named:
            record.named.setdefault(node, set()).add(reporter)
        return named

    def blamed(self, round_: int) -> str | None:
        record = self._rounds.get(round_)
        return record.blamed() if record is not None else None

    def suspects(self, current_round: int) -> list[Suspect]:
        """Members blamed in at least `suspect_after` rounds before
        `current_round` (the closed ones), in node id order."""
        blamed: dict[str, list[int]] = {}
        for round_, record in sorted(self._rounds.items()):
            if round_ >= current_round:
                continue
            node = record.blamed()
            if node is not None:
                blamed.setdefault(node, []).append(round_)
        return [
            Suspect(node, tuple(rounds))
            for node, rounds in sorted(blamed.items())
            if len(rounds) >= self.suspect_after
        ]

    def forget(self, node_ids: Iterable[str]) -> None:
        """Nodes replaced or gone for good: nothing is held against them (or
        for them) any more."""
        gone = set(node_ids)
        for record in self._rounds.values():
            for node in gone:
                record.named.pop(node, None)
            record.failed_otherwise -= gone
            for reporters in record.named.values():
                reporters.difference_update(gone)

    def _round(self, round_: int) -> _Round:
        record = self._rounds.get(round_)
        if record is None:
            record = self._rounds[round_] = _Round()
            while len(self._rounds) > self.keep_rounds:
                del self._rounds[min(self._rounds)]
        return record


def names(text: str, reporter: str, hosts: Mapping[str, str]) -> tuple[str, ...]:
    """The members whose host `text` mentions as a whole address, other than
    the reporter and the members on the reporter's host, in node id order."""
    own = hosts.get(reporter, "")
    found = []
    for node, host in sorted(hosts.items()):
        if node == reporter or not host or host == own:
            continue
        if re.search(rf"(?<![\w.:-]){re.escape(host)}(?![\w.-])", text):
            found.append(node)
    return tuple(found)

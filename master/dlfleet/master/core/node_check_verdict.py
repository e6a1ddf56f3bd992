"""The pre-flight node check's verdicts: from a cohort's measurements to
healthy or faulty, with the numbers that decided (see `node_check` for how
they are taken).

A node is faulty when, in this order of rules:
- `check_failed`: its check process could not run (it says why);
- `hung`: it did not answer within the step timeout (start-up, its matmul,
  or its side of a pair, where the peer did answer);
- `compute_slow`: its matmul took more than `slow_factor` x the median of the
  other nodes' (its cohort's, and healthy nodes' from earlier cohorts on
  other hosts: on its own host they are training now, and it shares their
  device);
- `pairs_failed` / `pairs_slow`: it has pairs with two or more different
  partners and every one of them failed or was slow; slow meaning above
  `slow_factor` x the median of the other nodes' best pair times. Each partner
  of a bad node keeps one good pair, so only the bad node is faulted. A pair
  with a healthy helper node fails the late node if it fails; it is never
  slow (the helper is busy training).

With one pair only (a cohort of two, without helpers) nothing isolates the
bad side: the pair faults neither node, unless one side went silent.

Pure functions of their arguments; no clock, no I/O.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class CheckRule(enum.Enum):
    HEALTHY = "healthy"
    CHECK_FAILED = "check_failed"
    HUNG = "hung"
    COMPUTE_SLOW = "compute_slow"
    PAIRS_FAILED = "pairs_failed"
    PAIRS_SLOW = "pairs_slow"


class PairOutcome(enum.Enum):
    GOOD = "good"
    SLOW = "slow"
    FAILED = "failed"  # both sides answered, at least one failed: both are suspects
    PEER_FAILED = "peer_failed"  # the peer went silent or away: not held against this node
    SILENT = "silent"  # this node did not answer
    UNATTRIBUTED = "unattributed"  # failed, but nothing says which side (one pair only)


# The outcomes that speak about this node (and its partner alike).
_COUNTED = (PairOutcome.GOOD, PairOutcome.SLOW, PairOutcome.FAILED)


@dataclass(frozen=True)
class PairSide:
    ok: bool
    allreduce_ms: float
    error: str = ""
    gone: bool = False  # the side left the check (lost, failed, hung): it blames itself


@dataclass
class PairRun:
    pair: int
    a: str  # rank 0, hosts the store
    b: str  # rank 1 (a healthy helper node when `helper`)
    helper: bool
    started_ms: int
    deadline_ms: int
    sides: dict[str, PairSide] = field(default_factory=dict)

    def peer(self, node_id: str) -> str:
        return self.b if node_id == self.a else self.a


@dataclass(frozen=True)
class PairMeasurement:
    peer: str
    outcome: PairOutcome
    allreduce_ms: float = 0.0  # the slower side's median iteration, when both did it
    error: str = ""
    helper: bool = False


@dataclass(frozen=True)
class Verdict:
    node_id: str
    faulty: bool
    rule: CheckRule
    reason: str  # in words, with the numbers
    slow_factor: float
    compute_ms: float = 0.0  # 0: not measured
    compute_reference_ms: float = 0.0  # the median of the others, 0 if none
    pairs: tuple[PairMeasurement, ...] = ()
    pair_reference_ms: float = 0.0
    took_ms: int = 0  # from the node's begin to this verdict
    at_ms: int = 0
    measure_ms: int = 0  # from its cohort's forming to this verdict: the measuring alone


class Measured(Protocol):
    """What `judge` reads of a node."""

    node_id: str
    host: str
    begun_ms: int
    compute_ms: float | None


def failed_verdict(
    node: Measured,
    rule: CheckRule,
    reason: str,
    now_ms: int,
    slow_factor: float,
    formed_ms: int | None = None,
) -> Verdict:
    """The verdict on a node that failed or hung before its cohort was judged
    (`formed_ms`: when its cohort formed, if it had)."""
    return Verdict(
        node.node_id,
        True,
        rule,
        reason,
        slow_factor,
        compute_ms=node.compute_ms or 0.0,
        took_ms=max(0, now_ms - node.begun_ms),
        at_ms=now_ms,
        measure_ms=max(0, now_ms - formed_ms) if formed_ms is not None else 0,
    )


# Healthy nodes' matmuls from earlier cohorts: node id -> (host, ms).
Earlier = Mapping[str, tuple[str, float]]


def compute_references(members: Sequence[Measured], earlier: Earlier) -> dict[str, float]:
    """Each member's reference matmul time: the median of the others' (its
    cohort's, measured one host at a time, and earlier healthy nodes' on
    other hosts); 0 without any."""
    computes = {m.node_id: m.compute_ms for m in members if m.compute_ms is not None}
    references: dict[str, float] = {}
    for member in members:
        me = member.node_id
        others = [v for k, v in computes.items() if k != me]
        others += [ms for k, (host, ms) in earlier.items() if k != me and host != member.host]
        references[me] = statistics.median(others) if others else 0.0
    return references


def compute_suspects(
    members: Sequence[Measured], earlier: Earlier, slow_factor: float
) -> list[str]:
    """Members whose matmul is slow by the rule: measured again before they
    are judged, so that a moment of noise on the host faults nobody."""
    references = compute_references(members, earlier)
    return [
        m.node_id
        for m in members
        if m.compute_ms is not None and m.compute_ms > slow_factor * references[m.node_id] > 0
    ]


def judge(
    members: Sequence[Measured],
    runs: Sequence[PairRun],
    earlier: Earlier,
    slow_factor: float,
    now_ms: int,
    formed_ms: int,
) -> dict[str, Verdict]:
    """Every member's verdict from its cohort's matmuls and pairs (the cohort
    formed at `formed_ms`)."""
    compute_refs = compute_references(members, earlier)
    measured = {m.node_id: _measure(m.node_id, runs) for m in members}
    bests: dict[str, float] = {}
    for node_id, pairs in measured.items():
        good = [p.allreduce_ms for p in pairs if p.outcome is PairOutcome.GOOD and not p.helper]
        if good:
            bests[node_id] = min(good)
    verdicts: dict[str, Verdict] = {}
    for member in members:
        me = member.node_id
        compute_ref = compute_refs[me]
        pair_others = [v for k, v in bests.items() if k != me]
        pair_ref = statistics.median(pair_others) if pair_others else 0.0
        judged = tuple(_slow_or_good(p, pair_ref, slow_factor) for p in measured[me])
        rule, findings = _decide(member, compute_ref, judged, pair_ref, slow_factor)
        verdicts[me] = Verdict(
            me,
            rule is not CheckRule.HEALTHY,
            rule,
            "; ".join(findings),
            slow_factor,
            compute_ms=member.compute_ms or 0.0,
            compute_reference_ms=compute_ref,
            pairs=judged,
            pair_reference_ms=pair_ref,
            took_ms=max(0, now_ms - member.begun_ms),
            at_ms=now_ms,
            measure_ms=max(0, now_ms - formed_ms),
        )
    return verdicts


def _measure(node_id: str, runs: Sequence[PairRun]) -> list[PairMeasurement]:
    found: list[PairMeasurement] = []
    for run in runs:
        if node_id not in (run.a, run.b):
            continue
        peer = run.peer(node_id)
        mine, theirs = run.sides.get(node_id), run.sides.get(peer)
        if mine is None:
            outcome, ms, error = PairOutcome.SILENT, 0.0, "no answer"
        elif theirs is None or theirs.gone:
            why = theirs.error if theirs is not None else f"{peer} did not answer"
            outcome, ms, error = PairOutcome.PEER_FAILED, 0.0, why
        elif mine.ok and theirs.ok:
            outcome, ms, error = PairOutcome.GOOD, max(mine.allreduce_ms, theirs.allreduce_ms), ""
        else:
            error = mine.error or theirs.error or "failed"
            outcome, ms = PairOutcome.FAILED, 0.0
        found.append(PairMeasurement(peer, outcome, ms, error[:300], run.helper))
    if not any(p.helper for p in found) and len({p.peer for p in found}) == 1:
        # One partner only: a failed pair cannot be blamed on either side.
        found = [
            PairMeasurement(p.peer, PairOutcome.UNATTRIBUTED, 0.0, p.error, p.helper)
            if p.outcome is PairOutcome.FAILED
            else p
            for p in found
        ]
    return found


def _slow_or_good(pair: PairMeasurement, reference: float, factor: float) -> PairMeasurement:
    slow = pair.outcome is PairOutcome.GOOD and not pair.helper and reference > 0
    if slow and pair.allreduce_ms > factor * reference:
        return PairMeasurement(pair.peer, PairOutcome.SLOW, pair.allreduce_ms, "", pair.helper)
    return pair


def _decide(
    member: Measured,
    compute_ref: float,
    pairs: tuple[PairMeasurement, ...],
    pair_ref: float,
    factor: float,
) -> tuple[CheckRule, list[str]]:
    """The first rule that faults the node and what was found, or healthy."""
    faults: list[tuple[CheckRule, str]] = []
    notes: list[str] = []
    silent = [p for p in pairs if p.outcome is PairOutcome.SILENT]
    if silent:
        peers = ", ".join(p.peer for p in silent)
        faults.append((CheckRule.HUNG, f"no result for its all-reduce with {peers}"))
    compute = member.compute_ms
    if compute is not None:
        if compute_ref > 0 and compute > factor * compute_ref:
            faults.append((
                CheckRule.COMPUTE_SLOW,
                f"matmul {compute:.1f} ms, {compute / compute_ref:.1f}x the median "
                f"{compute_ref:.1f} ms of the other nodes (slow_factor {factor:g})",
            ))  # fmt: skip
        else:
            ref = f" (median of the others {compute_ref:.1f} ms)" if compute_ref > 0 else ""
            notes.append(f"matmul {compute:.1f} ms{ref}")
    counted = [p for p in pairs if p.outcome in _COUNTED]
    bad = [p for p in counted if p.outcome is not PairOutcome.GOOD]
    helper_failed = [p for p in bad if p.helper]
    isolated = len({p.peer for p in counted if not p.helper}) >= 2 and len(bad) == len(counted)
    if helper_failed or isolated:
        failed = any(p.outcome is PairOutcome.FAILED for p in bad)
        rule = CheckRule.PAIRS_FAILED if failed else CheckRule.PAIRS_SLOW
        described = ", ".join(_describe(p, pair_ref, factor) for p in bad)
        faults.append((rule, f"all-reduce {described}"))
    elif pairs:
        notes.append("all-reduce " + ", ".join(_describe(p, pair_ref, factor) for p in pairs))
    if faults:
        return faults[0][0], [what for _, what in faults]
    return CheckRule.HEALTHY, notes or ["nothing to compare with"]


def _describe(pair: PairMeasurement, reference: float, factor: float) -> str:
    who = f"with {pair.peer}{' (healthy helper)' if pair.helper else ''}"
    if pair.outcome in (PairOutcome.GOOD, PairOutcome.SLOW):
        ratio = ""
        if reference > 0:
            ratio = f", {pair.allreduce_ms / reference:.1f}x the median {reference:.2f} ms"
        limit = f" (slow_factor {factor:g})" if pair.outcome is PairOutcome.SLOW else ""
        return f"{who} {pair.allreduce_ms:.2f} ms{ratio}{limit}"
    if pair.outcome is PairOutcome.UNATTRIBUTED:
        return f"{who} failed ({pair.error}; with one pair this blames neither node)"
    return f"{who} {pair.outcome.value.replace('_', ' ')} ({pair.error})"

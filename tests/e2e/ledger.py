"""The exactly-once checker for the ledgers of scripts/ledger_train.py: which
records did the model that survived a run train, and was each record of each
epoch among them exactly once?

Input (see ledger_train.py): one `ledger-*.jsonl` file per process, one line
per step with (attempt, rank, world, epoch, step, ids), and `restores.jsonl`,
one line per attempt that resumed with checkpoints: (attempt, restored_step).

The final lineage. Attempts are totally ordered by `attempt` (the rendezvous
round under dlfleet). An attempt that restores the checkpoint of step S rolls
the model back to step S and the master's dataset progress with it, so every
step above S trained by any *earlier* attempt is undone. Hence the rule:

    an entry (attempt a, step s) counts iff no restore of an attempt b > a
    went back to a step S < s.

Entries of one attempt are never discarded by that attempt's own restore (it
happens before the attempt's first step). Without restores (a run without
checkpoints) every entry counts. Ordering needs nothing but the attempt number:
not file order, not clocks.

Why this is exact with checkpoints: ledger_train.py logs a step before the
gradient all-reduce, so a step that completed anywhere (and so may be in a
checkpoint) was logged by every rank, and a logged step that never completed
is above every later restore point (see the script's docstring). The checker
verifies the first half: each counted step of an attempt has a line from
every rank of that attempt's world, and no step is counted from two attempts.

Expected records per epoch: all of range(size); with drop_last, the loader cuts
each epoch to L = size - size % G positions, G being the global batch
(batch size x world size) of the round that first registered the dataset, and
trains positions [0, L) of the epoch's permutation: the records
EpochPermutation(size, seed, epoch)[p] for p < L (another set each epoch when
shuffled). A world change later does not move the cut.

Without checkpoints dlfleet promises at-least-once: steps trained after the
master's last ack or renewal are re-leased to the next round. `allow_replay`
accepts a record trained more than once in an epoch when every occurrence is
in a different attempt (they are counted as replayed); two occurrences within
one attempt are always an error.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlfleet.api.permutation import EpochPermutation

LEDGER_GLOB = "ledger-*.jsonl"
RESTORE_LOG = "restores.jsonl"
SHOWN = 10  # ids listed per problem in a report


@dataclass(frozen=True)
class Entry:
    """One rank's step: the records `ids` of epoch `epoch`."""

    attempt: int
    rank: int
    world: int
    epoch: int
    step: int
    ids: tuple[int, ...]
    source: str = ""  # file:line, for reports
    t: float | None = field(default=None, compare=False)  # wall-clock time of the line
    # The step the rank's Checkpointer had been told is committed, as it logged the line.
    committed: int | None = field(default=None, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "") -> Entry:
        return cls(
            attempt=int(data["attempt"]),
            rank=int(data["rank"]),
            world=int(data["world"]),
            epoch=int(data["epoch"]),
            step=int(data["step"]),
            ids=tuple(int(i) for i in data["ids"]),
            source=source,
            t=float(data["t"]) if "t" in data else None,
            committed=int(data["committed"]) if "committed" in data else None,
        )


@dataclass(frozen=True)
class Restore:
    """Attempt `attempt` started from the checkpoint of `restored_step`."""

    attempt: int
    restored_step: int
    t: float | None = field(default=None, compare=False)  # wall-clock time of the restore

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Restore:
        return cls(
            attempt=int(data["attempt"]),
            restored_step=int(data["restored_step"]),
            t=float(data["t"]) if "t" in data else None,
        )


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    expected: int  # records the epoch should train
    trained: int  # record occurrences counted in the final lineage
    duplicates: dict[int, int]  # id -> occurrences (> 1), replays excluded
    replayed: dict[int, int]  # id -> occurrences (> 1), each in another attempt
    missing: tuple[int, ...]
    unexpected: tuple[int, ...]  # trained, but not in the epoch's expected set

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.unexpected)


@dataclass(frozen=True)
class LedgerReport:
    epochs: tuple[EpochReport, ...]
    entries: int
    counted: int
    discarded: int
    attempts: tuple[int, ...]
    restores: tuple[Restore, ...]
    problems: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems and all(e.ok for e in self.epochs)

    @property
    def replayed(self) -> int:
        return sum(n - 1 for e in self.epochs for n in e.replayed.values())

    def summary(self) -> str:
        restores = ", ".join(f"a{r.attempt}->{r.restored_step}" for r in self.restores)
        lines = [
            f"ledger {'OK' if self.ok else 'FAILED'}: {self.entries} entries in attempts "
            f"{list(self.attempts)}, {self.counted} counted, {self.discarded} discarded by "
            f"restores [{restores}], {self.replayed} replayed",
        ]
        for e in self.epochs:
            status = "ok" if e.ok else "FAILED"
            lines.append(
                f"  epoch {e.epoch}: {status}, {e.trained} trained of {e.expected} expected"
            )
            if e.duplicates:
                lines.append(f"    duplicates (id: times): {_first(e.duplicates)}")
            if e.replayed:
                lines.append(f"    replayed across attempts (id: times): {_first(e.replayed)}")
            if e.missing:
                lines.append(f"    missing ({len(e.missing)}): {list(e.missing[:SHOWN])}")
            if e.unexpected:
                unexpected = list(e.unexpected[:SHOWN])
                lines.append(f"    unexpected ({len(e.unexpected)}): {unexpected}")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _first(counts: dict[int, int]) -> str:
    shown = sorted(counts.items())[:SHOWN]
    more = f" (+{len(counts) - SHOWN} more)" if len(counts) > SHOWN else ""
    return ", ".join(f"{i}: {n}" for i, n in shown) + more


# ---------------------------------------------------------------- reading


def _read_jsonl(path: Path, problems: list[str]) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each complete line. A torn last line (the
    process died inside its write) is skipped: it was never fsynced, so its
    step had not reached the all-reduce. A bad line anywhere else is a problem."""
    lines = path.read_text().split("\n")
    out: list[tuple[int, dict[str, Any]]] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            out.append((number, json.loads(text)))
        except json.JSONDecodeError:
            if number < len(lines):  # terminated by a newline: not a torn write
                problems.append(f"{path.name}:{number}: not JSON: {text[:80]!r}")
    return out


def read_ledger(directory: Path) -> tuple[list[Entry], list[Restore], list[str]]:
    problems: list[str] = []
    entries: list[Entry] = []
    for path in sorted(directory.glob(LEDGER_GLOB)):
        for number, data in _read_jsonl(path, problems):
            entries.append(Entry.from_json(data, f"{path.name}:{number}"))
    restores: list[Restore] = []
    restore_log = directory / RESTORE_LOG
    if restore_log.exists():
        restores = [Restore.from_json(d) for _, d in _read_jsonl(restore_log, problems)]
    return entries, restores, problems


# ---------------------------------------------------------------- lineage


def final_lineage(
    entries: Iterable[Entry], restores: Sequence[Restore]
) -> tuple[list[Entry], list[Entry]]:
    """(counted, discarded): an entry of attempt a at step s is discarded iff
    a restore of a later attempt went back to a step below s."""
    counted: list[Entry] = []
    discarded: list[Entry] = []
    for entry in entries:
        rolled_back = any(
            r.attempt > entry.attempt and r.restored_step < entry.step for r in restores
        )
        (discarded if rolled_back else counted).append(entry)
    return counted, discarded


def _lineage_problems(
    entries: Sequence[Entry], counted: Sequence[Entry], restores: Sequence[Restore]
) -> list[str]:
    problems: list[str] = []
    seen: dict[tuple[int, int, int], str] = {}
    for e in entries:
        key = (e.attempt, e.rank, e.step)
        if key in seen:
            problems.append(f"{e.source}: rank {e.rank} logged step {e.step} again ({seen[key]})")
        seen[key] = e.source
    worlds: dict[int, set[int]] = defaultdict(set)
    for e in entries:
        worlds[e.attempt].add(e.world)
    for attempt, sizes in sorted(worlds.items()):
        if len(sizes) > 1:
            problems.append(f"attempt {attempt} logged several world sizes {sorted(sizes)}")
    per_attempt = Counter(r.attempt for r in restores)
    problems += [f"attempt {a} restored {n} times" for a, n in per_attempt.items() if n > 1]
    if not restores:
        return problems  # steps restart at 0 in each attempt: nothing more to compare
    # With checkpoints the counted steps form one history: each step from one
    # attempt, logged by every rank of it.
    ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
    for e in counted:
        ranks[(e.step, e.attempt)].add(e.rank)
    attempts_of_step: dict[int, list[int]] = defaultdict(list)
    for step, attempt in sorted(ranks):
        attempts_of_step[step].append(attempt)
        world = max(worlds[attempt])
        absent = sorted(set(range(world)) - ranks[(step, attempt)])
        if absent:
            problems.append(
                f"step {step} of attempt {attempt} counts, but ranks {absent} never logged it"
            )
    for step, attempts in sorted(attempts_of_step.items()):
        if len(attempts) > 1:
            problems.append(f"step {step} counts from several attempts {attempts}")
    return problems


# ----------------------------------------------------------------- checks


def drop_last_length(size: int, global_batch: int) -> int:
    """Positions per epoch with drop_last (the loader's and the master's rule)."""
    return size - size % global_batch


def expected_ids(
    size: int, epoch: int, *, epoch_length: int | None = None, seed: int = 0, shuffle: bool = True
) -> set[int]:
    """The records an epoch trains: all, or with drop_last the first
    `epoch_length` positions of the epoch's permutation."""
    if epoch_length is None or epoch_length >= size:
        return set(range(size))
    permutation = EpochPermutation(size, seed, epoch, shuffle)
    return {permutation[p] for p in range(epoch_length)}


def check(
    directory: Path,
    *,
    size: int,
    epochs: int,
    drop_last_global_batch: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    allow_replay: bool = False,
) -> LedgerReport:
    """Check the ledgers in `directory` (see the module docstring).
    `drop_last_global_batch`: the global batch of the first round, for a run
    with drop_last; None for a run without."""
    entries, restores, problems = read_ledger(directory)
    counted, discarded = final_lineage(entries, restores)
    problems += _lineage_problems(entries, counted, restores)
    epoch_length = (
        drop_last_length(size, drop_last_global_batch) if drop_last_global_batch else None
    )
    by_epoch: dict[int, list[Entry]] = defaultdict(list)
    for e in counted:
        by_epoch[e.epoch].append(e)
    problems += [
        f"{len(by_epoch[epoch])} entries of epoch {epoch}, beyond the {epochs} epochs"
        for epoch in sorted(by_epoch)
        if not 0 <= epoch < epochs
    ]
    reports = []
    for epoch in range(epochs):
        expected = expected_ids(size, epoch, epoch_length=epoch_length, seed=seed, shuffle=shuffle)
        reports.append(_epoch_report(epoch, by_epoch[epoch], expected, allow_replay))
    return LedgerReport(
        epochs=tuple(reports),
        entries=len(entries),
        counted=len(counted),
        discarded=len(discarded),
        attempts=tuple(sorted({e.attempt for e in entries})),
        restores=tuple(sorted(restores, key=lambda r: r.attempt)),
        problems=tuple(problems),
    )


def _epoch_report(
    epoch: int, entries: Sequence[Entry], expected: set[int], allow_replay: bool
) -> EpochReport:
    attempts_of: dict[int, list[int]] = defaultdict(list)
    for e in entries:
        for record_id in e.ids:
            attempts_of[record_id].append(e.attempt)
    duplicates: dict[int, int] = {}
    replayed: dict[int, int] = {}
    for record_id, attempts in attempts_of.items():
        if len(attempts) == 1:
            continue
        across_attempts = len(set(attempts)) == len(attempts)
        if allow_replay and across_attempts:
            replayed[record_id] = len(attempts)
        else:
            duplicates[record_id] = len(attempts)
    seen = set(attempts_of)
    return EpochReport(
        epoch=epoch,
        expected=len(expected),
        trained=sum(len(a) for a in attempts_of.values()),
        duplicates=duplicates,
        replayed=replayed,
        missing=tuple(sorted(expected - seen)),
        unexpected=tuple(sorted(seen - expected)),
    )


def assert_exactly_once(directory: Path, **options: Any) -> LedgerReport:
    """`check`, raising AssertionError with the report when it fails."""
    report = check(directory, **options)
    if not report.ok:
        raise AssertionError(report.summary())
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="check a ledger_train.py ledger directory")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--drop-last-global-batch", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-replay", action="store_true")
    args = parser.parse_args()
    result = check(
        args.directory,
        size=args.size,
        epochs=args.epochs,
        drop_last_global_batch=args.drop_last_global_batch,
        seed=args.seed,
        allow_replay=args.allow_replay,
    )
    print(result.summary())
    raise SystemExit(0 if result.ok else 1)

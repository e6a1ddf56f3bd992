"""Which job a state store holds, and whether a starting master may take it.

A store holds one job. The master that starts a job writes the job's identity
into its store (the job's name, a random id, when it began); a master started
later on a store that holds a job's state continues that job only when told
to (`resume`), and only if it is the same job (by name). So a master never
adopts an earlier run's store by accident (the default file left in the
current directory, a URL copied from the README): it would recover that
run's nodes and rounds and serve them as its own. A store that holds no state
beyond an identity (a master started and stopped before anything happened) is
free: the new master writes its own.

Pure: the master service reads the store and writes what this decides.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import NewType

from dlfleet.api.errors import DlfleetError

JobId = NewType("JobId", str)

JOB_IDENTITY = "JobIdentity"  # the journal entry's type


class StoreClaimError(DlfleetError):
    """The store holds a job this master must not continue."""


class StoreHoldsAJob(StoreClaimError):
    """The store holds a job's state, and the master was not told to resume it."""


class StoreHoldsAnotherJob(StoreClaimError):
    """The store holds the state of a job of another name."""

    def __init__(self, message: str, held_name: str) -> None:
        super().__init__(message)
        self.held_name = held_name


@dataclass(frozen=True)
class JobIdentity:
    name: str
    job_id: JobId
    created_ms: int  # Unix ms

    def to_json(self) -> str:
        return json.dumps(
            {
                "t": JOB_IDENTITY,
                "name": self.name,
                "job_id": self.job_id,
                "created_ms": self.created_ms,
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(text: str) -> JobIdentity:
        data = json.loads(text)
        return JobIdentity(data["name"], JobId(data["job_id"]), int(data["created_ms"]))

    def describe(self, contents: str = "") -> str:
        """ "job 'NAME' (id ID, started WHEN[; CONTENTS])"."""
        created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created_ms / 1000))
        more = f"; {contents}" if contents else ""
        return f"job {self.name!r} (id {self.job_id}, started {created}{more})"


@dataclass(frozen=True)
class Claim:
    """What a starting master takes the store as."""

    identity: JobIdentity
    resumed: bool  # the store's job is continued (else: a new job starts)
    write: bool  # the identity is new: the store must be given it


def claim_store(
    held: JobIdentity | None,
    contents: str,
    *,
    store: str,
    job_name: str,
    resume: bool,
    new_id: JobId,
    now_ms: int,
) -> Claim:
    """Whether a master of `job_name` may start on `store`, which holds the
    identity `held` (None: none) and `contents` ("" when it holds no state;
    else what it holds, in words, for the message). Raises StoreHoldsAJob or
    StoreHoldsAnotherJob, naming the store and its job, when it may not."""
    fresh = JobIdentity(job_name, new_id, now_ms)
    if not contents:
        return Claim(fresh, resumed=False, write=True)
    if held is None:
        # Written before stores named their job: whose it is cannot be told.
        if resume:
            return Claim(fresh, resumed=True, write=True)
        raise StoreHoldsAJob(
            f"{store} holds an earlier job's state ({contents}), written before stores "
            "named their job"
        )
    if held.name != job_name:
        raise StoreHoldsAnotherJob(
            f"{store} holds {held.describe(contents)}, not job {job_name!r}", held.name
        )
    if not resume:
        raise StoreHoldsAJob(f"{store} holds {held.describe(contents)}")
    return Claim(held, resumed=True, write=False)

"""A store holds one job, on SQLite and PostgreSQL: a master takes a store
that holds another run's job only when told to resume it, never a job of
another name, and writes nothing when it refuses."""

from __future__ import annotations

import pytest

from dlfleet.master.core.job_identity import StoreHoldsAJob, StoreHoldsAnotherJob
from dlfleet.master.service.journal import JOB_STREAM
from dlfleet.master.service.state import MasterSettings, MasterState
from dlfleet.master.store.sql import open_store

pytestmark = pytest.mark.integration

JOB = MasterSettings(job_name="job")


def recover(store_url: str, settings: MasterSettings, *, resume: bool) -> MasterState:
    return MasterState.recover(open_store(store_url), settings, 1_000, resume=resume)


def test_a_store_holding_a_job_is_refused_without_resume_and_continued_with_it(
    store_url: str,
) -> None:
    first = recover(store_url, JOB, resume=False)  # an empty store: a new job
    assert first.identity is not None and first.identity.name == "job"
    first.journal.append(first.nodes.register("a", 1, "h", 1_000)[1]).result()
    first.close()

    with pytest.raises(StoreHoldsAJob) as refused:
        recover(store_url, JOB, resume=False)
    assert str(refused.value).endswith(
        f"holds {first.identity.describe('no round formed yet, 0 datasets, 1 node registered')}"
    )
    with pytest.raises(StoreHoldsAnotherJob, match="not job 'other'"):
        recover(store_url, MasterSettings(job_name="other"), resume=True)

    resumed = recover(store_url, JOB, resume=True)
    try:
        assert resumed.identity == first.identity
        assert set(resumed.nodes.nodes) == {"a"}
    finally:
        resumed.close()
    store = open_store(store_url)
    try:  # the refused masters wrote nothing: one identity, the first
        assert len(store.load()[JOB_STREAM].entries) == 1
    finally:
        store.close()


def test_a_store_that_holds_nothing_but_an_identity_is_a_new_job(store_url: str) -> None:
    recover(store_url, JOB, resume=False).close()  # started and stopped: nothing happened
    again = recover(store_url, MasterSettings(job_name="other"), resume=False)
    try:
        assert again.identity is not None and again.identity.name == "other"
    finally:
        again.close()

"""A store holds one job: a starting master takes a store that holds no state
as a new job, continues the job a store holds only when told to resume it,
and never continues a job of another name."""

from __future__ import annotations

import pytest

from dlfleet.master.core.job_identity import (
    Claim,
    JobId,
    JobIdentity,
    StoreHoldsAJob,
    StoreHoldsAnotherJob,
    claim_store,
)

HELD = JobIdentity("job", JobId("5eed"), 1_800_000_000_000)
HOLDS = "round 3, 1 dataset, 2 nodes registered"


def claim(
    held: JobIdentity | None, contents: str, *, name: str = "job", resume: bool = False
) -> Claim:
    return claim_store(
        held, contents, store="sqlite:///m.db", job_name=name, resume=resume,
        new_id=JobId("f00d"), now_ms=1_900_000_000_000,
    )  # fmt: skip


@pytest.mark.parametrize("held", [None, HELD, JobIdentity("other", JobId("1"), 0)])
@pytest.mark.parametrize("resume", [False, True])
def test_a_store_without_state_starts_a_new_job_whose_identity_is_written(
    held: JobIdentity | None, resume: bool
) -> None:
    taken = claim(held, "", resume=resume)
    assert taken.identity == JobIdentity("job", JobId("f00d"), 1_900_000_000_000)
    assert taken.write and not taken.resumed


def test_a_store_holding_a_job_is_refused_without_resume_naming_the_store_and_the_job() -> None:
    with pytest.raises(StoreHoldsAJob) as refused:
        claim(HELD, HOLDS)
    assert str(refused.value) == (
        "sqlite:///m.db holds job 'job' (id 5eed, started 2027-01-15 08:00:00 UTC; "
        "round 3, 1 dataset, 2 nodes registered)"
    )


def test_a_store_holding_the_job_is_continued_with_resume_under_its_identity() -> None:
    taken = claim(HELD, HOLDS, resume=True)
    assert taken.identity == HELD
    assert taken.resumed and not taken.write


@pytest.mark.parametrize("resume", [False, True])
def test_a_store_holding_another_job_is_refused_even_with_resume(resume: bool) -> None:
    with pytest.raises(
        StoreHoldsAnotherJob, match=r"holds job 'job' .*, not job 'mine'"
    ) as refused:
        claim(HELD, HOLDS, name="mine", resume=resume)
    assert refused.value.held_name == "job"


def test_a_store_written_before_identities_is_refused_without_resume_and_adopted_with_it() -> None:
    with pytest.raises(StoreHoldsAJob, match=r"an earlier job's state .*before stores named"):
        claim(None, HOLDS)
    adopted = claim(None, HOLDS, resume=True)
    assert adopted.resumed and adopted.write and adopted.identity.name == "job"


def test_an_identity_survives_the_journal() -> None:
    assert JobIdentity.from_json(HELD.to_json()) == HELD

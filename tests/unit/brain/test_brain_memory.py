from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dlfleet.brain.optimizer.memory import GIB, MemorySettings, memory_after_oom
from dlfleet.brain.records import OomRelaunch, PlanKind

MIB = 1 << 20


def test_the_limit_grows_by_the_factor_when_rss_samples_stayed_below_it() -> None:
    plan = memory_after_oom(OomRelaunch("node-1", 4 * GIB), 3 * GIB, MemorySettings())
    assert (plan.kind, plan.node, plan.memory_bytes) == (PlanKind.MEMORY, "node-1", 6 * GIB)
    assert "limit 4096 MiB x 1.5" in plan.reason


def test_a_peak_above_the_limit_sets_the_size() -> None:
    plan = memory_after_oom(OomRelaunch("node-1", 4 * GIB), 8 * GIB, MemorySettings())
    assert plan.memory_bytes == 9831 * MIB  # 8 GiB x 1.2, rounded up to a MiB


def test_the_cap_bounds_the_request() -> None:
    plan = memory_after_oom(OomRelaunch("node-1", 40 * GIB), 0, MemorySettings(max_bytes=48 * GIB))
    assert plan.memory_bytes == 48 * GIB
    assert plan.evidence["capped"] is True and "capped at 49152 MiB" in plan.reason


def test_nothing_known_means_no_plan() -> None:
    assert memory_after_oom(OomRelaunch("n", 0), 0, MemorySettings()).kind is PlanKind.NONE


@given(
    limit=st.integers(1, 1 << 40),
    peak=st.integers(0, 1 << 40),
    cap=st.integers(1 << 20, 1 << 42),
)
def test_the_request_is_max_of_both_terms_within_the_cap(limit: int, peak: int, cap: int) -> None:
    s = MemorySettings(max_bytes=cap)
    got = memory_after_oom(OomRelaunch("n", limit), peak, s).memory_bytes
    assert got <= cap
    assert got == cap or (got >= limit * s.factor and got >= peak * s.margin)
    assert got == cap or got % MIB == 0

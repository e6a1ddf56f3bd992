"""The master process's collector settings (`dlfleet.master.service.app.tune_gc`):
what exists at start is frozen, the young generation is collected less often."""

from __future__ import annotations

import gc

from dlfleet.master.service.app import GC_MIDDLE_THRESHOLD, GC_YOUNG_THRESHOLD, tune_gc


def test_the_master_freezes_what_it_started_with_and_collects_young_objects_less_often() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, GC_MIDDLE_THRESHOLD, before[2])
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # what came after is still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

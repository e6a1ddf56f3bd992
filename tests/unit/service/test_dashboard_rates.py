"""The dashboard's records/s of a dataset (`rateOf` in dashboard.js), run
by node on made-up histories: the rate of what is trained, not diluted by
the stretch before training began (a short job's dataset read "0 records/s"
beside 963 samples/s, then half of it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import missing

DASHBOARD = (
    Path(__file__).resolve().parents[3]
    / "master" / "dlfleet" / "master" / "service" / "static" / "dashboard.js"
)  # fmt: skip


def run_page_functions(names: list[str], call: str) -> Any:
    """`call` (a JS expression) with the page's `names` functions and its
    RATE_WINDOW_MS defined, by node; its value, through JSON."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        missing("no node on PATH to run the dashboard's script")
    source = DASHBOARD.read_text()
    window = re.search(r"^const RATE_WINDOW_MS = .*;$", source, re.MULTILINE)
    assert window is not None, "RATE_WINDOW_MS moved in dashboard.js"
    parts = [window.group(0)]
    for name in names:
        pattern = rf"^function {name}\([^)]*\) \{{$.*?^\}}$"
        function = re.search(pattern, source, re.DOTALL | re.MULTILINE)
        assert function is not None, f"{name} moved in dashboard.js"
        parts.append(function.group(0))
    program = "\n".join([*parts, f"console.log(JSON.stringify({call}));"])
    done = subprocess.run(
        [node, "-e", program], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def points(history: list[tuple[float, float]]) -> str:
    return json.dumps([{"t": t, "v": v} for t, v in history])


def rate_of(history: list[tuple[float, float]]) -> float | None:
    """`rateOf` of the page, on `history` as (t in ms, records done) points."""
    value = run_page_functions(["rateOf"], f"rateOf({points(history)})")
    return None if value is None else float(value)


def pace(
    dataset: dict[str, Any], doc: dict[str, Any], training: int, history: list[tuple[float, float]]
) -> dict[str, Any]:
    """`datasetPace` of the page: a dataset card's records/s and ETA."""
    call = f"datasetPace({json.dumps(dataset)}, {json.dumps(doc)}, {training}, {points(history)})"
    value: dict[str, Any] = run_page_functions(["num", "rateOf", "datasetPace"], call)
    return value


def test_the_stretch_before_training_is_no_part_of_the_rate() -> None:
    # 20 s of a job starting (nothing trained), then 10 s at 1,000 records/s,
    # the count moving each second as rank 0 reports it.
    history = [(t * 1000.0, 0.0) for t in range(21)]
    history += [((20 + s) * 1000.0, 1000.0 * s) for s in range(1, 11)]
    assert rate_of(history) == pytest.approx(1000.0)


def test_a_count_that_stands_still_is_zero_and_a_steady_one_its_pace() -> None:
    assert rate_of([(t * 1000.0, 500.0) for t in range(10)]) == 0.0
    assert rate_of([(t * 1000.0, 250.0 * t) for t in range(40)]) == pytest.approx(250.0)
    assert rate_of([(0.0, 0.0), (1000.0, 100.0)]) is None  # too short to tell


def test_the_only_dataset_training_shows_the_jobs_own_rate_and_eta() -> None:
    """The card said 293 records/s and ETA 6m 40s beside the job's 2,069
    samples/s and ETA 57 s (the right ones): its count moves in jumps as rank
    0 reports, and a window of it is not the job's pace."""
    dataset = {"records_total": 300_000, "records_done": 182_816}
    jumpy = [(t * 1000.0, 180_000.0 + 293.0 * t) for t in range(10)]
    doc = {"samples_per_second": 2_069.0, "eta_seconds": 57.0}
    assert pace(dataset, doc, 1, jumpy) == {"rate": 2_069.0, "eta": 57.0}
    # The master has no ETA yet: the job's rate gives it.
    doc = {"samples_per_second": 2_000.0, "eta_seconds": -1}
    assert pace(dataset, doc, 1, jumpy) == {"rate": 2_000.0, "eta": 117_184 / 2_000.0}


def test_datasets_training_side_by_side_each_show_their_own_pace() -> None:
    dataset = {"records_total": 10_000, "records_done": 5_000}
    steady = [(t * 1000.0, 4_100.0 + 100.0 * t) for t in range(10)]
    doc = {"samples_per_second": 2_069.0, "eta_seconds": 57.0}
    got = pace(dataset, doc, 2, steady)
    assert got["rate"] == pytest.approx(100.0) and got["eta"] == pytest.approx(50.0)
    done = {"records_total": 10_000, "records_done": 10_000}
    assert pace(done, doc, 1, steady) == {"rate": None, "eta": 0}

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

import pytest
from harness import missing

DASHBOARD = (
    Path(__file__).resolve().parents[3]
    / "master" / "dlfleet" / "master" / "service" / "static" / "dashboard.js"
)  # fmt: skip


def rate_of(history: list[tuple[float, float]]) -> float | None:
    """`rateOf` of the page, on `history` as (t in ms, records done) points."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        missing("no node on PATH to run the dashboard's script")
    source = DASHBOARD.read_text()
    window = re.search(r"^const RATE_WINDOW_MS = .*;$", source, re.MULTILINE)
    function = re.search(r"^function rateOf\(history\) \{$.*?^\}$", source, re.DOTALL | re.M)
    assert window is not None and function is not None, "rateOf moved in dashboard.js"
    points = json.dumps([{"t": t, "v": v} for t, v in history])
    call = f"console.log(JSON.stringify(rateOf({points})));"
    program = "\n".join((window.group(0), function.group(0), call))
    done = subprocess.run(
        [node, "-e", program], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    value = json.loads(done.stdout)
    return None if value is None else float(value)


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

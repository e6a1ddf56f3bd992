from __future__ import annotations

import xml.etree.ElementTree as ET

from dlfleet.brain.records import (
    FailureKind,
    JobInfo,
    JobReport,
    Plan,
    PlanId,
    PlanKind,
    SizeThroughput,
)
from dlfleet.brain.report import render_svg, render_text

REPORT = JobReport(
    job=JobInfo(name="run<1>", signature="s&t", min_nodes=1, max_nodes=8),
    created_ms=1_700_000_000_000,
    updated_ms=1_700_000_600_000,
    sizes=[
        SizeThroughput(1, 4, 1, 100.0, 1.0),
        SizeThroughput(2, 8, 1, 200.0, 1.0),
        SizeThroughput(4, 16, 2, 400.0, 1.0),
        SizeThroughput(8, 32, 1, 400.0, 0.5),
    ],
    plans=[
        Plan(
            PlanId(1),
            "run<1>",
            PlanKind.SCALE,
            "scale up from 1 to 2 nodes: ...",
            {},
            1_700_000_060_000,
            current_nodes=1,
            target_nodes=2,
            applied=True,
            applied_ms=1_700_000_061_000,
        ),
        Plan(
            PlanId(2),
            "run<1>",
            PlanKind.MEMORY,
            "relaunch node-1 with 6144 MiB",
            {},
            1_700_000_120_000,
            node="node-1",
            memory_bytes=6 << 30,
        ),
    ],
    failures={FailureKind.OOM: 1},
)


def test_the_text_report_tabulates_sizes_and_lists_decisions_with_reasons() -> None:
    text = render_text(REPORT)
    assert "     4     16       2        400.0      100.0        1.00" in text
    assert "     8     32       1        400.0       50.0        0.50" in text
    assert "#1 scale 1 -> 2 nodes (applied 2023-11-14 22:14:21)" in text
    assert "scale up from 1 to 2 nodes: ..." in text
    assert "#2 memory of node-1 -> 6144 MiB (not applied)" in text
    assert "failures: oom 1" in text


def test_the_svg_is_well_formed_and_plots_every_size() -> None:
    svg = render_svg(REPORT)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}circle")) == 4
    assert root.find(f"{ns}polyline") is not None
    assert "run&lt;1&gt;" in svg


def test_an_empty_report_still_renders() -> None:
    empty = JobReport(REPORT.job, 0, 0, [], [], {})
    assert "(no round reported)" in render_text(empty)
    ET.fromstring(render_svg(empty))

from __future__ import annotations

import xml.etree.ElementTree as ET

from dlfleet.brain.records import (
    FailureKind,
    JobInfo,
    JobReport,
    Plan,
    PlanId,
    PlanKind,
    RoundSpan,
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


def test_an_empty_report_still_renders_and_says_why_no_round_was_reported() -> None:
    empty = JobReport(REPORT.job, 0, 0, [], [], {}, min_round_s=60.0)
    text = render_text(empty)
    assert "(no round reported: a round is reported once every node in it has sent step" in text
    assert "progress.step()" in text
    ET.fromstring(render_svg(empty))


def test_rounds_all_shorter_than_the_minimum_are_listed_with_their_lengths() -> None:
    short = JobReport(
        REPORT.job, 0, 0, [SizeThroughput(2, 8, 3, 200.0, 1.0)], [], {},
        rounds=[RoundSpan(1, 2, 12.4), RoundSpan(2, 2, 41.0), RoundSpan(3, 2, 8.0)],
        min_round_s=60.0,
    )  # fmt: skip
    text = render_text(short)
    assert "     2      8       3        200.0      100.0        1.00         0" in text
    assert (
        "the optimizer has measured no size yet: it counts rounds of at least 60 s "
        "(min_round_s), and none of the 3 rounds lasted that long (the longest 41 s): "
        "round 1: 2 nodes, 12 s; round 2: 2 nodes, 41 s; round 3: 2 nodes, 8 s"
    ) in text


def test_some_rounds_long_enough_are_counted_per_size() -> None:
    mixed = JobReport(
        REPORT.job, 0, 0,
        [SizeThroughput(1, 4, 2, 100.0, 1.0), SizeThroughput(2, 8, 1, 190.0, 0.95)], [], {},
        rounds=[RoundSpan(1, 1, 90.0), RoundSpan(2, 1, 30.0), RoundSpan(3, 2, 61.0)],
        min_round_s=60.0,
    )  # fmt: skip
    text = render_text(mixed)
    assert "nodes  world  rounds    samples/s   per node  efficiency   >= 60 s\n" in text
    assert "     1      4       2        100.0      100.0        1.00         1" in text
    assert "     2      8       1        190.0       95.0        0.95         1" in text
    assert "counts rounds of at least 60 s (min_round_s): 2 of the 3 rounds lasted" in text


def test_rounds_of_no_length_measure_nothing_and_say_so() -> None:
    instant = JobReport(
        REPORT.job, 0, 0, [], [], {},
        rounds=[RoundSpan(r, 2, 0.0) for r in range(1, 12)], min_round_s=60.0,
    )  # fmt: skip
    text = render_text(instant)
    assert "(no throughput measured: 11 rounds reported, none lasting longer than 0 s: " in text
    assert "3 earlier; round 4: 2 nodes, 0 s;" in text and "round 11: 2 nodes, 0 s)" in text

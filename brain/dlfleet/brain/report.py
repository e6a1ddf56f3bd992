"""A job's report for people: throughput per node count as a table (with
how many of each size's rounds lasted the optimizer's `min_round_s`, and
why there is nothing to show when there is not), the decisions over time
with their reasons, and an optional small SVG chart
(hand-written, no plotting library): measured samples/s per node count, the
linear-scaling line from the smallest size, and the sizes the plans chose."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from xml.sax.saxutils import escape

from dlfleet.brain.records import JobReport, Plan, PlanKind, RoundSpan

MIB = 1 << 20


def _time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _action(plan: Plan) -> str:
    if plan.kind is PlanKind.SCALE:
        return f"scale {plan.current_nodes} -> {plan.target_nodes} nodes"
    if plan.kind is PlanKind.INITIAL:
        parts = [f"start at {plan.target_nodes} nodes"]
        if plan.memory_bytes:
            parts.append(f"{plan.memory_bytes // MIB} MiB")
        if plan.cpu:
            parts.append(f"{plan.cpu:g} CPU")
        return ", ".join(parts)
    if plan.kind is PlanKind.MEMORY:
        return f"memory of {plan.node} -> {plan.memory_bytes // MIB} MiB"
    if plan.kind is PlanKind.REPLACE_NODE:
        return f"replace {plan.node}"
    return "none"


def render_text(report: JobReport) -> str:
    job = report.job
    lines = [
        f"job {job.name} (signature {job.signature}, {job.status.value}, "
        f"nodes {job.min_nodes}..{job.max_nodes})",
        f"registered {_time(report.created_ms)} UTC, updated {_time(report.updated_ms)} UTC",
        "",
    ]
    minimum = report.min_round_s
    lines.append(
        f"throughput per node count (median over rounds; `>= {minimum:.0f} s`: those of its "
        "rounds long enough for the optimizer):"
    )
    if report.sizes:
        lines.append(
            f"{'nodes':>6} {'world':>6} {'rounds':>7} {'samples/s':>12} "
            f"{'per node':>10} {'efficiency':>11} {f'>= {minimum:.0f} s':>9}"
        )
        for s in report.sizes:
            counted = sum(r.nodes == s.nodes and r.duration_s >= minimum for r in report.rounds)
            lines.append(
                f"{s.nodes:>6} {s.world_size:>6} {s.rounds:>7} {s.samples_per_s:>12.1f} "
                f"{s.samples_per_s / s.nodes:>10.1f} {s.efficiency:>11.2f} {counted:>9}"
            )
    lines += _rounds_note(report)
    lines += ["", "decisions:"]
    if report.plans:
        for plan in report.plans:
            applied = (
                f"applied {_time(plan.applied_ms)}"
                if plan.applied and plan.applied_ms is not None
                else "not applied"
            )
            lines.append(f"  {_time(plan.created_ms)}  #{plan.id} {_action(plan)} ({applied})")
            lines.append(f"      {plan.reason}")
    else:
        lines.append("  (none)")
    failures = ", ".join(
        f"{kind.value} {count}"
        for kind, count in sorted(report.failures.items(), key=lambda kv: kv[0].value)
    )
    lines += ["", f"failures: {failures or 'none'}"]
    lines += _checks(report)
    return "\n".join(lines) + "\n"


def _checks(report: JobReport) -> list[str]:
    """Each node's pre-flight check: its numbers against the other nodes'."""
    if not report.node_checks:
        return []
    lines = ["", "node checks (the latest per node; x = times the median of the others):"]
    for check in report.node_checks:
        measured = [
            f"{what} {ms:.{digits}f} ms" + (f" ({ms / reference:.2f}x)" if reference > 0 else "")
            for what, ms, reference, digits in (
                ("matmul", check.compute_ms, check.compute_reference_ms, 1),
                ("all-reduce", check.pair_ms, check.pair_reference_ms, 2),
            )
            if ms > 0
        ]
        verdict = f"faulty ({check.rule})" if check.faulty else "healthy"
        lines.append(f"  {check.node}: {verdict}; {', '.join(measured) or 'nothing measured'}")
    return lines


ROUNDS_LISTED = 8


def _lengths(rounds: Sequence[RoundSpan]) -> str:
    """`round 3: 2 nodes, 41 s; ...`, the latest few when there are many."""
    shown = [f"round {r.round}: {r.nodes} nodes, {r.duration_s:.0f} s" for r in rounds]
    if len(shown) > ROUNDS_LISTED:
        hidden = len(shown) - ROUNDS_LISTED
        shown = [f"{hidden} earlier", *shown[-ROUNDS_LISTED:]]
    return "; ".join(shown)


def _rounds_note(report: JobReport) -> list[str]:
    """Why the table is empty, or which of its rounds the optimizer can use:
    it decides only on rounds of at least `min_round_s`."""
    rounds, minimum = report.rounds, report.min_round_s
    long_enough = [r for r in rounds if r.duration_s >= minimum]
    if not rounds:
        return [
            "  (no round reported: a round is reported once every node in it has sent step "
            "metrics with its heartbeats (progress.step(), which ShardedDataLoader calls for "
            "every batch); none did: the rounds ended sooner, or the training reported no steps)"
        ]
    if not report.sizes:
        return [
            f"  (no throughput measured: {len(rounds)} rounds reported, none lasting longer "
            f"than 0 s: {_lengths(rounds)})"
        ]
    if len(long_enough) == len(rounds):
        return []
    longest = max(r.duration_s for r in rounds)
    if not long_enough:
        return [
            f"  the optimizer has measured no size yet: it counts rounds of at least "
            f"{minimum:.0f} s (min_round_s), and none of the {len(rounds)} rounds lasted that "
            f"long (the longest {longest:.0f} s): {_lengths(rounds)}"
        ]
    return [
        f"  the optimizer counts rounds of at least {minimum:.0f} s (min_round_s): "
        f"{len(long_enough)} of the {len(rounds)} rounds lasted that long"
    ]


WIDTH, HEIGHT = 480, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 40


def render_svg(report: JobReport) -> str:
    """Samples/s against node count. Empty axes when nothing was measured."""
    sizes = report.sizes
    targets = sorted(
        {p.target_nodes for p in report.plans if p.kind in (PlanKind.SCALE, PlanKind.INITIAL)}
    )
    max_nodes = max([s.nodes for s in sizes] + targets + [report.job.max_nodes, 1])
    ideal_per_node = sizes[0].samples_per_s / sizes[0].nodes if sizes else 0.0
    max_rate = max([s.samples_per_s for s in sizes] + [ideal_per_node * max_nodes, 1.0])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(nodes: float) -> float:
        return LEFT + plot_w * nodes / max_nodes

    def y(rate: float) -> float:
        return TOP + plot_h * (1 - rate / (max_rate * 1.05))

    title = escape(f"{report.job.name}: samples/s by node count")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
        f"<title>{title}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" '
        'stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle">nodes</text>',
        f'<text x="14" y="{TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {TOP + plot_h / 2})">samples/s</text>',
    ]
    step = max(1, max_nodes // 10)
    for n in range(0, max_nodes + 1, step):
        out.append(f'<text x="{x(n):.1f}" y="{TOP + plot_h + 14}" text-anchor="middle">{n}</text>')
    for i in range(5):
        rate = max_rate * i / 4
        out.append(
            f'<text x="{LEFT - 4}" y="{y(rate) + 4:.1f}" text-anchor="end">{rate:.0f}</text>'
        )
    for n in targets:
        out.append(
            f'<line x1="{x(n):.1f}" y1="{TOP}" x2="{x(n):.1f}" y2="{TOP + plot_h}" '
            'stroke="#bbb" stroke-dasharray="2,3"><title>a plan chose '
            f"{n} nodes</title></line>"
        )
    if sizes:
        out.append(
            f'<line x1="{x(0):.1f}" y1="{y(0):.1f}" x2="{x(max_nodes):.1f}" '
            f'y2="{y(ideal_per_node * max_nodes):.1f}" stroke="#999" stroke-dasharray="6,4">'
            "<title>linear scaling</title></line>"
        )
        points = " ".join(f"{x(s.nodes):.1f},{y(s.samples_per_s):.1f}" for s in sizes)
        out.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        for s in sizes:
            out.append(
                f'<circle cx="{x(s.nodes):.1f}" cy="{y(s.samples_per_s):.1f}" r="4" '
                f'fill="#1f77b4"><title>{s.nodes} nodes: {s.samples_per_s:.1f} samples/s, '
                f"efficiency {s.efficiency:.2f}</title></circle>"
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"

"""deploy/grafana/dlfleet-job.json, the job dashboard: every metric its
PromQL names is one a real master exports (read from its /metrics), every
expression parses as PromQL (promtool), the panels the issue asks for are
there, and the JSON has the shape Grafana imports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import TOKEN, Running, missing
from prometheus_client.parser import text_string_to_metric_families

from dlfleet.master.service.http_api import HttpSettings

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dlfleet-job.json"
METRIC = re.compile(r"\bdlfleet_[a-zA-Z0-9_]+\b")
# The series names a family of each type is exposed as.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in data["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def expressions(data: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in panels(data) for t in p.get("targets", [])]
    for variable in data["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def exported_names(text: str) -> set[str]:
    """Every series name a scrape exposes, including those of families that
    have no sample yet (a labelled counter nothing has counted)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def scrape(running: Running) -> str:
    assert running.server.http is not None
    request = urllib.request.Request(
        running.server.http.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(answer.read().decode())


def test_every_metric_the_dashboard_queries_is_one_the_master_exports(
    start_master: Callable[..., Running],
) -> None:
    running = start_master(http=HttpSettings())
    exported = exported_names(scrape(running))
    referenced = {name for expr in expressions(dashboard()) for name in METRIC.findall(expr)}
    assert referenced, "the dashboard queries no dlfleet metric"
    assert referenced - exported == set(), f"not exported by the master: {referenced - exported}"


def test_the_dashboard_has_a_panel_for_each_thing_the_issue_lists() -> None:
    text = " ".join(expressions(dashboard()))
    wanted = {
        "world size": "dlfleet_world_size",
        "nodes by state": "dlfleet_nodes{",
        "records done": "dlfleet_dataset_records_done",
        "restarts by reason": "dlfleet_worker_restarts_total",
        "failures by reason": "dlfleet_node_failures_total",
        "RPC latency quantiles": "histogram_quantile(0.99, sum by (le, method) "
        "(rate(dlfleet_rpc_duration_seconds_bucket",
        "lease latency": "dlfleet_shard_lease_duration_seconds_bucket",
        "samples/s per node": "dlfleet_node_samples_per_second",
        "step time per node": "dlfleet_node_step_time_seconds",
        "heartbeats missed": "dlfleet_heartbeats_missed_total",
        "brain plans": "dlfleet_brain_plans_total",
    }
    missing = [what for what, needle in wanted.items() if needle not in text]
    assert missing == []


def test_the_dashboard_json_is_shaped_for_grafanas_import() -> None:
    data = dashboard()
    assert data["uid"] and data["title"] and data["schemaVersion"] >= 36
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(data)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(data):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert 'job=~"$job"' in target["expr"], (panel["title"], target["expr"])


def test_every_expression_parses_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:  # it comes with Debian's prometheus (scripts/setup.sh)
        missing("promtool is not installed (scripts/setup.sh installs prometheus as root)")
    # Grafana's variables become what they stand for.
    exprs = [
        expr.replace("$__rate_interval", "1m").replace("$job", ".*")
        for expr in expressions(dashboard())
        if not expr.startswith("label_values(")  # Grafana's, not PromQL
    ]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": expr} for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    done = subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout

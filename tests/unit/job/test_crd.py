"""The DLFleetJob CustomResourceDefinition, made from JobConfig's schema:
structural as Kubernetes wants it, the same fields and bounds as job.yaml,
and the checked-in deploy/crd/dlfleetjob.yaml is what `dlmaster crd` prints.
(The real API server taking it and refusing a bad resource: tests/kube.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from dlfleet.master.job import crd
from dlfleet.master.job.jobconfig import JobConfig

ROOT = Path(__file__).resolve().parents[3]


def spec_properties() -> dict[str, Any]:
    schema = crd.definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    properties: dict[str, Any] = schema["properties"]["spec"]["properties"]
    return properties


def test_the_schema_is_structural_everywhere() -> None:
    schema = crd.definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert crd.not_structural(schema) == []


def test_the_structural_check_finds_what_kubernetes_refuses() -> None:
    bad = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "b": {"type": "string", "default": "x"},
            "c": {"type": "object", "properties": {"d": {}}, "additionalProperties": {}},
        },
    }
    assert crd.not_structural(bad) == [
        ".a: anyOf",
        ".a: no type",
        ".b: default",
        ".c: both properties and additionalProperties",
        ".c.d: no type",
        ".c.*: no type",
    ]


def test_every_field_of_job_yaml_is_in_the_spec_but_those_the_cluster_decides() -> None:
    spec = spec_properties()
    fields = set(JobConfig.model_fields) - {"base_dir"}
    assert set(spec) == (fields - crd.NOT_IN_SPEC) | set(crd.SPEC_EXTRAS)
    kube = set(spec["kubernetes"]["properties"])
    assert "image" in kube and not kube & crd.NOT_IN_KUBERNETES


def test_bounds_and_enums_are_job_yaml_s() -> None:
    spec = spec_properties()
    assert spec["nproc_per_node"] == {"type": "integer", "minimum": 1, "maximum": 1024}
    # JSON Schema's numeric exclusive bound, as OpenAPI 3.0 writes it.
    heartbeat = spec["heartbeat"]["properties"]["interval_s"]
    assert heartbeat["minimum"] == 0 and heartbeat["exclusiveMinimum"] is True
    assert spec["display"]["enum"] == ["auto", "live", "plain", "off"]
    # Optional in job.yaml: nullable, with the inner bounds kept.
    assert spec["step_timeout_factor"]["nullable"] is True
    assert spec["step_timeout_factor"]["minimum"] == 2
    # A free-form Kubernetes object keeps its fields.
    env = spec["kubernetes"]["properties"]["env"]["items"]
    assert env == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    # A union Kubernetes cannot type is left open and says what it takes.
    enabled = spec["node_check"]["properties"]["enabled"]
    assert enabled["x-kubernetes-preserve-unknown-fields"] is True
    assert "'auto' or boolean" in enabled["description"]


def test_the_checked_in_crd_is_what_dlmaster_crd_prints() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", "crd"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    checked_in = (ROOT / "deploy" / "crd" / "dlfleetjob.yaml").read_text()
    assert printed == checked_in, "run: dlmaster crd > deploy/crd/dlfleetjob.yaml"
    assert yaml.safe_load(printed) == crd.definition()

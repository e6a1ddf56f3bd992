"""The DLFleetJob CustomResourceDefinition on a real API server (kubetest's
kube-apiserver): it is taken and established, a DLFleetJob shaped like
job.yaml is stored, a malformed one is refused by the server's schema with
the field named, and the status subresource and printer columns work as
`kubectl get dlfleetjobs` shows them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from dlfleet.master.job import crd

pytestmark = pytest.mark.kube

ROOT = Path(__file__).resolve().parents[2]


def job(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
        "kind": crd.KIND,
        "metadata": {"name": name},
        "spec": {
            "command": "train.py",
            "nodes": {"min": 1, "max": 2},
            "kubernetes": {"image": "example/train:1"},
            **spec,
        },
    }


def create(api: Any, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = api.create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body
    )
    return created


def refusal(api: Any, namespace: str, body: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as refused:
        create(api, namespace, body)
    assert refused.value.status == 422, refused.value
    return str(json.loads(refused.value.body or "{}").get("message", refused.value))


def test_a_dlfleetjob_shaped_like_job_yaml_is_stored(dlfleetjobs: Any, namespace: str) -> None:
    created = create(
        dlfleetjobs,
        namespace,
        job(
            "ok",
            nproc_per_node=2,
            step_timeout_s=30,
            node_check={"enabled": "auto"},
            gang={"scheduler": "volcano"},
            kubernetes={
                "image": "example/train:1",
                "env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "resources": {"limits": {"nvidia.com/gpu": "8"}},
            },
        ),
    )
    spec = created["spec"]
    # Free-form Kubernetes objects keep their fields (nothing pruned).
    assert spec["kubernetes"]["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert spec["node_check"]["enabled"] == "auto" and spec["gang"]["scheduler"] == "volcano"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"nproc_per_node": 0}, "spec.nproc_per_node"),
        ({"nodes": {"min": 0}}, "spec.nodes.min"),
        ({"display": "fancy"}, "spec.display"),
        ({"heartbeat": {"interval_s": 0}}, "spec.heartbeat.interval_s"),
        ({"nproc_per_node": "two"}, "spec.nproc_per_node"),
        ({"kubernetes": {}}, "spec.kubernetes.image"),
        ({"gang": {"scheduler": "kube-batch"}}, "spec.gang.scheduler"),
    ],
)
def test_a_malformed_dlfleetjob_is_refused_with_the_field_named(
    dlfleetjobs: Any, namespace: str, spec: dict[str, Any], field: str
) -> None:
    message = refusal(dlfleetjobs, namespace, job("bad", **spec))
    assert field in message, message


def test_the_shipped_example_is_taken_with_kubectl_apply(
    dlfleetjobs: Any, namespace: str, kube_cluster: Any
) -> None:
    example = ROOT / "examples" / "kubernetes" / "dlfleetjob.yaml"
    applied = kube_cluster.kubectl("apply", "-n", namespace, "-f", str(example))
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.strip() == "dlfleetjob.dlfleet.io/quickstart created"
    stored = dlfleetjobs.get_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "quickstart"
    )
    assert stored["spec"]["kubernetes"]["oom"]["memory_cap"] == "32Gi"


def test_a_dlfleetjob_without_its_command_is_refused(dlfleetjobs: Any, namespace: str) -> None:
    body = job("nocommand")
    del body["spec"]["command"]
    assert "spec.command" in refusal(dlfleetjobs, namespace, body)


def test_kubectl_get_shows_the_status_columns(
    dlfleetjobs: Any, namespace: str, kube_cluster: Any
) -> None:
    create(dlfleetjobs, namespace, job("shown"))
    dlfleetjobs.patch_namespaced_custom_object_status(
        crd.GROUP,
        crd.VERSION,
        namespace,
        crd.PLURAL,
        "shown",
        {
            "status": {
                "phase": "Running",
                "nodes": "2/1/2",
                "round": 3,
                "recordsDone": 1200,
                "goodput": "0.981",
            }
        },
    )
    got = kube_cluster.kubectl("get", "dlfleetjobs", "-n", namespace)
    assert got.returncode == 0, got.stderr
    shown = got.stdout.split("\n")
    assert shown[0].split() == ["NAME", "PHASE", "NODES", "ROUND", "RECORDS", "GOODPUT", "AGE"]
    assert shown[1].split()[:6] == ["shown", "Running", "2/1/2", "3", "1200", "0.981"]

"""Everything the project ships or generates for Kubernetes is valid for a
current Kubernetes release, checked with kubernetes-validate against that
release's own schemas (strict: an unknown field is an error), besides the
real 1.20 API server of tests/kube: the DLFleetJob CRD, deploy/'s manifests,
and what the kubernetes platform asks for (worker Pods with every option
job.yaml can set, the master's Service and Secret)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dlfleet.master.job.crd import definition
from dlfleet.master.job.jobconfig import parse_job_config
from dlfleet.master.job.platform.kubernetes import KubernetesPlatform, master_service

ROOT = Path(__file__).resolve().parents[3]
# The newest release whose schemas the installed kubernetes-validate holds.
RELEASE = kubernetes_validate.latest_version()


def valid(manifest: dict[str, Any]) -> None:
    where = f"{manifest.get('kind')} {manifest.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(manifest, RELEASE, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where} is not valid for Kubernetes {RELEASE}: {exc.message} at {exc.path}")


def deploy_manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.parent.name == "example":
            continue  # kustomize's own files; the example's job.yaml is a job.yaml
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((f"{path.relative_to(ROOT)} {document['kind']}", document))
    return found


def test_the_release_is_a_current_one() -> None:
    major, minor = (int(part) for part in RELEASE.split(".")[:2])
    assert (major, minor) >= (1, 33), RELEASE


def test_the_dlfleetjob_crd_is_valid() -> None:
    valid(definition())


@pytest.mark.parametrize(("where", "manifest"), deploy_manifests(), ids=lambda v: str(v)[:60])
def test_deploy_manifests_are_valid(where: str, manifest: dict[str, Any]) -> None:
    assert where
    valid(manifest)


class RecordingCore:
    """Stands in for CoreV1Api where the platform creates a Pod or a Secret:
    keeps what it was asked to create."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
        self.pods.append(body)

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
        self.pods.append(body)


def test_a_worker_pod_with_every_option_and_the_token_secret_are_valid(tmp_path: Path) -> None:
    config = parse_job_config(
        {
            "name": "demo",
            "command": "train.py",
            "platform": "kubernetes",
            "nproc_per_node": 2,
            "env": {"A": "1"},
            "kubernetes": {
                "image": "example/train:1",
                "namespace": "ns",
                "working_dir": "/work",
                "resources": {"limits": {"memory": "8Gi", "nvidia.com/gpu": "2"}},
                "env": [{"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volume_mounts": [{"name": "data", "mountPath": "/data"}],
                "node_selector": {"pool": "gpu"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "priority_class": "high",
                "scheduler_name": "volcano",
                "service_account": "trainer",
                "labels": {"team": "a"},
                "annotations": {"note": "x"},
                "image_pull_secrets": ["registry"],
            },
        },
        base_dir=tmp_path,
    )
    platform = KubernetesPlatform(config, master_port=50051, token="t", client=object())
    core = RecordingCore()
    platform.core = core
    platform.add_node()
    platform._ensure_secret()
    pod, secret = core.pods
    assert pod["spec"]["schedulerName"] == "volcano"
    valid(pod)
    valid(secret)


def test_the_master_service_is_valid(tmp_path: Path) -> None:
    config = parse_job_config(
        {
            "name": "demo",
            "command": "train.py",
            "platform": "kubernetes",
            "http": {"host": "0.0.0.0", "port": 8080},
            "kubernetes": {"image": "x"},
        },
        base_dir=tmp_path,
    )
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "demo-master", "uid": "u-1"}
    valid(master_service(config, "demo-master", "ns", 50051, owner))


def test_the_validator_refuses_what_a_release_does_not_know() -> None:
    """The check can fail: an unknown field and a wrong type are errors."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "x", "cpus": 2}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, RELEASE, strict=True)
    pod["spec"] = {"containers": [{"name": "c", "image": "x", "ports": [{"containerPort": "x"}]}]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, RELEASE, strict=True)

"""deploy/ against the real API server: every manifest (rendered by kustomize)
is accepted by a server-side dry run, uses API versions that Kubernetes 1.20
serves, and the master's Role is enough for a whole job on the kubernetes
platform (run with the ServiceAccount's own token) and no more."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube.kube_jobs import KubeJob, pods, running_pods, wait
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubetest.cluster import KubeCluster
from kubetest.kubelet import TestKubelet

from dlfleet.master.job.jobconfig import parse_job_config

pytestmark = [pytest.mark.e2e, pytest.mark.kube, pytest.mark.timeout(300)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLE = DEPLOY / "overlays" / "example"
# Group versions a 1.20 server serves (and later ones still do).
V1_20 = {"v1", "apps/v1", "batch/v1", "rbac.authorization.k8s.io/v1"}


def render(cluster: KubeCluster, path: Path) -> list[dict[str, Any]]:
    done = cluster.kubectl("kustomize", str(path))
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_the_example_overlay_renders_with_1_20_api_versions(kube_cluster: KubeCluster) -> None:
    objects = render(kube_cluster, EXAMPLE)
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    assert kinds == sorted([
        "ServiceAccount/dlfleet-master", "Role/dlfleet-master", "RoleBinding/dlfleet-master",
        "Job/dlfleet-master", "PersistentVolumeClaim/dlfleet-state",
        "ConfigMap/dlfleet-job", "Secret/dlfleet-token", "Secret/dlbrain-postgres",
        "Deployment/dlbrain", "Service/dlbrain",
        "StatefulSet/dlbrain-postgres", "Service/dlbrain-postgres",
    ])  # fmt: skip
    assert {o["apiVersion"] for o in objects} <= V1_20
    assert {o["metadata"]["namespace"] for o in objects} == {"dlfleet-example"}
    # The job.yaml in the ConfigMap is a valid kubernetes job whose name the
    # master Pod's labels carry (the headless Service selects it by them).
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    data = yaml.safe_load(config_map["data"]["job.yaml"])
    token_file = data.pop("token_file")  # a mounted Secret, absent here
    config = parse_job_config(data, base_dir=Path("/"))
    assert config.platform == "kubernetes" and config.kubernetes is not None
    job = next(o for o in objects if o["kind"] == "Job")
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"]["dlfleet.io/job"] == config.name
    assert pod["metadata"]["labels"]["dlfleet.io/role"] == "master"
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert token_file.startswith(mounts["token"])
    assert config.store_url.startswith(f"sqlite:///{mounts['state']}")
    assert pod["spec"]["serviceAccountName"] == "dlfleet-master"
    assert config.kubernetes.token_secret is not None
    assert config.kubernetes.token_secret.name == "dlfleet-token"
    # The Pod exposes the ports the job.yaml serves on; /metrics is on the
    # HTTP port, beyond the Pod's loopback (the Service announces it).
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert config.http is not None and config.http.beyond_loopback()
    assert ports == {"grpc": config.master.port, "http": config.http.port}


def test_every_manifest_passes_a_server_side_dry_run(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    objects = render(kube_cluster, EXAMPLE)
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
    manifest = yaml.safe_dump_all(objects)
    done = kube_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input_text=manifest)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("(server dry run)") == len(objects), done.stdout
    for path in (DEPLOY / "base", DEPLOY / "brain"):  # each part on its own, too
        part = yaml.safe_dump_all(render(kube_cluster, path))
        done = kube_cluster.kubectl(
            "apply", "-n", namespace, "--dry-run=server", "-f", "-", input_text=part
        )
        assert done.returncode == 0, done.stderr


def test_the_role_is_enough_for_a_job_and_no_more(
    tmp_path: Path,
    kube_cluster: KubeCluster,
    kube_api: Any,
    namespace: str,
    kubelet: TestKubelet,
) -> None:
    done = kube_cluster.kubectl("apply", "-n", namespace, "-f", str(DEPLOY / "base" / "rbac.yaml"))
    assert done.returncode == 0, done.stderr
    as_master = kube_cluster.service_account_kubeconfig(namespace, "dlfleet-master")
    token = "a-token-of-this-test-0123456789"
    core: Any = k8s.CoreV1Api(kube_api)
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "kjob-token"}, "stringData": {"token": token}}
    )
    job = KubeJob(
        tmp_path / "job", namespace, as_master, kubelet.host_ip, ["--sleep-per-step", "0.02"],
        token=token, kube={"token_secret": {"name": "kjob-token", "key": "token"}},
    )  # fmt: skip
    job.start()
    wait(lambda: len(running_pods(kube_api, namespace)) == 2, "2 running pods", 60)
    output = job.succeed()
    job.check()
    assert "Forbidden" not in output and "forbidden" not in output, output[-3000:]
    assert pods(kube_api, namespace) == []
    events = core.list_namespaced_event(namespace).items
    assert any(e.source.component == "dlmaster" for e in events)

    # ...and nothing else: what the Role does not list is refused.
    with kube_cluster.api_client(as_master) as api:
        sa_core: Any = k8s.CoreV1Api(api)
        refused = {
            "read secrets": lambda: sa_core.list_namespaced_secret(namespace),
            "edit config maps": lambda: sa_core.create_namespaced_config_map(
                namespace, {"metadata": {"name": "x"}}
            ),
            "list nodes": sa_core.list_node,
            "pods elsewhere": lambda: sa_core.list_namespaced_pod("default"),
            "update pods": lambda: sa_core.patch_namespaced_pod(
                "x", namespace, {"metadata": {"labels": {"a": "b"}}},
                _content_type="application/merge-patch+json",
            ),
            "create deployments": lambda: k8s.AppsV1Api(api).create_namespaced_deployment(
                namespace, json.loads(DEPLOYMENT)
            ),
        }  # fmt: skip
        for what, call in refused.items():
            with pytest.raises(ApiException) as caught:
                call()
            assert caught.value.status == 403, f"{what}: {caught.value.status}"


DEPLOYMENT = json.dumps(
    {
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "x", "image": "x"}]},
            },
        },
    }
)

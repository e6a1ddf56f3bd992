"""Fixtures for tests against a real Kubernetes control plane (kubetest):
`kube_cluster` (one per session, about 10 s to start), `kube_api` (an admin
ApiClient), `kubelet` (one test node per module), `namespace` (a fresh one
per test, deleted after it) and `dlfleetjobs` (the DLFleetJob CRD installed,
and a CustomObjectsApi to use it).

The binaries come from scripts/kube_env.sh; without them the tests fail (they
are not skipped), saying so, as they do without root (the kubelet makes each
Pod a machine of its own in network and mount namespaces). tools/ is put on
sys.path here, for `kubetest`."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubetest import KubeBinaries, KubeCluster, KubeEnvMissing, TestKubelet, wait_until


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler on
    127.0.0.1; component logs under its work_dir/logs."""
    binaries: KubeBinaries | str
    try:
        binaries = KubeBinaries.find()
    except KubeEnvMissing as exc:
        binaries = str(exc)  # failed outside the except: no chained traceback
    if isinstance(binaries, str):
        pytest.fail(binaries, pytrace=False)
    cluster = KubeCluster(tmp_path_factory.mktemp("kube-cluster"), binaries)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def kube_api(kube_cluster: KubeCluster) -> Iterator[Any]:
    """A kubernetes.client.ApiClient authenticated as the cluster admin."""
    api = kube_cluster.api_client()
    yield api
    api.close()


@pytest.fixture(scope="module")
def kubelet(
    kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestKubelet]:
    """A Ready node whose Pods run as local processes; it has the node to
    itself, so every Pod the scheduler places lands on it."""
    node = f"kubetest-node-{secrets.token_hex(3)}"
    kubelet = TestKubelet(
        kube_cluster.kubeconfig_path,
        node,
        tmp_path_factory.mktemp("kubelet"),
        restart_backoff_s=0.2,
    )
    kubelet.start()
    yield kubelet
    kubelet.stop()


@pytest.fixture
def namespace(kube_api: Any) -> Iterator[str]:
    """A fresh namespace whose default service account has its token, so
    Pods are admitted at once; deleted (not waited for) after the test."""
    core: Any = client.CoreV1Api(kube_api)
    name = f"kt-{secrets.token_hex(4)}"
    core.create_namespace({"metadata": {"name": name}})

    def token_ready() -> bool:
        accounts = core.list_namespaced_service_account(name).items
        return any(account.metadata.name == "default" and account.secrets for account in accounts)

    wait_until(token_ready, 30, f"the default service account of namespace {name}")
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="session")
def dlfleetjobs(kube_api: Any) -> Iterator[Any]:
    """The CRD from deploy/crd/dlfleetjob.yaml, established; a
    CustomObjectsApi to use it."""
    extensions: Any = client.ApiextensionsV1Api(kube_api)
    root = Path(__file__).resolve().parents[2]
    manifest = yaml.safe_load((root / "deploy" / "crd" / "dlfleetjob.yaml").read_text())
    name = manifest["metadata"]["name"]
    try:
        extensions.create_custom_resource_definition(manifest)
    except ApiException as exc:
        if exc.status != 409:
            raise

    def established() -> bool:
        conditions = extensions.read_custom_resource_definition(name).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_until(established, 30, f"the CRD {name} established")
    yield client.CustomObjectsApi(kube_api)

"""The DLFleetJob controller (`dlmaster operator`'s Operator) against a real
API server and its garbage collector, without a kubelet (nothing here runs
a Pod; the master running as a Pod: tests/kube/test_kube_platform.py):

- a DLFleetJob gets its ConfigMap (job.yaml), token Secret and master Job,
  owned by it; status Created with the Created condition;
- passes after the first create nothing, nor does a controller started again
  (adopted: the token stays the one the job already holds);
- suspended: the master Job and job.yaml go (the token Secret stays, for
  the resumed job), status Suspended; resumed: made again;
- a spec that job.yaml's rules refuse: status Failed, reason InvalidSpec,
  naming the field, nothing made;
- the resource deleted: the garbage collector removes what it owned."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dlfleet.master.job import crd
from dlfleet.master.operator.controller import Operator
from dlfleet.master.operator.plan import OperatorSettings

pytestmark = pytest.mark.kube

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings(master_image="registry.example.com/dlfleet-master:0.1")


def wait(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def submit(dlfleetjobs: Any, namespace: str, name: str, **spec: Any) -> None:
    dlfleetjobs.create_namespaced_custom_object(
        crd.GROUP,
        crd.VERSION,
        namespace,
        crd.PLURAL,
        {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
            "kind": crd.KIND,
            "metadata": {"name": name},
            "spec": {
                "command": "train.py",
                "nodes": {"min": 1, "max": 2},
                "kubernetes": {"image": "example/train:1"},
                **spec,
            },
        },
    )


def status(dlfleetjobs: Any, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = dlfleetjobs.get_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, name
    )
    return found.get("status") or {}


def owned(kube_api: Any, namespace: str, name: str) -> dict[str, Any]:
    """What carries the job's label, by kind/name."""
    core: Any = client.CoreV1Api(kube_api)
    batch: Any = client.BatchV1Api(kube_api)
    selector = f"dlfleet.io/job={name}"
    found = {}
    for kind, listed in (
        ("ConfigMap", core.list_namespaced_config_map(namespace, label_selector=selector)),
        ("Secret", core.list_namespaced_secret(namespace, label_selector=selector)),
        ("Job", batch.list_namespaced_job(namespace, label_selector=selector)),
    ):
        for item in listed.items:
            found[f"{kind}/{item.metadata.name}"] = item
    return found


def test_a_job_gets_its_objects_once_and_a_restarted_controller_adopts_them(
    kube_api: Any, dlfleetjobs: Any, namespace: str
) -> None:
    submit(dlfleetjobs, namespace, "demo")
    operator = Operator(kube_api, SETTINGS, namespace)
    operator.reconcile_all()
    made = owned(kube_api, namespace, "demo")
    assert sorted(made) == ["ConfigMap/demo-job", "Job/demo-master", "Secret/demo-token"]
    uid = dlfleetjobs.get_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "demo"
    )["metadata"]["uid"]
    for item in made.values():
        (owner,) = item.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "DLFleetJob", "demo", uid, True,
        )  # fmt: skip
    token = made["Secret/demo-token"].data["token"]
    assert len(base64.b64decode(token)) == 64
    seen = status(dlfleetjobs, namespace, "demo")
    assert seen["phase"] == "Created" and seen["observedGeneration"] == 1
    created = {c["type"]: c["status"] for c in seen["conditions"]}
    assert created == {"Created": "True", "Running": "False", "Restarting": "False",
                       "Suspended": "False", "Succeeded": "False", "Failed": "False"}  # fmt: skip

    operator.reconcile_all()
    Operator(kube_api, SETTINGS, namespace).reconcile_all()  # started again
    again = owned(kube_api, namespace, "demo")
    assert {k: v.metadata.uid for k, v in again.items()} == {
        k: v.metadata.uid for k, v in made.items()
    }
    assert again["Secret/demo-token"].data["token"] == token


def test_suspending_removes_everything_and_resuming_makes_it_again(
    kube_api: Any, dlfleetjobs: Any, namespace: str
) -> None:
    submit(dlfleetjobs, namespace, "held", suspend=True)
    operator = Operator(kube_api, SETTINGS, namespace)
    operator.reconcile_all()
    assert owned(kube_api, namespace, "held") == {}  # suspended from the start: nothing
    assert status(dlfleetjobs, namespace, "held")["phase"] == "Suspended"

    dlfleetjobs.patch_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "held", {"spec": {"suspend": False}}
    )
    operator.reconcile_all()
    assert len(owned(kube_api, namespace, "held")) == 3
    assert status(dlfleetjobs, namespace, "held")["phase"] == "Created"

    dlfleetjobs.patch_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "held", {"spec": {"suspend": True}}
    )
    operator.reconcile_all()
    # Deleted in the foreground: gone once the garbage collector is done.
    wait(
        lambda: sorted(owned(kube_api, namespace, "held")) == ["Secret/held-token"],
        "the suspended job's master and job.yaml gone",
    )
    seen = status(dlfleetjobs, namespace, "held")
    assert seen["phase"] == "Suspended" and seen["observedGeneration"] == 3


def test_a_spec_job_yaml_refuses_fails_naming_the_field_and_makes_nothing(
    kube_api: Any, dlfleetjobs: Any, namespace: str
) -> None:
    submit(dlfleetjobs, namespace, "bad", step_timeout_min_s=3)  # no step_timeout_factor
    Operator(kube_api, SETTINGS, namespace).reconcile_all()
    assert owned(kube_api, namespace, "bad") == {}
    seen = status(dlfleetjobs, namespace, "bad")
    assert seen["phase"] == "Failed" and seen["reason"] == "InvalidSpec"
    assert "step_timeout_min_s" in seen["message"]


def test_deleting_the_resource_deletes_what_it_owned(
    kube_api: Any, dlfleetjobs: Any, namespace: str
) -> None:
    submit(dlfleetjobs, namespace, "gone")
    Operator(kube_api, SETTINGS, namespace).reconcile_all()
    assert len(owned(kube_api, namespace, "gone")) == 3
    dlfleetjobs.delete_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "gone"
    )
    wait(
        lambda: owned(kube_api, namespace, "gone") == {},
        "the garbage collector to delete the job's objects",
        60,
    )


@pytest.fixture(scope="module")
def operator_api(kube_api: Any, kube_cluster: Any) -> Iterator[Any]:
    """A client authenticated as deploy/operator's ServiceAccount, bound to
    its ClusterRole (the manifest's objects, less the Deployment)."""
    core: Any = client.CoreV1Api(kube_api)
    rbac: Any = client.RbacAuthorizationV1Api(kube_api)
    documents = list(yaml.safe_load_all((ROOT / "deploy/operator/operator.yaml").read_text()))
    by_kind = {d["kind"]: d for d in documents}
    for kind, create in (
        ("Namespace", core.create_namespace),
        ("ServiceAccount", lambda d: core.create_namespaced_service_account("dlfleet-system", d)),
        ("ClusterRole", rbac.create_cluster_role),
        ("ClusterRoleBinding", rbac.create_cluster_role_binding),
    ):
        try:
            create(by_kind[kind])
        except ApiException as exc:
            if exc.status != 409:
                raise
    kubeconfig = kube_cluster.service_account_kubeconfig("dlfleet-system", "dlfleet-operator")
    api: Any = kube_cluster.api_client(kubeconfig)
    yield api
    api.close()


def test_the_controller_does_its_work_with_its_clusterrole_and_nothing_else(
    kube_api: Any, dlfleetjobs: Any, namespace: str, operator_api: Any
) -> None:
    submit(dlfleetjobs, namespace, "rbac")
    Operator(operator_api, SETTINGS, None).reconcile_all()  # every namespace
    assert len(owned(kube_api, namespace, "rbac")) == 3
    assert status(dlfleetjobs, namespace, "rbac")["phase"] == "Created"
    dlfleetjobs.patch_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "rbac", {"spec": {"suspend": True}}
    )
    Operator(operator_api, SETTINGS, None).reconcile_all()
    assert status(dlfleetjobs, namespace, "rbac")["phase"] == "Suspended"

    core: Any = client.CoreV1Api(operator_api)
    refused = [
        lambda: core.list_namespaced_pod(namespace),
        lambda: core.list_namespaced_secret(namespace),
        lambda: core.read_namespaced_secret("rbac-token", namespace),
        core.list_node,
        lambda: core.delete_namespace(namespace),
        lambda: client.CustomObjectsApi(operator_api).delete_namespaced_custom_object(
            crd.GROUP, crd.VERSION, namespace, crd.PLURAL, "rbac"
        ),
    ]
    for index, call in enumerate(refused):
        with pytest.raises(ApiException) as denied:
            call()
            pytest.fail(f"call {index} was allowed")
        assert denied.value.status == 403, (index, denied.value)

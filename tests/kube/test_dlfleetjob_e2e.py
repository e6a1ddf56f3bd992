"""A whole job trained through a DLFleetJob, as a cluster user runs one: the
controller (`dlmaster operator`'s Operator, run here as its own thread) makes
the master Job from the resource; the master, a Pod of the test kubelet,
makes the worker Pods; the resource's status shows the job training
(`kubectl get dlfleetjobs`), a killed worker Pod is an event on it, a change
of spec.nodes scales the job, the job succeeds with every record trained
once, and deleting the resource removes everything.

The one concession to kubetest: its Pods have no service account token to
reach the API server with, so the master gets the admin kubeconfig through
the controller's `master_env` and a hostPath volume (as a cluster without
in-cluster credentials would pass one)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.ledger import assert_exactly_once, read_ledger
from kube.kube_jobs import AGENT, BATCH, EPOCHS, LEDGER_SCRIPT, SIZE, shared_volume, wait
from kubernetes import client as k8s
from kubetest import KubeCluster, TestKubelet

from dlfleet.master.job import crd
from dlfleet.master.operator.controller import Operator
from dlfleet.master.operator.plan import OperatorSettings

pytestmark = pytest.mark.kube

NAME = "ledger"


@pytest.fixture
def operator(
    kube_api: Any, kube_cluster: KubeCluster, namespace: str, tmp_path: Path
) -> Iterator[Path]:
    """The controller, running; yields the job's folder (its ledger, and a
    store that outlives a master Pod), a hostPath volume of the master's and
    the workers' Pods, as a shared filesystem would be."""
    root = tmp_path / "job"
    (root / "ledger").mkdir(parents=True)
    control, control_mount = shared_volume(kube_cluster.work_dir, "control-plane")
    shared, shared_mount = shared_volume(root)
    settings = OperatorSettings(
        master_image="dlfleet-master:test",  # the test kubelet runs the command here
        service_account="default",  # deploy/base/rbac.yaml's dlfleet-master on a cluster
        master_command=(sys.executable, "-u", "-m", "dlfleet.master"),
        master_env={"KUBECONFIG": str(kube_cluster.kubeconfig_path)},
        master_volumes=(control, shared),
        master_volume_mounts=(control_mount, shared_mount),
    )
    stop = threading.Event()
    thread = threading.Thread(
        target=Operator(kube_api, settings, namespace).run, args=(stop, 0.5), daemon=True
    )
    thread.start()
    yield root
    stop.set()
    thread.join(10)


def resource(root: Path, *args: str, **spec: Any) -> dict[str, Any]:
    volume, mount = shared_volume(root)
    ledger = root / "ledger"
    return {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
        "kind": crd.KIND,
        "metadata": {"name": NAME},
        "spec": {
            "command": str(LEDGER_SCRIPT),
            "args": ["--ledger-dir", str(ledger), "--size", str(SIZE),
                     "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
                     "--sleep-per-step", "0.15", *(args or ("--checkpoint-every", "4"))],
            "nodes": {"min": 1, "max": 3, "initial": 2},
            "max_restarts": 3,
            "max_node_relaunches": 6,
            "relaunch_delay_s": 0.5,
            "rendezvous": {"last_call_timeout_s": 0.5},
            "heartbeat": {"interval_s": 0.5, "timeout_s": 10},
            "node_check": {"enabled": False},
            "kubernetes": {
                "image": "dlfleet-train:test",
                "worker_command": AGENT,
                "resources": {"requests": {"cpu": "100m", "memory": "512Mi"},
                              "limits": {"memory": "512Mi"}},
                "termination_grace_s": 5,
                "volumes": [volume],
                "volume_mounts": [mount],
            },
            **spec,
        },
    }  # fmt: skip


class Watched:
    """What the test reads of the job: the resource's status, its worker
    Pods, the master's log, the ledger, and what carries the job's label."""

    def __init__(
        self, api: Any, dlfleetjobs: Any, namespace: str, kubelet: TestKubelet, root: Path
    ) -> None:
        self.core: Any = k8s.CoreV1Api(api)
        self.batch: Any = k8s.BatchV1Api(api)
        self.custom = dlfleetjobs
        self.namespace = namespace
        self.kubelet = kubelet
        self.ledger = root / "ledger"
        self.phases: list[str] = []  # each phase the status showed, in order
        self.conditions: set[str] = set()  # each condition it showed True
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._follow, daemon=True)

    def _follow(self) -> None:
        while not self._stop.wait(0.1):
            with contextlib.suppress(k8s.exceptions.ApiException):
                status = self.status()
                self.conditions |= {
                    c["type"] for c in status.get("conditions") or [] if c["status"] == "True"
                }
                phase = status.get("phase")
                if phase and (not self.phases or self.phases[-1] != phase):
                    self.phases.append(phase)

    def __enter__(self) -> Watched:
        self._watch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._watch.join(5)

    def status(self) -> dict[str, Any]:
        found = self.custom.get_namespaced_custom_object(
            crd.GROUP, crd.VERSION, self.namespace, crd.PLURAL, NAME
        )
        return dict(found.get("status") or {})

    def workers(self) -> dict[str, Any]:
        found = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"dlfleet.io/job={NAME},dlfleet.io/role=worker"
        )
        return {
            p.metadata.name: p
            for p in found.items
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        }

    def master_log(self) -> str:
        found = self.core.list_namespaced_pod(
            self.namespace, label_selector="dlfleet.io/role=master"
        )
        return "\n".join(
            self.kubelet.log_path(self.namespace, p.metadata.name).read_text()[-4000:]
            for p in found.items
        )

    def steps(self) -> int:
        return len(read_ledger(self.ledger)[0])

    def events(self) -> dict[tuple[str, str], str]:
        selector = f"involvedObject.kind={crd.KIND},involvedObject.name={NAME}"
        found = self.core.list_namespaced_event(self.namespace, field_selector=selector)
        return {(e.type, e.reason): e.message for e in found.items}

    def left(self) -> list[str]:
        """What the job made that is still there."""
        selector, ns = f"dlfleet.io/job={NAME}", self.namespace
        core, batch = self.core, self.batch
        return [
            f"{kind}/{item.metadata.name}"
            for kind, listed in (
                ("Pod", core.list_namespaced_pod(ns, label_selector=selector)),
                ("Job", batch.list_namespaced_job(ns, label_selector=selector)),
                ("ConfigMap", core.list_namespaced_config_map(ns, label_selector=selector)),
                ("Secret", core.list_namespaced_secret(ns, label_selector=selector)),
                ("Service", core.list_namespaced_service(ns, label_selector=selector)),
            )
            for item in listed.items
        ]

    def until(self, check: Any, what: str, timeout: float = 60) -> Any:
        try:
            return wait(check, what, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.status()}\n{self.master_log()}") from None


def test_a_dlfleetjob_trains_shows_its_status_scales_and_goes_with_its_resource(
    kube_api: Any,
    kube_cluster: KubeCluster,
    dlfleetjobs: Any,
    namespace: str,
    kubelet: TestKubelet,
    operator: Path,
) -> None:
    root = operator
    with Watched(kube_api, dlfleetjobs, namespace, kubelet, root) as job:
        dlfleetjobs.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, namespace, crd.PLURAL, resource(root)
        )
        run_the_job(job, kube_cluster, dlfleetjobs, kubelet)
    # As the controller and the master wrote them: made, training, a round
    # re-forming after the lost node (and the scale), training, done.
    assert job.phases[:2] == ["Created", "Running"], job.phases
    assert "Restarting" in job.phases and job.phases[-1] == "Succeeded", job.phases
    assert {"Created", "Running", "Succeeded"} <= job.conditions, job.conditions


def run_the_job(job: Watched, kube_cluster: KubeCluster, dlfleetjobs: Any, kubelet: Any) -> None:
    namespace = job.namespace
    job.until(lambda: len(job.workers()) == 2, "2 worker pods", 90)
    job.until(lambda: job.steps() >= 2 * 4, "4 steps of 2 ranks")
    training = job.until(
        lambda: (s := job.status()).get("phase") == "Running" and s.get("recordsDone") and s,
        "the status to show the job training",
    )
    assert training["nodes"] == "2/1/3" and training["readyNodes"] == 2, training
    assert training["round"] >= 1 and 0 < training["recordsDone"] <= SIZE * EPOCHS
    shown = kube_cluster.kubectl("get", "dlfleetjobs", "-n", namespace)
    assert shown.returncode == 0, shown.stderr
    header, row = shown.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "NODES", "ROUND", "RECORDS", "GOODPUT", "AGE"]
    assert row.split()[:3] == [NAME, "Running", "2/1/3"], shown.stdout
    print(f"\n$ kubectl get dlfleetjobs\n{shown.stdout}")  # README's sample comes from here

    kubelet.kill(namespace, f"{NAME}-node-0-0")  # its process dies: exit 137
    job.until(lambda: f"{NAME}-node-0-1" in job.workers(), "node-0 relaunched")
    dlfleetjobs.patch_namespaced_custom_object(
        crd.GROUP, crd.VERSION, namespace, crd.PLURAL, NAME, {"spec": {"nodes": {"initial": 3}}}
    )
    job.until(lambda: f"{NAME}-node-2-0" in job.workers(), "a third worker pod for spec.nodes 3")

    ended = job.until(
        lambda: (s := job.status()).get("phase") in ("Succeeded", "Failed") and s,
        "the job to end",
        240,
    )
    assert ended["phase"] == "Succeeded", f"{ended}\n{job.master_log()}"
    true = {c["type"] for c in ended["conditions"] if c["status"] == "True"}
    assert true == {"Created", "Succeeded"}, ended
    report = assert_exactly_once(job.ledger, size=SIZE, epochs=EPOCHS)
    assert max(e.world for e in read_ledger(job.ledger)[0]) == 3, report
    shown = kube_cluster.kubectl("get", "dlfleetjobs", "-n", namespace)
    print(f"\n$ kubectl get dlfleetjobs\n{shown.stdout}")

    told = job.events()
    assert ("Warning", "NodeLost") in told, told
    assert told[("Warning", "NodeLost")].startswith("node-0 was lost"), told
    assert ("Normal", "Scaled") in told and ("Normal", "Succeeded") in told, told
    shown = kube_cluster.kubectl("describe", "dlfleetjob", NAME, "-n", namespace)
    print(f"\n$ kubectl describe dlfleetjob {NAME}\n{shown.stdout[-1500:]}")

    dlfleetjobs.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, NAME)
    job.until(lambda: job.left() == [], "everything gone with the resource")


def test_a_suspended_dlfleetjob_makes_nothing_and_a_running_one_suspended_resumes_its_steps(
    kube_api: Any, dlfleetjobs: Any, namespace: str, kubelet: TestKubelet, operator: Path
) -> None:
    """Suspended from the start: nothing is made. Resumed, it trains; suspended
    while it trains, everything it runs goes, its workers persisting their
    newest in-memory checkpoint as SIGTERM asks (no periodic persist here);
    resumed again, a new master continues from the job's store and the
    workers from that checkpoint, and every record is trained once."""
    root = operator
    with Watched(kube_api, dlfleetjobs, namespace, kubelet, root) as job:
        dlfleetjobs.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, namespace, crd.PLURAL,
            # Persisted only at step 1000, past the job's end: the step the
            # resumed workers restore can only come from the SIGTERM persist.
            resource(root, "--in-memory", "--persist-every", "1000", suspend=True,
                     state_store=f"sqlite:///{root / 'state.db'}"),
        )  # fmt: skip
        job.until(lambda: job.status().get("phase") == "Suspended", "Suspended")
        assert job.left() == []

        def suspend(value: bool) -> None:
            dlfleetjobs.patch_namespaced_custom_object(
                crd.GROUP, crd.VERSION, namespace, crd.PLURAL, NAME, {"spec": {"suspend": value}}
            )

        suspend(False)
        job.until(lambda: len(job.workers()) == 2, "2 worker pods", 90)
        job.until(lambda: job.steps() >= 2 * 6, "6 steps of 2 ranks")
        suspend(True)
        # The token Secret stays, for the job to resume with.
        running = f"everything the job ran gone (left: {job.left()})"
        job.until(lambda: job.left() == [f"Secret/{NAME}-token"], running, 90)
        assert job.status()["phase"] == "Suspended"
        trained = max(e.step for e in read_ledger(job.ledger)[0])
        suspend(False)
        job.until(
            lambda: job.status().get("phase") in ("Succeeded", "Failed"), "the job to end", 240
        )
    assert job.status()["phase"] == "Succeeded", job.master_log()
    assert job.phases[:3] == ["Suspended", "Created", "Running"], job.phases
    assert "Suspended" in job.phases[3:], job.phases
    assert_exactly_once(job.ledger, size=SIZE, epochs=EPOCHS)
    # The resumed workers started from the step the suspended ones persisted
    # (the step in flight at SIGTERM may not have completed everywhere).
    restored = [r.restored_step for r in read_ledger(job.ledger)[1]]
    assert restored and max(restored) >= trained - 1, (restored, trained)

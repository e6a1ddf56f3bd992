"""The kubernetes platform end to end, on a real kube-apiserver (with the
controller-manager and scheduler) whose Pods the test kubelet runs as local
processes: `dlmaster --job-config` creates, watches, relaunches, scales and
deletes worker Pods, and the exactly-once ledger holds through a killed Pod,
an OOM kill (relaunched with more memory), an eviction, a scale-up from 2 to 3
Pods, an API server restart, a restarted master Pod (a Kubernetes Job), and a
deleted Pod whose replacement restores in-memory checkpoints from its peer
(each Pod a machine of its own, on its own IP)."""

from __future__ import annotations

import ipaddress
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.ledger import read_ledger
from kube.kube_jobs import (
    QUICKSTART,
    KubeJob,
    free_port,
    pods,
    running_pods,
    shared_volume,
    wait,
)
from kubernetes import client as k8s
from kubetest.cluster import KubeCluster
from kubetest.kubelet import TestKubelet

pytestmark = [pytest.mark.e2e, pytest.mark.kube, pytest.mark.timeout(300)]


@pytest.fixture
def api(kube_cluster: KubeCluster) -> Iterator[Any]:
    with kube_cluster.api_client() as client:
        yield client


@pytest.fixture
def make_job(
    tmp_path: Path, namespace: str, kube_cluster: KubeCluster, kubelet: TestKubelet
) -> Iterator[Any]:
    jobs: list[KubeJob] = []

    def make(args: list[str], kubeconfig: Path | None = None, **settings: Any) -> KubeJob:
        job = KubeJob(
            tmp_path / f"job{len(jobs)}",
            namespace,
            kubeconfig or kube_cluster.kubeconfig_path,
            kubelet.host_ip,
            args,
            **settings,
        )
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()


def test_a_job_runs_as_pods_and_its_pods_go_at_the_end(
    make_job: Any, api: Any, namespace: str, kubelet: TestKubelet
) -> None:
    http_port = free_port()
    job = make_job(
        ["--sleep-per-step", "0.1"],  # long enough to be seen training
        http={"host": "0.0.0.0", "port": http_port},
        # Both pods share these two cores with the API server and the rest of
        # the suite: a matmul timed under that load can be judged slow, which
        # would replace a node. This test is about the check running in pods
        # and its verdicts reaching status, not about the slow-node rule.
        node_check={"enabled": True, "slow_factor": 100},
    ).start()
    wait(lambda: len(running_pods(api, namespace)) == 2, "2 running pods")
    for name, pod in running_pods(api, namespace).items():
        assert "--node-check" in pod.spec.containers[0].command
        labels = pod.metadata.labels
        assert labels["dlfleet.io/job"] == "kjob" and labels["dlfleet.io/role"] == "worker"
        assert name == f"kjob-node-{labels['dlfleet.io/node-index']}-0"
        owner = pod.metadata.owner_references[0]
        assert (owner.kind, owner.name) == ("Service", "kjob-master")  # not run from a Pod
        env = {e.name: e for e in pod.spec.containers[0].env}
        assert env["DLFLEET_TOKEN"].value_from.secret_key_ref.name == "kjob-dlfleet"
        token = (job.root / ".dlfleet" / "kjob" / "token").read_text().strip()
        assert token not in json.dumps(pod.to_dict(), default=str)  # only in the Secret
    service: Any = k8s.CoreV1Api(api).read_namespaced_service("kjob-master", namespace)
    assert service.spec.cluster_ip == "None"
    # The HTTP endpoint listens beyond loopback: the Service names its port
    # and tells Prometheus to scrape it.
    assert {(p.name, p.port) for p in service.spec.ports} == {
        ("grpc", job.port),
        ("http", http_port),
    }
    assert service.metadata.annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(http_port),
        "prometheus.io/path": "/metrics",
        "prometheus.io/scheme": "http",
    }
    job.wait_for(
        lambda: all(n["check"]["rule"] == "healthy" for n in job.status()["nodes"]),
        "every node's check healthy",
    )
    job.succeed()
    job.check()
    assert job.worlds() == [2]
    assert pods(api, namespace) == []  # every pod deleted at the end
    with pytest.raises(k8s.exceptions.ApiException):
        k8s.CoreV1Api(api).read_namespaced_service("kjob-master", namespace)


def test_killed_oom_evicted_and_scaled_pods_end_with_exact_data(
    make_job: Any, api: Any, namespace: str, kubelet: TestKubelet
) -> None:
    job = make_job(["--sleep-per-step", "0.06", "--checkpoint-every", "4"]).start()
    wait(lambda: len(running_pods(api, namespace)) == 2, "2 running pods")
    job.wait_for(lambda: job.steps_logged() >= 2 * 8, "8 steps of 2 ranks")

    kubelet.kill(namespace, "kjob-node-0-0")  # the process dies: exit 137
    wait(lambda: "kjob-node-0-1" in running_pods(api, namespace), "node-0 relaunched", 60)

    kubelet.oom_kill(namespace, "kjob-node-1-0")
    relaunched = wait(
        lambda: running_pods(api, namespace).get("kjob-node-1-1"), "node-1 relaunched", 60
    )
    limits = relaunched.spec.containers[0].resources.limits
    assert limits["memory"] == "768Mi", limits  # 512Mi x 1.5 after OOMKilled

    steps = job.steps_logged()
    job.wait_for(lambda: job.steps_logged() >= steps + 2 * 6, "training after the relaunches")
    kubelet.evict(namespace, "kjob-node-0-1", "The node was low on resource: memory.")
    wait(lambda: "kjob-node-0-2" in running_pods(api, namespace), "evicted node replaced", 60)

    assert job.control("scale", "--nodes", "3").returncode == 0
    wait(lambda: "kjob-node-2-0" in running_pods(api, namespace), "a third pod", 60)
    job.wait_for(lambda: 3 in job.worlds(), "a world of 3", timeout=90)

    output = job.succeed(timeout=240)
    report = job.check()
    assert len(report.attempts) >= 3 and job.worlds()[-1] == 3  # the faults made new rounds
    assert "ran out of memory at 512 MiB: relaunching it with 768 MiB" in output
    assert pods(api, namespace) == []


def test_an_api_server_restart_loses_no_pod_event(
    make_job: Any, api: Any, namespace: str, kubelet: TestKubelet, kube_cluster: KubeCluster
) -> None:
    job = make_job(["--sleep-per-step", "0.06", "--checkpoint-every", "4"]).start()
    wait(lambda: len(running_pods(api, namespace)) == 2, "2 running pods")
    job.wait_for(lambda: job.steps_logged() >= 2 * 6, "6 steps of 2 ranks")
    # A Pod dies while the API server is down (its kubelet reports it once the
    # server is back): the ending reaches the platform through a watch that
    # resumes, or lists afresh, across the restart.
    killer = threading.Timer(0.5, kubelet.kill, (namespace, "kjob-node-1-0"))
    killer.start()
    kube_cluster.restart_apiserver(grace_s=0.0)  # from this thread: the cluster's owner
    killer.join()
    wait(lambda: "kjob-node-1-1" in running_pods(api, namespace), "node-1 relaunched", 90)
    job.succeed()
    job.check()


def test_a_restarted_master_pod_continues_the_job(
    tmp_path: Path, api: Any, namespace: str, kubelet: TestKubelet, kube_cluster: KubeCluster
) -> None:
    """The master as deploy/ runs it: a Kubernetes Job whose Pod reads its
    job.yaml from a ConfigMap, and whose headless Service the workers dial by
    name. Its Pod is killed mid-job; the Job controller starts another (at
    another address, which the Service's name follows), which continues from
    the durable store (a SQLite file on a hostPath volume), adopts the worker
    Pods, and finishes the job with exact data. The workers are owned by the
    Job."""
    root = tmp_path / "job"
    job = KubeJob(
        root, namespace, kube_cluster.kubeconfig_path, "0.0.0.0",
        ["--sleep-per-step", "0.06", "--checkpoint-every", "4"],
        workdir=str(root / "work"),
        state_store=f"sqlite:///{root / 'state.db'}",
        kube={"master_address": None},  # <service>.<namespace>.svc:<port>
    )  # fmt: skip
    shared, shared_mount = shared_volume(root)
    # The kubeconfig and its CA file (the apiserver is at 127.0.0.1 in a Pod too).
    control, control_mount = shared_volume(kube_cluster.work_dir, "control-plane")
    job_yaml = job.config.read_text()
    core: Any = k8s.CoreV1Api(api)  # dict bodies; fields read as Any
    batch: Any = k8s.BatchV1Api(api)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "kjob-config"}, "data": {"job.yaml": job_yaml}}
    )
    batch.create_namespaced_job(
        namespace,
        {
            "metadata": {"name": "kjob-master"},
            "spec": {
                "backoffLimit": 4,
                "template": {
                    "metadata": {"labels": {"dlfleet.io/job": "kjob", "dlfleet.io/role": "master"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{
                            "name": "master",
                            "image": "dlfleet-master:test",
                            "command": [sys.executable, "-u", "-m", "dlfleet.master",
                                        "--job-config", "/etc/dlfleet/job/job.yaml"],
                            "env": [{"name": "POD_NAME",
                                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                            "volumeMounts": [{"name": "job", "mountPath": "/etc/dlfleet/job"},
                                             shared_mount, control_mount],
                        }],
                        "volumes": [{"name": "job", "configMap": {"name": "kjob-config"}},
                                    shared, control],
                    },
                },
            },
        },
    )  # fmt: skip

    def master_pods() -> list[Any]:
        found = core.list_namespaced_pod(namespace, label_selector="dlfleet.io/role=master")
        return [p for p in found.items if p.status.phase == "Running"]

    first_pod = wait(master_pods, "the master pod running", 60)[0]
    first = first_pod.metadata.name
    try:
        wait(lambda: len(running_pods(api, namespace)) == 2, "2 worker pods", 60)
    except AssertionError:
        raise AssertionError(kubelet.log_path(namespace, first).read_text()[-4000:]) from None
    for pod in running_pods(api, namespace).values():
        owner = pod.metadata.owner_references[0]
        assert (owner.kind, owner.name) == ("Job", "kjob-master")
    job.wait_for(lambda: job.steps_logged() >= 2 * 8, "8 steps of 2 ranks")
    kubelet.kill(namespace, first)  # the supervisor, and the master with it
    second_pod = wait(
        lambda: [p for p in master_pods() if p.metadata.name != first], "a new master pod", 60
    )[0]
    second = second_pod.metadata.name
    assert second_pod.status.pod_ip != first_pod.status.pod_ip

    def job_done() -> bool:
        status = batch.read_namespaced_job_status("kjob-master", namespace).status
        ended = {c.type for c in status.conditions or [] if c.status == "True"}
        return bool(ended & {"Complete", "Failed"})

    wait(job_done, "the master Job to finish", 240)
    status = batch.read_namespaced_job_status("kjob-master", namespace).status
    log = kubelet.log_path(namespace, second).read_text()
    assert status.succeeded == 1, log[-4000:]
    assert "adopted pod kjob-node-0-0 as node-0" in log
    assert "adopted pod kjob-node-1-0 as node-1" in log
    job.check()
    assert pods(api, namespace) == []


def test_pods_that_can_never_be_scheduled_fail_the_job_with_the_reason(
    make_job: Any, api: Any, namespace: str, kubelet: TestKubelet
) -> None:
    job = make_job(
        [],
        nodes={"min": 1, "max": 2},
        kube={
            "resources": {"requests": {"memory": "900Gi"}, "limits": {"memory": "900Gi"}},
            "pending_timeout_s": 4,
        },
    ).start()

    def pending_reason() -> bool:
        nodes = job.status()["nodes"]
        return all("Insufficient memory" in n.get("detail", "") for n in nodes)

    job.wait_for(pending_reason, "the nodes' pending reason in the status", timeout=30)
    code, out, err = job.finish(timeout=60)
    assert code == 1, out + err
    assert "only 0 nodes can run, fewer than nodes.min=1" in err + out
    assert "Insufficient memory" in err + out
    assert pods(api, namespace) == []


def test_the_quickstart_runs_as_pods_through_a_deleted_pod(
    make_job: Any, api: Any, namespace: str, kubelet: TestKubelet
) -> None:
    """examples/quickstart as Pods. One worker Pod is deleted mid-run (what a
    preemption looks like from the API): it is replaced under the same node
    index and the job finishes."""
    job = make_job([])
    settings = json.loads(job.config.read_text())
    settings["command"] = str(QUICKSTART / "train.py")
    # Persisted where both Pods see it: the job's directory, their shared volume.
    checkpoints = str(job.root / "checkpoints")
    settings["args"] = ["--epochs", "4", "--checkpoint-every", "5", "--checkpoint-dir", checkpoints]
    job.config.write_text(json.dumps(settings))
    job.start()
    wait(lambda: len(running_pods(api, namespace)) == 2, "2 running pods")
    time.sleep(3)  # some steps
    core: Any = k8s.CoreV1Api(api)
    core.delete_namespaced_pod("kjob-node-1-0", namespace, grace_period_seconds=1)
    wait(lambda: "kjob-node-1-1" in running_pods(api, namespace), "node-1 replaced", 60)
    output = job.succeed()
    assert "node-1 was lost (its pod was deleted)" in output, output[-3000:]
    logs = [kubelet.log_path(namespace, p).read_text() for p in ("kjob-node-0-0", "kjob-node-1-1")]
    assert any("done: 4 epochs" in log for log in logs), logs
    assert pods(api, namespace) == []


def test_ddp_across_pods_on_their_own_ips_restores_a_deleted_pods_replacement_from_memory(
    make_job: Any, api: Any, namespace: str, kubelet: TestKubelet
) -> None:
    """Two worker Pods, each a machine with its own IP, train DDP (gloo, one
    process each) with every step checkpointed in memory: a node's images in
    its own /dev/shm (the Pod's memory-backed emptyDir), a replica of them on
    the other node. node-1's Pod is deleted mid-run: node-0 goes on alone from
    its memory; the replacement Pod (a new machine: new IP, empty /dev/shm)
    joins and restores the step from its peer, across the Pod network; every
    record is trained exactly once."""
    job = make_job(["--in-memory", "--sleep-per-step", "0.15"], relaunch_delay_s=2.0)
    job.start()
    first = wait(lambda: len(running_pods(api, namespace)) == 2 and running_pods(api, namespace),
                 "2 running pods")  # fmt: skip
    network = ipaddress.ip_interface(f"{kubelet.host_ip}/24").network
    ips = {name: pod.status.pod_ip for name, pod in first.items()}
    assert len(set(ips.values())) == 2, ips
    assert all(ipaddress.ip_address(ip) in network for ip in ips.values()), (ips, network)
    job.wait_for(lambda: job.steps_logged() >= 2 * 12, "12 steps of 2 ranks")

    k8s.CoreV1Api(api).delete_namespaced_pod("kjob-node-1-0", namespace, grace_period_seconds=1)
    replacement = wait(
        lambda: running_pods(api, namespace).get("kjob-node-1-1"), "node-1's replacement", 60
    )
    assert replacement.status.pod_ip not in ips.values()
    ips["kjob-node-1-1"] = replacement.status.pod_ip
    job.succeed()

    report = job.check()
    entries, _, _ = read_ledger(job.ledger)
    worlds = {entry.attempt: entry.world for entry in entries}
    attempts = sorted(worlds)
    assert worlds[attempts[0]] == 2 and worlds[attempts[-1]] == 2, worlds
    alone = next(attempt for attempt in attempts if worlds[attempt] == 1)
    rejoined = next(attempt for attempt in attempts if attempt > alone and worlds[attempt] == 2)
    restored = {restore.attempt: restore.restored_step for restore in report.restores}
    assert restored[alone] >= 10 and restored[rejoined] >= restored[alone], report.restores
    for name, ip in ips.items():  # each node published its Pod's IP to the others
        assert ip in kubelet.log_path(namespace, name).read_text(), name

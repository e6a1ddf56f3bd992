"""The Kubernetes test environment itself: a real control plane (etcd,
kube-apiserver, controller-manager, scheduler) and the test kubelet that runs
Pods as local processes, each a machine of its own (address, hostname,
loopback, /tmp, /dev/shm, names of Services), so that the Kubernetes
platform's tests can rely on both."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubetest import KubeCluster, PodNetwork, TestKubelet, wait_until
from kubetest.names import Endpoint, PodName, hosts_file, write_in_place

pytestmark = [pytest.mark.integration, pytest.mark.kube]

Json = dict[str, Any]


@pytest.fixture
def core(kube_api: Any) -> Any:
    return client.CoreV1Api(kube_api)


def pod_manifest(
    name: str,
    command: list[str],
    *,
    restart_policy: str = "Never",
    env: list[Json] | None = None,
    **spec: Any,
) -> Json:
    container: Json = {"name": "main", "image": "busybox", "command": command, "env": env or []}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": restart_policy, "containers": [container], **spec},
    }


def wait_pod(core: Any, namespace: str, name: str, check: Callable[[Any], bool], what: str) -> Any:
    def probe() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if check(pod) else None

    return wait_until(probe, 30, f"pod {namespace}/{name}: {what}")


def finished(core: Any, namespace: str, name: str) -> Any:
    return wait_pod(
        core, namespace, name, lambda pod: pod.status.phase in ("Succeeded", "Failed"), "finished"
    )


def started(core: Any, kubelet: TestKubelet, namespace: str, name: str) -> int:
    wait_pod(core, namespace, name, lambda pod: pod.status.phase == "Running", "running")
    pid = kubelet.pid(namespace, name)
    assert pid is not None
    return pid


def live_processes_in_group(pgid: int) -> list[int]:
    """Pids of the group's processes that are not zombies (this machine's
    init reaps orphans lazily)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            live.append(int(stat.parent.name))
    return live


def terminated(pod: Any) -> Any:
    return pod.status.container_statuses[0].state.terminated


def test_pod_command_runs_and_the_pod_succeeds_with_exit_code_0(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    core.create_namespaced_pod(namespace, pod_manifest("hello", ["sh", "-c", "echo hello"]))

    pod = finished(core, namespace, "hello")

    assert pod.spec.node_name == kubelet.node_name
    assert pod.status.phase == "Succeeded"
    assert (pod.status.host_ip, pod.status.pod_ip) == (
        kubelet.host_ip,
        kubelet.pod_ip(namespace, "hello"),
    )
    assert (terminated(pod).exit_code, terminated(pod).reason) == (0, "Completed")
    assert kubelet.log_path(namespace, "hello").read_text() == "hello\n"


def test_failing_command_fails_the_pod_with_its_exit_code(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    core.create_namespaced_pod(namespace, pod_manifest("fails", ["sh", "-c", "exit 3"]))

    pod = finished(core, namespace, "fails")

    assert pod.status.phase == "Failed"
    assert (terminated(pod).exit_code, terminated(pod).reason) == (3, "Error")


@pytest.mark.parametrize(
    ("control", "reason"),
    [(TestKubelet.kill, "Error"), (TestKubelet.oom_kill, "OOMKilled")],
    ids=["kill", "oom_kill"],
)
def test_killed_process_fails_the_pod_with_exit_code_137(
    kubelet: TestKubelet,
    namespace: str,
    core: Any,
    control: Callable[[TestKubelet, str, str], None],
    reason: str,
) -> None:
    core.create_namespaced_pod(namespace, pod_manifest("victim", ["sleep", "60"]))
    started(core, kubelet, namespace, "victim")

    control(kubelet, namespace, "victim")

    pod = finished(core, namespace, "victim")
    assert pod.status.phase == "Failed"
    assert (terminated(pod).exit_code, terminated(pod).reason) == (137, reason)


def test_evicted_pod_fails_with_reason_evicted_and_is_not_restarted(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    manifest = pod_manifest("evictee", ["sleep", "60"], restart_policy="Always")
    core.create_namespaced_pod(namespace, manifest)
    started(core, kubelet, namespace, "evictee")

    kubelet.evict(namespace, "evictee", "The node was low on resource: memory.")

    pod = finished(core, namespace, "evictee")
    assert (pod.status.phase, pod.status.reason) == ("Failed", "Evicted")
    assert pod.status.message == "The node was low on resource: memory."
    assert pod.status.container_statuses[0].restart_count == 0


def test_on_failure_restarts_the_process_in_place(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    # Fails the first time, succeeds the second: the pod dir (cwd) persists.
    script = "test -e tried && exit 0; touch tried; exit 1"
    manifest = pod_manifest("flaky", ["sh", "-c", script], restart_policy="OnFailure")
    core.create_namespaced_pod(namespace, manifest)

    pod = finished(core, namespace, "flaky")

    status = pod.status.container_statuses[0]
    assert (pod.status.phase, status.restart_count) == ("Succeeded", 1)
    assert status.last_state.terminated.exit_code == 1


def test_env_from_field_refs_config_maps_and_secrets_reaches_the_process(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cm"}, "data": {"mode": "fast"}}
    )
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "stringData": {"password": "hunter2"}}
    )
    env: list[Json] = [
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "mode"}}},
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
        {"name": "GREETING", "value": "hi $(POD)"},
    ]
    resources = {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    manifest = pod_manifest(
        "envy",
        ["sh", "-c", 'echo "$POD $NS $IP $MODE $PASSWORD $GREETING"'],
        env=env,
        container={"resources": resources},
    )
    core.create_namespaced_pod(namespace, manifest)

    pod = finished(core, namespace, "envy")
    assert pod.status.phase == "Succeeded"
    logged = kubelet.log_path(namespace, "envy").read_text()
    assert logged == f"envy {namespace} {pod.status.pod_ip} fast hunter2 hi envy\n"
    recorded = kubelet.resources(namespace, "envy")
    assert (recorded.requests, recorded.limits) == (resources["requests"], resources["limits"])


def test_config_map_volume_is_written_locally_and_its_mount_path_rewritten(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "app"}, "data": {"app.yaml": "epochs: 2\n"}}
    )
    # The argument, the env value and the workingDir all point into the mount.
    manifest = pod_manifest(
        "mounted",
        ["sh", "-c", 'cat "$1" "$APP_CONFIG" app.yaml', "sh", "/etc/app/app.yaml"],
        env=[{"name": "APP_CONFIG", "value": "/etc/app/app.yaml"}],
        volumes=[{"name": "config", "configMap": {"name": "app"}}],
        container={
            "workingDir": "/etc/app",
            "volumeMounts": [{"name": "config", "mountPath": "/etc/app"}],
        },
    )
    core.create_namespaced_pod(namespace, manifest)

    assert finished(core, namespace, "mounted").status.phase == "Succeeded"
    assert kubelet.log_path(namespace, "mounted").read_text() == "epochs: 2\n" * 3


def test_deleting_a_running_pod_kills_its_process_after_the_grace_period(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    # SIGTERM is ignored: only the SIGKILL at the end of the grace period ends it.
    manifest = pod_manifest(
        "stubborn", ["sh", "-c", "trap '' TERM; sleep 60"], terminationGracePeriodSeconds=1
    )
    core.create_namespaced_pod(namespace, manifest)
    pid = started(core, kubelet, namespace, "stubborn")

    core.delete_namespaced_pod("stubborn", namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("stubborn", namespace)
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    wait_until(gone, 15, "the pod object to go")
    assert live_processes_in_group(pid) == []


def test_pods_bound_before_the_kubelet_starts_are_run(
    kube_cluster: KubeCluster, namespace: str, core: Any, tmp_path: Path
) -> None:
    manifest = pod_manifest("early", ["true"], nodeName="kubetest-late-node")
    core.create_namespaced_pod(namespace, manifest)

    with TestKubelet(kube_cluster.kubeconfig_path, "kubetest-late-node", tmp_path):
        assert finished(core, namespace, "early").status.phase == "Succeeded"


def test_job_controller_creates_a_pod_that_runs_to_completion(
    kubelet: TestKubelet, namespace: str, kube_api: Any
) -> None:
    batch: Any = client.BatchV1Api(kube_api)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "once"},
        "spec": {"backoffLimit": 0, "template": {"spec": pod_manifest("unused", ["true"])["spec"]}},
    }
    batch.create_namespaced_job(namespace, job)

    def succeeded() -> bool:
        return bool(batch.read_namespaced_job_status("once", namespace).status.succeeded)

    wait_until(succeeded, 30, "job once to succeed")


def test_deleting_an_owner_garbage_collects_its_dependents(namespace: str, core: Any) -> None:
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner.metadata.uid,
    }
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "dependent", "ownerReferences": [reference]}}
    )

    core.delete_namespaced_config_map("owner", namespace)

    def collected() -> bool:
        names = [item.metadata.name for item in core.list_namespaced_config_map(namespace).items]
        return "dependent" not in names

    wait_until(collected, 30, "the dependent config map to be collected")


def test_service_account_without_a_role_is_forbidden_to_list_pods(
    kube_cluster: KubeCluster, namespace: str, core: Any
) -> None:
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    kubeconfig = kube_cluster.service_account_kubeconfig(namespace, "nobody")

    with kube_cluster.api_client(kubeconfig) as api, pytest.raises(ApiException) as denied:
        client.CoreV1Api(api).list_namespaced_pod(namespace)

    assert denied.value.status == 403


def test_cluster_and_kubelet_keep_working_across_an_apiserver_restart(
    kube_cluster: KubeCluster, kubelet: TestKubelet, namespace: str, kube_api: Any
) -> None:
    kube_cluster.restart_apiserver()

    # The scheduler and the kubelet's watch reconnect on their own.
    core: Any = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(namespace, pod_manifest("after", ["true"]))
    assert finished(core, namespace, "after").status.phase == "Succeeded"
    assert kube_cluster.kubectl("get", "pods", "-n", namespace).returncode == 0


def test_kill_sends_the_given_signal_to_the_process(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    core.create_namespaced_pod(namespace, pod_manifest("polite", ["sleep", "60"]))
    started(core, kubelet, namespace, "polite")

    kubelet.kill(namespace, "polite", signal.SIGTERM)

    assert terminated(finished(core, namespace, "polite")).exit_code == 128 + signal.SIGTERM


def test_kubectl_checks_manifests_with_a_server_side_dry_run(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    def dry_run(manifest: Json) -> subprocess.CompletedProcess[str]:
        return kube_cluster.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", "-", input_text=json.dumps(manifest)
        )

    accepted = dry_run(pod_manifest("checked", ["true"]))
    rejected = dry_run(pod_manifest("Not_A_Name", ["true"]))

    assert accepted.returncode == 0, accepted.stderr
    assert rejected.returncode != 0
    assert "Invalid value" in rejected.stderr


# ------------------------------------------------ each Pod a machine of its own

MACHINE = """
import json, os, socket, sys
host_ip, loopback_port = sys.argv[1], int(sys.argv[2])
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((host_ip, 9))  # picks the route, sends nothing
try:
    socket.create_connection(("127.0.0.1", loopback_port), timeout=2).close()
    host_loopback = "reached"
except OSError:
    host_loopback = "unreachable"
before = sorted(os.listdir("/tmp"))
open("/tmp/" + socket.gethostname(), "w").close()
shm = os.statvfs("/dev/shm")
print(json.dumps({"hostname": socket.gethostname(), "address": probe.getsockname()[0],
                  "tmp": before, "shm": shm.f_blocks * shm.f_frsize,
                  "host_loopback": host_loopback}))
"""


def machine_pod(name: str, kubelet: TestKubelet, port: int, **spec: Any) -> Json:
    argv = [sys.executable, "-c", MACHINE, kubelet.host_ip, str(port)]
    return pod_manifest(name, argv, **spec)


def test_each_pod_has_its_own_address_hostname_loopback_tmp_and_dev_shm(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    with (
        tempfile.NamedTemporaryFile(dir="/tmp", prefix="kubetest-host-") as marker,
        socket.socket() as listener,  # on this machine's loopback, not a Pod's
    ):
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        core.create_namespaced_pod(namespace, machine_pod("plain", kubelet, port))
        shm_volume = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "100Mi"}}
        core.create_namespaced_pod(
            namespace,
            machine_pod(
                "roomy", kubelet, port, hostname="node-7", volumes=[shm_volume],
                container={"volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]},
            ),
        )  # fmt: skip
        pods = {name: finished(core, namespace, name) for name in ("plain", "roomy")}
    seen = {
        name: json.loads(kubelet.log_path(namespace, name).read_text().splitlines()[-1])
        for name in pods
    }
    for name, pod in pods.items():
        assert pod.status.phase == "Succeeded", kubelet.log_path(namespace, name).read_text()
        assert seen[name]["address"] == pod.status.pod_ip != "127.0.0.1"
        assert seen[name]["host_loopback"] == "unreachable"
        # Its own /tmp: neither this machine's nor the other Pod's.
        assert not {Path(marker.name).name, "plain", "node-7"} & set(seen[name]["tmp"])
    assert pods["plain"].status.pod_ip != pods["roomy"].status.pod_ip
    assert (seen["plain"]["hostname"], seen["roomy"]["hostname"]) == ("plain", "node-7")
    assert (seen["plain"]["shm"], seen["roomy"]["shm"]) == (64 * 2**20, 100 * 2**20)


ECHO = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
while True:
    conn, _ = server.accept()
    conn.sendall(socket.gethostname().encode())
    conn.close()
"""

DIAL = """
import socket, sys, time
deadline = time.monotonic() + 20
for target in sys.argv[2:]:
    while True:
        try:
            with socket.create_connection((target, int(sys.argv[1])), timeout=2) as conn:
                print(target, conn.recv(100).decode(), flush=True)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                print(target, "failed:", exc, flush=True)
                break
            time.sleep(0.2)
"""


def test_pods_reach_each_other_by_address_and_services_by_name(
    kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    core.create_namespaced_service(
        namespace,
        {"metadata": {"name": "echo"},
         "spec": {"clusterIP": "None", "selector": {"app": "echo"},
                  "ports": [{"port": 7000}]}},
    )  # fmt: skip
    server = pod_manifest(
        "echo-server", [sys.executable, "-c", ECHO, "7000"], hostname="srv", subdomain="echo"
    )
    server["metadata"]["labels"] = {"app": "echo"}
    core.create_namespaced_pod(namespace, server)
    started(core, kubelet, namespace, "echo-server")
    server_ip = core.read_namespaced_pod("echo-server", namespace).status.pod_ip
    names = ["echo", f"echo.{namespace}.svc", f"srv.echo.{namespace}.svc.cluster.local", server_ip]
    core.create_namespaced_pod(
        namespace, pod_manifest("dialer", [sys.executable, "-c", DIAL, "7000", *names])
    )

    assert finished(core, namespace, "dialer").status.phase == "Succeeded"
    lines = kubelet.log_path(namespace, "dialer").read_text().splitlines()
    assert lines == [f"{name} srv" for name in names]


def test_a_pod_reaches_the_apiserver_at_its_address_on_this_machine(
    kube_cluster: KubeCluster, kubelet: TestKubelet, namespace: str, core: Any
) -> None:
    work = str(kube_cluster.work_dir)  # the kubeconfig and its CA, under /tmp
    command = [str(kube_cluster.binaries.kubectl), f"--kubeconfig={kube_cluster.kubeconfig_path}",
               "get", "namespace", namespace, "-o", "name"]  # fmt: skip
    manifest = pod_manifest(
        "asks", command, volumes=[{"name": "control", "hostPath": {"path": work}}],
        container={"volumeMounts": [{"name": "control", "mountPath": work}]},
    )  # fmt: skip
    core.create_namespaced_pod(namespace, manifest)

    pod = finished(core, namespace, "asks")
    log = kubelet.log_path(namespace, "asks").read_text()
    assert (pod.status.phase, log) == ("Succeeded", f"namespace/{namespace}\n"), log


def test_a_pod_network_removes_what_a_killed_run_left_and_all_of_its_own() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names the leftovers of a run that is gone
    leftover_netns, leftover_link = f"kubetest-{dead.pid}-dead0-1", "ktbdead0"
    subprocess.run(["ip", "netns", "add", leftover_netns], check=True)
    subprocess.run(["ip", "link", "add", leftover_link, "type", "bridge"], check=True)
    subprocess.run(
        ["ip", "link", "set", leftover_link, "alias", f"kubetest:{dead.pid}"], check=True
    )

    network = PodNetwork().open()
    iface = network.attach()
    names = netns_and_links()
    assert leftover_netns not in names and leftover_link not in names
    assert {iface.netns, iface.host_link, network.bridge} <= names
    network.close()

    assert not {iface.netns, iface.host_link, network.bridge} & netns_and_links()


def netns_and_links() -> set[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    links = subprocess.run(["ip", "-json", "link"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in netns.stdout.splitlines() if line.strip()} | {
        link["ifname"] for link in json.loads(links.stdout)
    }


def test_a_pods_hosts_file_names_it_and_every_endpoint_short_only_in_its_namespace() -> None:
    pod = PodName("ns", "10.1.0.2", "node-0", "job-master")
    endpoints = [
        Endpoint("ns", "job-master", "10.1.0.3"),
        Endpoint("ns", "echo", "10.1.0.4", hostname="srv"),
        Endpoint("other", "db", "10.1.0.5"),
    ]

    lines = hosts_file(pod, endpoints).splitlines()

    assert "10.1.0.2\tnode-0.job-master.ns.svc.cluster.local\tnode-0" in lines
    assert (
        "10.1.0.3\tjob-master.ns.svc.cluster.local job-master.ns.svc job-master.ns job-master"
        in lines
    )
    assert "10.1.0.4\tsrv.echo.ns.svc.cluster.local srv.echo.ns.svc srv.echo" in lines
    assert "10.1.0.5\tdb.other.svc.cluster.local db.other.svc db.other" in lines


def test_a_hosts_file_is_rewritten_in_place_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    old = "10.0.0.1\ta-long-name-that-goes\n"
    write_in_place(path, old)
    inode = path.stat().st_ino

    write_in_place(path, "10.0.0.2\tb\n")

    assert path.stat().st_ino == inode  # a bind mount of it sees the change
    text = path.read_text()
    assert len(text) == len(old)  # never shorter: a reader never meets a cut line
    assert text.splitlines() == ["10.0.0.2\tb", "#" * (len(old) - len("10.0.0.2\tb\n") - 1)]

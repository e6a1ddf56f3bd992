"""A test kubelet: a Node for the real control plane of `kubetest.cluster`,
running each Pod bound to it as a local process (there is no container
runtime on the test machines).

What it does like a kubelet: registers its Node (Ready, 16 cpu / 64Gi / 110
pods) and keeps it Ready (Lease in kube-node-lease and node status, every
`heartbeat_s`); lists then watches the Pods bound to it, relisting after a
410 Gone or a broken connection, so no Pod is missed and Pods bound before it
started run too; runs the first container's command + args with its env and
volumes (see `kubetest.podspec` for the path convention); reports status
through the status subresource (Running, then Succeeded/Failed with
`state.terminated` {exitCode, reason Completed/Error/OOMKilled}, 128+signal
for a signal death); applies restartPolicy Never/OnFailure/Always (restart in
place, restartCount+1, after `restart_backoff_s`, reporting CrashLoopBackOff
meanwhile); on deletion sends SIGTERM to the process group, SIGKILL after the
grace period, then deletes the Pod with grace 0 and a uid precondition.

Each Pod is a machine of its own: its process runs in a network namespace
with an address of its own on the kubelet's Pod network (`kubetest.network`;
status.podIP, and the Node's InternalIP is the network's host address), with
the Pod's hostname, a private /tmp and a /dev/shm of its own
(`kubetest.sandbox`), and an /etc/hosts that names the Pod and every
Service's endpoints (`kubetest.names`, kept current). The apiserver is
reachable in each Pod where it is on this machine, 127.0.0.1:<port>
(`kubetest.relay`). The namespace lives as long as the Pod's runner: across
restarts in place, like a Pod sandbox.

What it does not: init containers and all but the first container are
ignored; images, probes, resource limits (recorded, see `resources()`, not
enforced) and securityContext are ignored; the process sees this machine's
filesystem (save /tmp and /dev/shm) and inherits the kubelet's environment
(less KUBECONFIG) plus the pod's env, KUBETEST_POD_DIR, HOSTNAME and
KUBERNETES_SERVICE_HOST/PORT.

Threads: one watch thread, one heartbeat thread, one runner thread per Pod
(it starts the process, so the process's parent-death signal fires when the
runner, hence the kubelet, goes away). State shared between them lives in
`_Run` objects guarded by `TestKubelet._lock`; API calls are made outside it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from dlfleet.api.processes import die_with_parent
from kubetest import sandbox, status
from kubetest.cluster import KUBE_VERSION
from kubetest.names import Endpoint, PodName, ServiceNames, hosts_file, write_in_place
from kubetest.network import NetworkError, PodInterface, PodNetwork
from kubetest.podspec import (
    Addresses,
    ContainerConfigError,
    Json,
    Launch,
    Sources,
    build_launch,
    decode_secret,
    first_container,
    inherited_env,
    pod_hostname,
)
from kubetest.relay import ApiRelay

LOG = logging.getLogger("kubetest.kubelet")

LOCAL_IP = "127.0.0.1"
NODE_CAPACITY: Mapping[str, str] = {
    "cpu": "16",
    "memory": "64Gi",
    "pods": "110",
    "ephemeral-storage": "100Gi",
}
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
WATCH_TIMEOUT_S = 60
CONFIG_RETRY_S = 1.0
API_RETRY_BUDGET_S = 30.0
MERGE_PATCH = "application/merge-patch+json"
# A Pod runs no image: the host's software is its image. The interpreter's
# prefix (the virtual environment) and the repository (whose folders an
# editable install imports from) stay visible inside every Pod, also when
# they lie under a directory the sandbox makes private (a checkout in /tmp).
IMAGE_PATHS = (Path(sys.prefix), Path(__file__).resolve().parents[2])
# Errors that mean "the apiserver is not reachable right now" (e.g. restarting).
NETWORK_ERRORS = (urllib3.exceptions.HTTPError, OSError)


class KubeletError(RuntimeError):
    """A test control was asked for something the kubelet cannot do."""


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str


@dataclass(frozen=True)
class ContainerResources:
    """The first container's `resources`, as requested (never enforced)."""

    requests: Mapping[str, str]
    limits: Mapping[str, str]


@dataclass(eq=False)
class _Run:
    """One Pod on this node, across restarts of its process."""

    uid: str
    ref: PodRef
    pod: Json
    pod_dir: Path
    log_path: Path
    start_time: str
    thread: threading.Thread | None = None
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restart_count: int = 0
    last_terminated: Json | None = None
    oom_killed: bool = False
    eviction_message: str | None = None
    deleting: bool = False  # the Pod has a deletionTimestamp
    kill_deadline: float | None = None  # monotonic time of the SIGKILL
    finished: bool = False  # the runner is done; no process will start
    deleted: bool = False  # the Pod object is gone
    iface: PodInterface | None = None  # its network namespace, while it has one
    pod_ip: str | None = None  # its address, kept after the namespace goes
    wake: threading.Event = field(default_factory=threading.Event)

    @property
    def hosts_path(self) -> Path:
        return self.pod_dir / "etc-hosts"

    def name(self, ip: str) -> PodName:
        subdomain = self.pod["spec"].get("subdomain") or ""
        return PodName(self.ref.namespace, ip, pod_hostname(self.pod), subdomain)


def _container_id(run: _Run) -> str:
    return f"kubetest://{run.uid}/{run.restart_count}"


def _signal_group(process: subprocess.Popen[bytes] | None, sig: int) -> None:
    if process is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)


class TestKubelet:
    """A kubelet for the Node `node_name`, talking to the apiserver with
    `kubeconfig` (which needs rights on nodes, leases, pods, pods/status,
    configmaps, secrets and endpoints: the admin's). Logs of a Pod's process
    go to `<work_dir>/<namespace>_<pod>.log`; its volumes to
    `<work_dir>/pods/`. Its Pods join `network` (shared by kubelets whose Pods
    must reach each other), else a network of its own, made at start and
    deleted at stop. Needs root (`kubetest.network`)."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        kubeconfig: Path | str,
        node_name: str,
        work_dir: Path,
        *,
        capacity: Mapping[str, str] = NODE_CAPACITY,
        labels: Mapping[str, str] | None = None,
        heartbeat_s: float = 5.0,
        restart_backoff_s: float = 1.0,
        delete_node_on_stop: bool = True,
        network: PodNetwork | None = None,
    ) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.node_name = node_name
        self.work_dir = Path(work_dir)
        self.capacity = dict(capacity)
        self.labels = dict(labels or {})
        self.heartbeat_s = heartbeat_s
        self.restart_backoff_s = restart_backoff_s
        self.delete_node_on_stop = delete_node_on_stop
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}  # by Pod uid
        self._resources: dict[PodRef, ContainerResources] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_response: urllib3.BaseHTTPResponse | None = None
        self._api: Any = None
        self._base_env: dict[str, str] = {}
        self._registered_at = status.now()
        self._network = network
        self._own_network = network is None
        self._relay: ApiRelay | None = None
        self._names: ServiceNames | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Register the Node, start the Pods already bound to it, then watch."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self._network is None:
            try:
                self._network = PodNetwork().open()
            except NetworkError as exc:
                raise KubeletError(f"{self.node_name}: no Pod network: {exc}") from None
        try:
            self._connect()
        except BaseException:
            if self._own_network:
                self._network.close()
            raise

    def _connect(self) -> None:
        """Register the Node, list the Pods bound to it, start the threads."""
        self._api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig), persist_config=False
        )
        self._api.configuration.connection_pool_maxsize = 32
        server = urllib.parse.urlsplit(self._api.configuration.host)
        api_host, api_port = server.hostname or LOCAL_IP, server.port or 443
        if _is_loopback(api_host):  # a Pod's loopback is its own: relay it there
            self._relay = ApiRelay(api_host, api_port)
        self._base_env = {
            **inherited_env(),
            "KUBERNETES_SERVICE_HOST": api_host,
            "KUBERNETES_SERVICE_PORT": str(api_port),
        }
        # Typed Any: bodies here are plain JSON dicts, which the client accepts
        # (it validates them into its models) but its annotations do not say
        # so; and `_preload_content=False` returns the raw HTTP response.
        self._core: Any = client.CoreV1Api(self._api)
        self._coordination: Any = client.CoordinationV1Api(self._api)
        self._names = ServiceNames(self._core, self._names_changed)
        self._register_node()
        self._names.start()
        resource_version = self._relist()
        for name, target, args in (
            ("heartbeat", self._heartbeat_loop, ()),
            ("watch", self._watch_loop, (resource_version,)),
        ):
            thread = threading.Thread(
                target=target, args=args, name=f"kubelet-{self.node_name}-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Kill every Pod's process (no status is reported for them), stop the
        threads and, by default, delete the Node. Idempotent."""
        if self._api is None or self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            runs = list(self._runs.values())
            for run in runs:
                _signal_group(run.process, signal.SIGKILL)
                run.wake.set()
            response = self._watch_response
        if response is not None:
            response.shutdown()  # wakes the watch thread blocked on a read
        deadline = time.monotonic() + timeout_s
        for thread in [*(run.thread for run in runs if run.thread), *self._threads]:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._names is not None:
            self._names.stop()
        for run in runs:
            self._release_sandbox(run)  # those whose runner did not end in time
        if self._relay is not None:
            self._relay.close_all()
        if self._own_network and self._network is not None:
            self._network.close()
        if self.delete_node_on_stop:
            with contextlib.suppress(ApiException, *NETWORK_ERRORS):
                self._core.delete_node(self.node_name, _request_timeout=10)
        self._api.close()

    def __enter__(self) -> TestKubelet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test controls -------------------------------------------------------

    @property
    def host_ip(self) -> str:
        """This machine's address on the Pod network (the Node's InternalIP):
        what a Pod dials to reach a process of the host."""
        if self._network is None:
            raise KubeletError(f"{self.node_name} is not started")
        return self._network.host_ip

    def pod_ip(self, namespace: str, pod: str) -> str | None:
        """The Pod's address (status.podIP), None before it has one."""
        with self._lock:
            run = self._find(namespace, pod)
            return run.pod_ip if run is not None else None

    def running(self) -> list[PodRef]:
        """The Pods whose process is alive now."""
        with self._lock:
            return [
                run.ref
                for run in self._runs.values()
                if run.process is not None and run.process.poll() is None
            ]

    def pid(self, namespace: str, pod: str) -> int | None:
        """The pid (and process group) of the Pod's process, None if not running."""
        with self._lock:
            run = self._find(namespace, pod)
            process = run.process if run else None
            return process.pid if process is not None and process.poll() is None else None

    def kill(self, namespace: str, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the Pod's process group; its status follows from the exit."""
        with self._lock:
            _signal_group(self._running(namespace, pod).process, sig)

    def oom_kill(self, namespace: str, pod: str) -> None:
        """SIGKILL the process, reported as OOMKilled (exit code 137)."""
        with self._lock:
            run = self._running(namespace, pod)
            run.oom_killed = True
            _signal_group(run.process, signal.SIGKILL)

    def evict(
        self, namespace: str, pod: str, message: str = "The node was low on resource: memory."
    ) -> None:
        """Kill the process and fail the Pod with reason Evicted, as a
        kubelet's eviction manager does (no restart, whatever the policy)."""
        with self._lock:
            run = self._find(namespace, pod)
            if run is None or run.finished:
                raise KubeletError(f"pod {namespace}/{pod} is not active on {self.node_name}")
            run.eviction_message = message
            _signal_group(run.process, signal.SIGKILL)
            run.wake.set()

    def resources(self, namespace: str, pod: str) -> ContainerResources:
        """The resources the Pod's first container asked for."""
        with self._lock:
            ref = PodRef(namespace, pod)
            if ref not in self._resources:
                raise KubeletError(f"pod {namespace}/{pod} was never seen on {self.node_name}")
            return self._resources[ref]

    def log_path(self, namespace: str, pod: str) -> Path:
        """Where the Pod's process writes stdout and stderr."""
        return self.work_dir / f"{namespace}_{pod}.log"

    def _find(self, namespace: str, pod: str) -> _Run | None:
        ref = PodRef(namespace, pod)
        matches = [run for run in self._runs.values() if run.ref == ref]
        return matches[-1] if matches else None

    def _running(self, namespace: str, pod: str) -> _Run:
        run = self._find(namespace, pod)
        if run is None or run.process is None or run.process.poll() is not None:
            raise KubeletError(f"pod {namespace}/{pod} has no running process on {self.node_name}")
        return run

    # -- node ----------------------------------------------------------------

    def _node_status(self) -> Json:
        return status.node_status(
            self.node_name, self.capacity, self._registered_at, KUBE_VERSION, self.host_ip
        )

    def _register_node(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **self.labels,
        }
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node_name, "labels": labels},
            "status": self._node_status(),
        }
        try:
            self._core.create_node(node)
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Registered by an earlier kubelet of this name: take it over.
            self._core.patch_node(
                self.node_name,
                {"metadata": {"labels": labels}, "spec": {"unschedulable": False, "taints": None}},
                _content_type=MERGE_PATCH,
            )
        self._heartbeat()

    def _heartbeat(self) -> None:
        """Renew the node's Lease and refresh its Ready condition."""
        spec = {
            "holderIdentity": self.node_name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": status.micro_now(),
        }
        try:
            self._coordination.patch_namespaced_lease(
                self.node_name, LEASE_NAMESPACE, {"spec": spec}, _content_type=MERGE_PATCH
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            node = self._core.read_node(self.node_name)
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name,
                     "uid": node.metadata.uid}  # fmt: skip
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node_name, "ownerReferences": [owner]},
                "spec": spec,
            }
            self._coordination.create_namespaced_lease(LEASE_NAMESPACE, lease)
        self._core.patch_node_status(
            self.node_name, {"status": self._node_status()}, _content_type=MERGE_PATCH
        )

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.heartbeat_s):
            try:
                self._heartbeat()
            except (ApiException, *NETWORK_ERRORS) as exc:
                LOG.warning("%s: heartbeat failed (retrying): %s", self.node_name, exc)

    # -- pods: list and watch ------------------------------------------------

    def _pod_selector(self) -> str:
        return f"spec.nodeName={self.node_name}"

    def _relist(self) -> str:
        """Observe every Pod bound here; forget the ones gone meanwhile.
        Returns the list's resourceVersion to watch from."""
        response = self._core.list_pod_for_all_namespaces(
            field_selector=self._pod_selector(), _preload_content=False, _request_timeout=30
        )
        pods = json.loads(response.data)
        present = set()
        for pod in pods["items"]:
            present.add(pod["metadata"]["uid"])
            self._observe(pod)
        with self._lock:
            gone = [run for uid, run in self._runs.items() if uid not in present]
        for run in gone:
            self._forget(run.pod)
        version: str = pods["metadata"]["resourceVersion"]
        return version

    def _watch_loop(self, resource_version: str | None) -> None:
        while not self._stopping.is_set():
            try:
                if resource_version is None:
                    resource_version = self._relist()
                resource_version = self._watch(resource_version)
            except ApiException as exc:
                if exc.status != 410:
                    LOG.warning("%s: pod watch failed: %s", self.node_name, exc)
                resource_version = None  # relist: 410 Gone, or events possibly missed
            except NETWORK_ERRORS as exc:
                if not self._stopping.is_set():
                    LOG.warning("%s: pod watch broken (relisting): %s", self.node_name, exc)
                    self._stopping.wait(0.5)
                resource_version = None

    def _watch(self, resource_version: str) -> str:
        """Follow Pod events from `resource_version` until the server ends the
        watch; returns the last resourceVersion seen."""
        response = self._core.list_pod_for_all_namespaces(
            field_selector=self._pod_selector(),
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _preload_content=False,
            _request_timeout=(10, WATCH_TIMEOUT_S + 15),
        )
        with self._lock:
            self._watch_response = response
            if self._stopping.is_set():  # stop() came before the response
                response.shutdown()
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if self._stopping.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                resource_version = obj["metadata"]["resourceVersion"]
                if kind == "DELETED":
                    self._forget(obj)
                elif kind in ("ADDED", "MODIFIED"):
                    self._observe(obj)
        finally:
            with self._lock:
                self._watch_response = None
            response.release_conn()
        return resource_version

    def _observe(self, pod: Json) -> None:
        """Act on the latest state of a Pod bound here."""
        uid = pod["metadata"]["uid"]
        with self._lock:
            if self._stopping.is_set():
                return
            run = self._runs.get(uid)
            if run is None:
                run = self._admit(pod)
            run.pod = pod
            deletion = pod["metadata"].get("deletionTimestamp")
            if deletion and not run.deleting:
                run.deleting = True
                grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
                run.kill_deadline = time.monotonic() + grace
                _signal_group(run.process, signal.SIGTERM)
                run.wake.set()
            finish = run.deleting and run.finished and not run.deleted
        if finish:
            self._finish_deletion(run)

    def _admit(self, pod: Json) -> _Run:
        """Track a Pod seen for the first time; start it unless already over.
        Called with the lock held."""
        meta = pod["metadata"]
        ref = PodRef(meta["namespace"], meta["name"])
        resources = first_container(pod).get("resources") or {}
        self._resources[ref] = ContainerResources(
            requests=dict(resources.get("requests") or {}),
            limits=dict(resources.get("limits") or {}),
        )
        run = _Run(
            uid=meta["uid"],
            ref=ref,
            pod=pod,
            pod_dir=self.work_dir / "pods" / f"{ref.namespace}_{ref.name}_{meta['uid'][:8]}",
            log_path=self.log_path(ref.namespace, ref.name),
            start_time=(pod.get("status") or {}).get("startTime") or status.now(),
        )
        self._runs[run.uid] = run
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            run.finished = True  # ran before this kubelet started
            return run
        run.thread = threading.Thread(
            target=self._run_pod, args=(run,), name=f"kubelet-pod-{ref.name}", daemon=True
        )
        run.thread.start()
        return run

    def _forget(self, pod: Json) -> None:
        """The Pod object is gone: kill its process, report nothing more."""
        with self._lock:
            run = self._runs.pop(pod["metadata"]["uid"], None)
            if run is None:
                return
            run.deleting = run.deleted = True
            _signal_group(run.process, signal.SIGKILL)
            run.wake.set()

    def _finish_deletion(self, run: _Run) -> None:
        """Delete the Pod for good once its process is gone (grace 0, same uid)."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": run.uid}}
        try:
            self._core.delete_namespaced_pod(
                run.ref.name, run.ref.namespace, body=body, grace_period_seconds=0
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or a new Pod of that name
                LOG.warning("%s: deleting %s failed: %s", self.node_name, run.ref, exc)
                return  # retried at the next event or relist
        except NETWORK_ERRORS as exc:
            LOG.warning("%s: deleting %s failed: %s", self.node_name, run.ref, exc)
            return
        with self._lock:
            run.deleted = True
            self._runs.pop(run.uid, None)

    # -- pods: running -------------------------------------------------------

    def _run_pod(self, run: _Run) -> None:
        """The runner thread of one Pod."""
        try:
            self._run_until_done(run)
        finally:
            self._release_sandbox(run)
            with self._lock:
                run.finished = True
                run.process = None
                finish = run.deleting and not run.deleted and not self._stopping.is_set()
            if finish:
                self._finish_deletion(run)

    def _make_sandbox(self, run: _Run) -> PodInterface:
        """The Pod's network namespace, its /etc/hosts and its apiserver relay."""
        assert self._network is not None and self._names is not None
        iface = self._network.attach()
        with self._lock:
            run.iface, run.pod_ip = iface, iface.ip
        run.pod_dir.mkdir(parents=True, exist_ok=True)
        write_in_place(run.hosts_path, hosts_file(run.name(iface.ip), self._names.current()))
        if self._relay is not None:
            self._relay.serve(iface.netns_path)
        return iface

    def _release_sandbox(self, run: _Run) -> None:
        with self._lock:
            iface, run.iface = run.iface, None
        if iface is None:
            return
        if self._relay is not None:
            self._relay.close(iface.netns_path)
        assert self._network is not None
        self._network.detach(iface)

    def _names_changed(self, endpoints: frozenset[Endpoint]) -> None:
        """Rewrite every Pod's /etc/hosts (from the names thread)."""
        with self._lock:
            pods = [(run, run.iface) for run in self._runs.values() if run.iface is not None]
        for run, iface in pods:
            with contextlib.suppress(FileNotFoundError):
                write_in_place(run.hosts_path, hosts_file(run.name(iface.ip), endpoints))

    def _run_until_done(self, run: _Run) -> None:
        while True:
            with self._lock:
                if self._stopping.is_set() or run.deleting:
                    return
                eviction = run.eviction_message
            if eviction is not None:
                last = {"terminated": run.last_terminated} if run.last_terminated else None
                self._report(run, self._status(run, "Failed", last, eviction=eviction))
                return
            try:
                iface = run.iface or self._make_sandbox(run)
            except NetworkError as exc:
                message = f"creating the Pod's sandbox: {exc}"
                waiting = {"waiting": {"reason": "ContainerCreating", "message": message}}
                self._report(run, self._status(run, "Pending", waiting))
                self._pause(run, CONFIG_RETRY_S)
                continue
            addresses = Addresses(pod_ip=iface.ip, host_ip=self.host_ip)
            try:
                launch = build_launch(
                    run.pod, run.pod_dir, self._sources(), self._base_env, addresses
                )
            except ContainerConfigError as exc:
                waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self._report(run, self._status(run, "Pending", waiting))
                self._pause(run, CONFIG_RETRY_S)
                continue
            code = self._run_process(run, iface, launch)
            if code is None:
                return
            with self._lock:
                oom_killed, run.oom_killed = run.oom_killed, False
                if self._stopping.is_set():
                    return
                eviction, deleting = run.eviction_message, run.deleting
            terminated = status.terminated(code, oom_killed, run.started_at, _container_id(run))
            policy = run.pod["spec"].get("restartPolicy", "Always")
            phase = status.phase_after_exit(policy, code)
            if eviction is not None:
                phase = "Failed"
            state = {"terminated": terminated}
            if eviction is not None or deleting or phase != "Running":
                self._report(run, self._status(run, phase, state, eviction=eviction))
                return
            run.last_terminated = terminated
            run.restart_count += 1
            message = f"back-off {self.restart_backoff_s:g}s restarting failed container"
            waiting = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
            self._report(run, self._status(run, "Running", waiting))
            self._pause(run, self.restart_backoff_s)

    def _pause(self, run: _Run, seconds: float) -> None:
        run.wake.wait(seconds)
        run.wake.clear()

    def _status(
        self,
        run: _Run,
        phase: str,
        state: Json | None,
        ready: bool = False,
        eviction: str | None = None,
    ) -> Json:
        container = status.ContainerRun(
            container=first_container(run.pod),
            container_id=_container_id(run),
            restart_count=run.restart_count,
            state=state,
            last_terminated=run.last_terminated,
        )
        return status.pod_status(
            phase, run.start_time, container, pod_ip=run.pod_ip, host_ip=self.host_ip,
            ready=ready, eviction=eviction,
        )  # fmt: skip

    def _run_process(self, run: _Run, iface: PodInterface, launch: Launch) -> int | None:
        """Start the process, report it Running, wait for its end. Returns its
        exit code, or None when it was not started (deleted, evicted, stopping)."""
        box = sandbox.Sandbox(
            netns=str(iface.netns_path),
            hostname=pod_hostname(run.pod),
            hosts_file=str(run.hosts_path),
            cwd=str(launch.cwd),
            shm_bytes=launch.shm_bytes,
            host_paths=tuple(str(path) for path in (*launch.host_paths, *IMAGE_PATHS)),
        )
        run.log_path.parent.mkdir(parents=True, exist_ok=True)
        with run.log_path.open("ab") as log, self._lock:
            if self._stopping.is_set() or run.deleting or run.eviction_message is not None:
                return None
            run.started_at = status.now()
            try:
                run.process = subprocess.Popen(
                    die_with_parent(sandbox.command(box, launch.argv)),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=launch.env,
                    cwd=launch.cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                log.write(f"kubetest: cannot start {launch.argv}: {exc}\n".encode())
                return 128  # what containerd reports for a StartError
            process = run.process
        running = {"running": {"startedAt": run.started_at}}
        self._report(run, self._status(run, "Running", running, ready=True))
        while True:
            with self._lock:
                deadline = run.kill_deadline
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            try:
                process.wait(timeout=max(timeout, 0.0))
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    _signal_group(process, signal.SIGKILL)
        with self._lock:
            # What the main process leaves behind dies with it, as a
            # container's processes do when its PID namespace ends.
            _signal_group(process, signal.SIGKILL)
            run.process = None
        return status.exit_code(process.returncode)

    def _report(self, run: _Run, pod_status: Json) -> None:
        """Patch the Pod's status, retrying while the apiserver is unreachable
        (at most API_RETRY_BUDGET_S). The uid in the patch makes it fail,
        rather than touch a new Pod of the same name."""
        body = {"metadata": {"uid": run.uid}, "status": pod_status}
        deadline = time.monotonic() + API_RETRY_BUDGET_S
        while not self._stopping.is_set():
            try:
                self._core.patch_namespaced_pod_status(
                    run.ref.name, run.ref.namespace, body, _content_type=MERGE_PATCH
                )
                return
            except ApiException as exc:
                if exc.status in (404, 422):  # gone, or replaced by a Pod of that name
                    return
                error: Exception = exc
            except NETWORK_ERRORS as exc:
                error = exc
            if time.monotonic() >= deadline:
                LOG.error("%s: status of %s lost: %s", self.node_name, run.ref, error)
                return
            self._stopping.wait(0.5)

    def _sources(self) -> Sources:
        return Sources(config_map=self._read_config_map, secret=self._read_secret)

    def _read_config_map(self, namespace: str, name: str) -> Mapping[str, str] | None:
        config_map = self._read(self._core.read_namespaced_config_map, namespace, name)
        return None if config_map is None else dict(config_map.data or {})

    def _read_secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        secret = self._read(self._core.read_namespaced_secret, namespace, name)
        return None if secret is None else decode_secret(secret.data)

    def _read(self, read: Callable[..., Any], namespace: str, name: str) -> Any:
        try:
            return read(name, namespace, _request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise ContainerConfigError(f"reading {namespace}/{name}: {exc.reason}") from exc
        except NETWORK_ERRORS as exc:
            raise ContainerConfigError(f"reading {namespace}/{name}: {exc}") from exc


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

"""The `kubernetes` platform: one Pod per node, through the official client.

The runner (in the master's own Pod, usually a Kubernetes Job from deploy/)
asks for nodes; this platform makes them Pods and reads back what happened:

- Pods are named `<job>-node-<index>-<attempt>` and labelled with the job, the
  node index and the attempt; a relaunch is a new Pod with the same index (the
  agent registers as `node-<index>` either way). They are owned by the master's
  Job when the master runs in a Pod (found through $POD_NAME), else by the
  job's headless Service, so deleting the job deletes its Pods.
- A headless Service `<job>-master` selects the master Pod: workers dial
  `<service>.<namespace>.svc:<port>` (or `master_address`), and publish
  their Pod IP to each other (`PET_LOCAL_ADDR` from the downward API). Each
  mounts a memory-backed emptyDir of `shm_size` at /dev/shm, where in-memory
  checkpoint images live (a container's own is 64Mi). The token reaches
  them from a Secret (the user's `token_secret`, or `<job>-dlfleet` made here).
  Where job.yaml's `http` listens beyond the Pod's loopback, the Service also
  carries the HTTP port and `prometheus.io/{scrape,port,path,scheme}`
  annotations, so that a Prometheus that discovers Services scrapes /metrics.
- A watch thread keeps the latest copy of every Pod of the job. It resumes
  from the last resourceVersion after a watch ends, and lists afresh when that
  version is too old (410 Gone) or the API server was away: the Pods missing
  from a fresh list were deleted. The platform reads states, not events, and
  a terminal Pod stays until it is replaced, so no ending is ever missed.
- Phases and container states become node exits: Succeeded (0), Failed with
  the container's exit code, OOMKilled, Evicted, or deleted by someone else
  (preemption). A Pod that stays Pending (unschedulable, image not pulled) is
  shown with its reason, and fails the job after `pending_timeout_s` when
  fewer than `nodes.min` nodes can run.
- A runner started again (the master Pod restarted) adopts the Pods it finds
  instead of starting new ones: they outlive the runner.
- Every action is also a Kubernetes Event on the Pod (`kubectl describe`).

The calls it makes (pods: get, list, watch, create, delete; services: get,
create, delete; secrets: get, create, update, delete; events: create) are the
Role in deploy/.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config_module
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from dlfleet.api.env import LOCAL_ADDR_ENV, TOKEN_ENV
from dlfleet.api.errors import DlfleetError
from dlfleet.master.job.jobconfig import (
    JobConfig,
    KubernetesConfig,
    format_bytes_quantity,
    parse_quantity,
)
from dlfleet.master.job.platform import (
    REASON_DELETED,
    REASON_EVICTED,
    REASON_OOM,
    Node,
    NodeExit,
    NodeState,
    Platform,
)
from dlfleet.master.job.platform.launch import node_launch

_log = logging.getLogger(__name__)

LABEL_JOB = "dlfleet.io/job"
LABEL_ROLE = "dlfleet.io/role"
LABEL_INDEX = "dlfleet.io/node-index"
LABEL_ATTEMPT = "dlfleet.io/attempt"
CONTAINER = "worker"
# dlworker's --local-addr, as torchrun names it: the address a node publishes
# to the others (its store, its keeper, its workers' collectives).
SHM_VOLUME = "dlfleet-shm"
SHM_PATH = "/dev/shm"
CA_PATH = "/etc/dlfleet/tls/ca.crt"  # in a worker Pod, from the job's Secret
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
CALL_TIMEOUT_S = 10.0
WATCH_TIMEOUT_S = 30  # the server ends each watch after this; we resume it
UNSEEN_GRACE_S = 10.0  # a created Pod not seen by the watch this long is looked up
RETRY_LAUNCH_S = 2.0
_TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError)

Pod = dict[str, Any]
# The client takes plain dicts for bodies and returns raw responses with
# `_preload_content=False`, which its type hints do not say: the API objects
# are used as `Any`, and the Pods this module reads are JSON dicts.
k8s_config: Any = k8s_config_module


def api_client(config: KubernetesConfig, base_dir: Path) -> Any:
    """A client from the job's kubeconfig, else as `connect` finds one."""
    if config.kubeconfig is not None:
        path = (
            config.kubeconfig if config.kubeconfig.is_absolute() else base_dir / config.kubeconfig
        )
        return connect(str(path))
    return connect(None)


def connect(kubeconfig: str | None) -> Any:
    """A client from `kubeconfig`, else from $KUBECONFIG when it is set, else
    in-cluster (in a Pod), else from ~/.kube/config. `DlfleetError` says
    which of them failed and why."""
    try:
        kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
        if kubeconfig is not None:
            return k8s_config.new_client_from_config(config_file=kubeconfig)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            configuration = k8s.Configuration()
            try:
                k8s_config.load_incluster_config(client_configuration=configuration)
            except k8s_config.ConfigException as exc:
                raise DlfleetError(
                    f"cannot reach the Kubernetes API with the Pod's own credentials: {exc} "
                    "(does its service account mount its token? else name a kubeconfig: "
                    "kubernetes.kubeconfig in job.yaml, or $KUBECONFIG)"
                ) from None
            return k8s.ApiClient(configuration)
        return k8s_config.new_client_from_config()
    except (k8s_config.ConfigException, OSError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise DlfleetError(f"cannot reach the Kubernetes API: kubeconfig {where}: {exc}") from None


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodWatch:
    """The latest copy of every Pod matching a label selector, kept by one
    thread with list + watch, resumed after expiry and API server restarts."""

    def __init__(self, core: Any, namespace: str, selector: str) -> None:
        self.core = core
        self.namespace = namespace
        self.selector = selector
        self.synced = threading.Event()
        self.relists = 0
        self._pods: dict[str, Pod] = {}
        self._gone: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def get(self, name: str) -> Pod | None:
        with self._lock:
            return self._pods.get(name)

    def gone(self, name: str) -> bool:
        with self._lock:
            return name in self._gone

    def pods(self) -> list[Pod]:
        with self._lock:
            return list(self._pods.values())

    def _run(self) -> None:
        version: str | None = None
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
                backoff = 0.2
            except ApiException as exc:
                if exc.status == 410:  # too old: list afresh
                    version = None
                    continue
                _log.warning("watching pods: %s %s; retrying", exc.status, exc.reason)
            except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                _log.warning("watching pods: %s; retrying", exc)
                version = None  # the API server was away: events may be lost, list
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _list(self) -> str:
        response = self.core.list_namespaced_pod(
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=CALL_TIMEOUT_S,
        )
        listing = json.loads(response.data)
        pods = {pod["metadata"]["name"]: pod for pod in listing.get("items", [])}
        with self._lock:
            self._gone |= set(self._pods) - set(pods)
            self._gone -= set(pods)
            self._pods = pods
        self.relists += 1
        self.synced.set()
        return str(listing["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        response = self.core.list_namespaced_pod(
            self.namespace,
            label_selector=self.selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _preload_content=False,
            _request_timeout=(CALL_TIMEOUT_S, WATCH_TIMEOUT_S + 15),
        )
        try:
            for line in _lines(response):
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = obj["metadata"]["resourceVersion"]
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                with self._lock:
                    if kind == "DELETED":
                        self._pods.pop(name, None)
                        self._gone.add(name)
                    else:
                        self._pods[name] = obj
                        self._gone.discard(name)
        finally:
            response.release_conn()
        return version


@dataclass
class KubeNode(Node):
    pod: str = ""  # its current Pod's name; "" until the first launch
    launched_at: float = 0.0  # monotonic
    pending_since: float | None = None
    looked_up: bool = False  # a Pod the watch has not shown was looked up

    @property
    def launched(self) -> bool:
        return bool(self.pod)


def master_service(
    config: JobConfig, name: str, namespace: str, master_port: int, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """The headless Service of the master Pod: gRPC for the workers, and
    where job.yaml has a reachable `http` endpoint, its port and the
    `prometheus.io/*` annotations a Prometheus discovers scrape targets by
    (`kubernetes_sd_configs` role endpoints or service)."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {LABEL_JOB: config.name, "app.kubernetes.io/name": "dlfleet"},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    ports: list[dict[str, Any]] = [{"name": "grpc", "port": master_port}]
    if config.http is not None and config.http.beyond_loopback():
        port = config.http.port
        ports.append({"name": "http", "port": port})
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
            "prometheus.io/scheme": "https" if config.tls is not None else "http",
        }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: config.name, LABEL_ROLE: "master"},
            "ports": ports,
            "publishNotReadyAddresses": True,
        },
    }


class KubernetesPlatform(Platform[KubeNode]):
    outlives_runner = True

    def __init__(
        self,
        config: JobConfig,
        *,
        master_port: int,
        token: str,
        client: Any = None,
    ) -> None:
        assert config.kubernetes is not None
        self.config = config
        self.kube = config.kubernetes
        self.token = token
        self.master_port = master_port
        self.api = client or api_client(self.kube, config.base_dir)
        self.core: Any = k8s.CoreV1Api(self.api)
        self.namespace = self.kube.namespace or _own_namespace()
        self.service = self.kube.master_service or f"{config.name}-master"
        self.secret = (
            self.kube.token_secret.name if self.kube.token_secret else f"{config.name}-dlfleet"
        )
        self.secret_key = self.kube.token_secret.key if self.kube.token_secret else "token"
        self.nodes: list[KubeNode] = []
        self.log_dir = config.work_dir / "logs"
        self.watch = PodWatch(
            self.core, self.namespace, f"{LABEL_JOB}={config.name},{LABEL_ROLE}=worker"
        )
        self._owner: dict[str, Any] | None = None
        self._fatal: str | None = None

    # ---------------------------------------------------------------- intent

    def start(self, count: int) -> None:
        """Set up the Service and the Secret, adopt the Pods an earlier
        runner left, and start nodes up to `count`."""
        self._owner = self._find_owner()
        self._ensure_service()
        if self.kube.token_secret is None:
            self._ensure_secret()
        self.watch.start()
        if not self.watch.synced.wait(60.0):
            raise DlfleetError(
                f"could not list the pods of job {self.config.name} in namespace "
                f"{self.namespace} within 60s (is the API server reachable?)"
            )
        self._adopt()
        for _ in range(count - len(self.active)):
            self.add_node()

    def add_node(self, delay_s: float = 0.0) -> KubeNode:
        index = max((node.index for node in self.nodes), default=-1) + 1
        node = KubeNode(name=f"node-{index}", index=index, memory_bytes=self.kube.memory_bytes)
        self.nodes.append(node)
        node.start_at = time.monotonic() + delay_s
        if delay_s <= 0:
            self._launch(node)
        return node

    def relaunch(self, node: KubeNode, delay_s: float, memory_bytes: int | None = None) -> None:
        node.relaunches += 1
        node.state = NodeState.STARTING
        node.exit_code = None
        node.detail = ""
        node.pending_since = None
        if memory_bytes is not None:
            node.memory_bytes = memory_bytes
        self._delete_pod(node.pod, grace_s=0)  # the ended one: its replacement takes over
        node.pod = ""
        node.start_at = time.monotonic() + delay_s
        self._event(
            node, "NodeRelaunch", f"relaunching {node.name} (attempt {node.relaunches})"
            + (f" with memory {format_bytes_quantity(memory_bytes)}" if memory_bytes else ""),
        )  # fmt: skip

    def stop_node(self, node: KubeNode) -> None:
        if not node.launched:
            node.state = NodeState.STOPPED
            return
        node.state = NodeState.STOPPING
        self._delete_pod(node.pod, grace_s=self.kube.termination_grace_s)

    def log_hint(self, node: KubeNode) -> str:
        pod = node.pod or f"{self.config.name}-{node.name}-*"
        return f"see kubectl logs -n {self.namespace} {pod}"

    # ---------------------------------------------------------------- watch

    def poll(self) -> list[NodeExit]:
        exits: list[NodeExit] = []
        now = time.monotonic()
        for node in self.nodes:
            if node.state is NodeState.STARTING and not node.launched and now >= node.start_at:
                self._launch(node)
            if not node.launched or node.exit_code is not None:
                continue
            ended = self._observe(node, now)
            if ended is not None:
                code, reason = ended
                node.exit_code = code
                node.detail = ""
                exits.append(NodeExit(node, code, reason))
                self._event(node, "NodeEnded", f"{node.name} ({node.pod}) ended: {code} {reason}")
        return exits

    def problem(self) -> str | None:
        if self._fatal is not None:
            return self._fatal
        now = time.monotonic()
        stuck = [
            node
            for node in self.nodes
            if node.state is NodeState.STARTING
            and node.pending_since is not None
            and now - node.pending_since > self.kube.pending_timeout_s
        ]
        if not stuck:
            return None
        can_run = sum(
            1 for node in self.nodes if node.state in (NodeState.STARTING, NodeState.RUNNING)
        ) - len(stuck)
        if can_run >= self.config.nodes.min:
            return None
        waited = ", ".join(f"{node.pod}: {node.detail}" for node in stuck)
        return (
            f"only {can_run} nodes can run, fewer than nodes.min={self.config.nodes.min}: "
            f"pods pending for more than {self.kube.pending_timeout_s:g}s ({waited})"
        )

    def shutdown(self, grace_s: float) -> None:
        """Delete every Pod of the job (SIGTERM, then SIGKILL after `grace_s`
        by the kubelet), wait for them to go, then the Secret and Service."""
        names = {node.pod for node in self.nodes if node.pod}
        names |= {pod["metadata"]["name"] for pod in self.watch.pods()}
        for name in names:
            self._delete_pod(name, grace_s=int(grace_s))
        deadline = time.monotonic() + grace_s + 15.0
        while time.monotonic() < deadline and any(self.watch.get(name) for name in names):
            time.sleep(0.2)
        self.watch.stop()
        if self.kube.token_secret is None:
            self._call(self.core.delete_namespaced_secret, self.secret, self.namespace)
        self._call(self.core.delete_namespaced_service, self.service, self.namespace)

    # ------------------------------------------------------------- helpers

    def _observe(self, node: KubeNode, now: float) -> tuple[int, str] | None:
        """(exit code, reason) once the node's Pod has ended, else None."""
        pod = self.watch.get(node.pod)
        if pod is None:
            if self.watch.gone(node.pod):
                return (143, "") if node.state is NodeState.STOPPING else (143, REASON_DELETED)
            if now - node.launched_at > UNSEEN_GRACE_S and not node.looked_up:
                node.looked_up = True  # created but never seen: did it go before?
                try:
                    self.core.read_namespaced_pod(
                        node.pod, self.namespace, _request_timeout=CALL_TIMEOUT_S
                    )
                except ApiException as exc:
                    if exc.status == 404:
                        return 143, REASON_DELETED
                except _TRANSIENT:
                    node.looked_up = False
            return None
        status = pod.get("status") or {}
        phase = status.get("phase", "Pending")
        if phase == "Succeeded":
            return 0, ""
        if phase == "Failed":
            code, reason = _failure(pod)
            deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
            if not reason and deleting and node.state is not NodeState.STOPPING:
                # Its container ended on the SIGTERM of a deletion we did not
                # ask for; that status can arrive before the Pod is gone.
                reason = REASON_DELETED
            return code, reason
        if phase == "Running":
            if node.state is NodeState.STARTING:
                node.state = NodeState.RUNNING
            node.pending_since = None
            node.detail = ""
            return None
        if node.pending_since is None:
            node.pending_since = now
        node.detail = _pending_reason(pod)
        return None

    def _launch(self, node: KubeNode) -> None:
        attempt = node.relaunches
        name = f"{self.config.name}-{node.name}-{attempt}"
        body = self._pod(node, name, attempt)
        try:
            self.core.create_namespaced_pod(self.namespace, body, _request_timeout=CALL_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 409:  # made by an earlier runner that died before seeing it
                _log.info("pod %s exists already: adopting it", name)
            elif exc.status in (400, 403, 422):
                self._fatal = f"cannot create pod {name}: {_api_message(exc)}"
                node.state = NodeState.FAILED
                return
            else:
                _log.warning("creating pod %s: %s; retrying", name, _api_message(exc))
                node.start_at = time.monotonic() + RETRY_LAUNCH_S
                return
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            _log.warning("creating pod %s: %s; retrying", name, exc)
            node.start_at = time.monotonic() + RETRY_LAUNCH_S
            return
        node.pod = name
        node.launched_at = time.monotonic()
        node.looked_up = False
        node.state = NodeState.STARTING
        _log.info("created pod %s for %s", name, node.name)

    def _pod(self, node: KubeNode, name: str, attempt: int) -> dict[str, Any]:
        config, kube = self.config, self.kube
        master = kube.master_address or (f"{self.service}.{self.namespace}.svc:{self.master_port}")
        # The CA comes from the job's Secret, where the master put it.
        tls = config.tls is not None and kube.token_secret is None
        launch = node_launch(
            config,
            node.name,
            program=kube.worker_command,
            master=master,
            ca_file=CA_PATH if tls else None,
        )
        env: list[dict[str, Any]] = [
            {"name": key, "value": value} for key, value in config.env.items()
        ]
        env += copy.deepcopy(kube.env)
        env += [
            {
                "name": TOKEN_ENV,
                "valueFrom": {"secretKeyRef": {"name": self.secret, "key": self.secret_key}},
            },
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            # The Pod's own IP: what the other nodes reach it at.
            {"name": LOCAL_ADDR_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ]
        env += [{"name": key, "value": value} for key, value in launch.env.items()]
        mounts = copy.deepcopy(kube.volume_mounts)
        volumes = copy.deepcopy(kube.volumes)
        if not any(mount.get("mountPath", "").rstrip("/") == SHM_PATH for mount in mounts):
            # A container's /dev/shm is 64Mi: too small for checkpoint images.
            volumes.append(
                {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": kube.shm_size}}
            )
            mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
        if tls:
            volumes.append(
                {"name": "dlfleet-tls", "secret": {"secretName": self.secret,
                                                   "items": [{"key": "ca.crt", "path": "ca.crt"}]}}
            )  # fmt: skip
            mounts.append(
                {"name": "dlfleet-tls", "mountPath": str(Path(CA_PATH).parent), "readOnly": True}
            )
        container: dict[str, Any] = {
            "name": CONTAINER,
            "image": kube.image,
            "imagePullPolicy": kube.image_pull_policy,
            "command": launch.argv,
            "env": env,
            "resources": self._resources(node),
            "volumeMounts": mounts,
        }
        if kube.working_dir:
            container["workingDir"] = kube.working_dir
        labels = {
            **kube.labels,
            "app.kubernetes.io/name": "dlfleet",
            "app.kubernetes.io/component": "worker",
            LABEL_JOB: config.name,
            LABEL_ROLE: "worker",
            LABEL_INDEX: str(node.index),
            LABEL_ATTEMPT: str(attempt),
        }
        spec: dict[str, Any] = {
            "restartPolicy": "Never",  # the agent restarts workers; the master, nodes
            "containers": [container],
            "volumes": volumes,
            "terminationGracePeriodSeconds": kube.termination_grace_s,
            "hostname": node.name,
            "subdomain": self.service,
        }
        if kube.node_selector:
            spec["nodeSelector"] = dict(kube.node_selector)
        if kube.tolerations:
            spec["tolerations"] = copy.deepcopy(kube.tolerations)
        if kube.priority_class:
            spec["priorityClassName"] = kube.priority_class
        if kube.scheduler_name:
            spec["schedulerName"] = kube.scheduler_name
        if kube.service_account:
            spec["serviceAccountName"] = kube.service_account
        if kube.image_pull_secrets:
            spec["imagePullSecrets"] = [{"name": name} for name in kube.image_pull_secrets]
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "labels": labels,
            "annotations": dict(kube.annotations),
        }
        if self._owner is not None:
            metadata["ownerReferences"] = [self._owner]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}

    def _resources(self, node: KubeNode) -> dict[str, dict[str, str]]:
        resources = copy.deepcopy(self.kube.resources)
        configured = self.kube.memory_bytes
        if node.memory_bytes is not None and node.memory_bytes != configured:  # OOM-killed
            memory = format_bytes_quantity(node.memory_bytes)
            resources.setdefault("limits", {})["memory"] = memory
            resources.setdefault("requests", {})["memory"] = memory
        return resources

    def _adopt(self) -> None:
        """Take over the Pods of an earlier runner: per node index, the
        latest attempt is the node; older ones are deleted."""
        latest: dict[int, Pod] = {}
        for pod in self.watch.pods():
            labels = pod["metadata"].get("labels") or {}
            try:
                index, attempt = int(labels[LABEL_INDEX]), int(labels[LABEL_ATTEMPT])
            except (KeyError, ValueError):
                continue
            known = latest.get(index)
            if known is None or attempt > int(known["metadata"]["labels"][LABEL_ATTEMPT]):
                if known is not None:
                    self._delete_pod(known["metadata"]["name"], grace_s=0)
                latest[index] = pod
            else:
                self._delete_pod(pod["metadata"]["name"], grace_s=0)
        for index, pod in sorted(latest.items()):
            attempt = int(pod["metadata"]["labels"][LABEL_ATTEMPT])
            node = KubeNode(
                name=f"node-{index}",
                index=index,
                relaunches=attempt,
                pod=pod["metadata"]["name"],
                launched_at=time.monotonic(),
                memory_bytes=_pod_memory(pod) or self.kube.memory_bytes,
            )
            if (pod.get("status") or {}).get("phase") == "Running":
                node.state = NodeState.RUNNING
            if pod["metadata"].get("deletionTimestamp"):
                node.state = NodeState.STOPPING
            self.nodes.append(node)
            _log.info("adopted pod %s as %s", node.pod, node.name)

    def _find_owner(self) -> dict[str, Any] | None:
        """The master's Job, when the master runs in a Pod that one owns."""
        pod_name = os.environ.get("POD_NAME")
        if not pod_name:
            return None
        try:
            pod = self.core.read_namespaced_pod(
                pod_name, self.namespace, _request_timeout=CALL_TIMEOUT_S
            )
        except ApiException as exc:
            _log.warning("cannot read the master's own pod %s: %s", pod_name, _api_message(exc))
            return None
        for ref in pod.metadata.owner_references or []:
            if ref.controller:
                return {"apiVersion": ref.api_version, "kind": ref.kind,
                        "name": ref.name, "uid": ref.uid}  # fmt: skip
        return {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod.metadata.uid}

    def _ensure_service(self) -> None:
        body = master_service(
            self.config, self.service, self.namespace, self.master_port, self._owner
        )
        try:
            created = self.core.create_namespaced_service(
                self.namespace, body, _request_timeout=CALL_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status != 409:
                raise DlfleetError(
                    f"cannot create service {self.service}: {_api_message(exc)}"
                ) from None
            created = self.core.read_namespaced_service(
                self.service, self.namespace, _request_timeout=CALL_TIMEOUT_S
            )
            # Made by an earlier run: it must still name this run's HTTP port.
            wanted = body["metadata"].get("annotations", {})
            found = {
                key: value
                for key, value in (created.metadata.annotations or {}).items()
                if key.startswith("prometheus.io/")
            }
            if found != wanted:
                _log.warning(
                    "service %s has the scrape annotations %s, not %s (job.yaml http changed?); "
                    "delete it to have it made again",
                    self.service, found, wanted,
                )  # fmt: skip
        if self._owner is None:
            # Outside a Pod, the Service anchors the job's objects: deleting it
            # deletes the Pods (garbage collection).
            self._owner = {"apiVersion": "v1", "kind": "Service",
                           "name": self.service, "uid": created.metadata.uid}  # fmt: skip

    def _ensure_secret(self) -> None:
        data = {"token": self.token}
        if self.config.tls_ca_file is not None:
            data["ca.crt"] = self.config.tls_ca_file.read_text()
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": self.secret,
                "namespace": self.namespace,
                "labels": {LABEL_JOB: self.config.name},
                "ownerReferences": [self._owner] if self._owner else [],
            },
            "type": "Opaque",
            "stringData": data,
        }
        try:
            self.core.create_namespaced_secret(
                self.namespace, body, _request_timeout=CALL_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status != 409:
                raise DlfleetError(
                    f"cannot create secret {self.secret}: {_api_message(exc)}"
                ) from None
            self.core.replace_namespaced_secret(
                self.secret, self.namespace, body, _request_timeout=CALL_TIMEOUT_S
            )

    def _delete_pod(self, name: str, grace_s: int) -> None:
        if name:
            self._call(
                self.core.delete_namespaced_pod, name, self.namespace, grace_period_seconds=grace_s
            )

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> None:
        """A delete: gone already is fine, and a failure is logged, not fatal."""
        try:
            # Raw: a delete answers a Status or the object, which the
            # client's models do not always parse.
            method(*args, _request_timeout=CALL_TIMEOUT_S, _preload_content=False, **kwargs)
        except ApiException as exc:
            if exc.status != 404:
                _log.warning("%s %s: %s", method.__name__, args[0], _api_message(exc))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            _log.warning("%s %s: %s", method.__name__, args[0], exc)

    def _event(self, node: KubeNode, reason: str, message: str) -> None:
        """A Kubernetes Event on the node's Pod; best effort."""
        if not node.pod:
            return
        now = _now_iso()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{node.pod}.", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": node.pod,
                "namespace": self.namespace,
            },
            "reason": reason,
            "message": message,
            "type": "Normal",
            "source": {"component": "dlmaster"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(*_TRANSIENT):
            self.core.create_namespaced_event(self.namespace, body, _request_timeout=CALL_TIMEOUT_S)


def _lines(response: Any) -> Any:
    return iter_resp_lines(response)  # type: ignore[no-untyped-call]


def _failure(pod: Pod) -> tuple[int, str]:
    """A Failed Pod's exit code and why: OOMKilled, Evicted, or a plain exit."""
    status = pod.get("status") or {}
    terminated: dict[str, Any] = {}
    for container in status.get("containerStatuses") or []:
        if container.get("name") == CONTAINER:
            state = container.get("state") or {}
            terminated = state.get("terminated") or (container.get("lastState") or {}).get(
                "terminated"
            ) or {}  # fmt: skip
    code = int(terminated.get("exitCode", 137))
    if status.get("reason") == "Evicted":
        return code, REASON_EVICTED
    if terminated.get("reason") == "OOMKilled":
        return code, REASON_OOM
    return code, ""


def _pending_reason(pod: Pod) -> str:
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"{condition.get('reason', 'unscheduled')}: {condition.get('message', '')}"
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return f"{waiting.get('reason', 'waiting')}: {waiting.get('message', '')}".rstrip(": ")
    return "pending"


def _pod_memory(pod: Pod) -> int | None:
    for container in pod["spec"].get("containers") or []:
        if container.get("name") == CONTAINER:
            resources = container.get("resources") or {}
            for kind in ("limits", "requests"):
                amount = (resources.get(kind) or {}).get("memory")
                if amount is not None:
                    return int(parse_quantity(amount))
    return None


def _api_message(exc: ApiException) -> str:
    try:
        return f"{exc.status} {json.loads(exc.body or '')['message']}"
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"


def _own_namespace() -> str:
    try:
        return SA_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return os.environ.get("POD_NAMESPACE", "default")

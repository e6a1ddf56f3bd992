"""A real Kubernetes control plane on 127.0.0.1, for tests: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler (v1.20.2, built by
`scripts/kube_env.sh`), with no container runtime and no kubelet (see
`kubetest.kubelet` for the test kubelet).

Invariants: every component listens on 127.0.0.1 only, on ports picked free at
start; each runs in its own process group and gets SIGKILL when the thread
that started it dies (`die_with_parent`), so a crashed test run leaves nothing
behind; every wait is bounded, and a startup failure names the component and
ends with the tail of its log. The apiserver authenticates with a static token
file (one admin user in `system:masters`) and authorizes with Node,RBAC.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dlfleet.api.processes import die_with_parent

T = TypeVar("T")

KUBE_VERSION = "v1.20.2"
# The cached build's name (scripts/kube_env.sh BUILD): v1.20.2 with Debian's
# modern-go/reflect2 1.0.2 in its vendor tree.
KUBE_BUILD = f"{KUBE_VERSION}+reflect2-1.0.2"
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "kubetest-admin"


class KubeClusterError(RuntimeError):
    """The control plane could not be set up, started or reached."""


class KubeEnvMissing(KubeClusterError):
    """The Kubernetes binaries are not built: run scripts/kube_env.sh."""


class WaitTimeout(KubeClusterError):
    """A bounded wait ran out."""


def wait_until(
    probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.1
) -> T:
    """Call `probe` until it returns something other than None (or False), at
    most `timeout_s`; raise WaitTimeout naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if result is not None and result is not False:
            return result
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


@dataclass(frozen=True)
class KubeBinaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path

    @classmethod
    def find(cls, bin_dir: Path | None = None) -> KubeBinaries:
        """The binaries cached by scripts/kube_env.sh (or in `bin_dir`, or in
        $KUBETEST_BIN_DIR); etcd from $PATH. Raises KubeEnvMissing."""
        if bin_dir is None:
            env = os.environ.get("KUBETEST_BIN_DIR")
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            bin_dir = Path(env) if env else cache / "dlfleet" / f"kubernetes-{KUBE_BUILD}" / "bin"
        names = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"]
        missing = [name for name in names if not os.access(bin_dir / name, os.X_OK)]
        etcd = shutil.which("etcd")
        if etcd is None:
            missing.append("etcd (on $PATH)")
        if missing:
            raise KubeEnvMissing(
                f"Kubernetes test binaries missing ({', '.join(missing)} in {bin_dir}): "
                "run scripts/kube_env.sh once to install etcd and build them (about 5 minutes)"
            )
        assert etcd is not None
        return cls(
            etcd=Path(etcd),
            kube_apiserver=bin_dir / "kube-apiserver",
            kube_controller_manager=bin_dir / "kube-controller-manager",
            kube_scheduler=bin_dir / "kube-scheduler",
            kubectl=bin_dir / "kubectl",
        )


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the component binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _openssl(*args: str) -> None:
    result = subprocess.run(
        ["openssl", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise KubeClusterError(f"openssl {args[0]} failed: {result.stderr.strip()}")


@dataclass(frozen=True)
class Pki:
    """The files the control plane authenticates with."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    service_account_key: Path
    service_account_pub: Path
    token_file: Path
    admin_token: str

    @classmethod
    def create(cls, directory: Path) -> Pki:
        """A fresh CA, a serving certificate for 127.0.0.1/localhost and the
        in-cluster service names, a service-account key pair and a token file."""
        directory.mkdir(parents=True, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
        _openssl(
            "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca_cert), "-days", "30",
            "-subj", "/CN=kubetest-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        serving_cert, serving_key = directory / "apiserver.crt", directory / "apiserver.key"
        csr, extensions = directory / "apiserver.csr", directory / "apiserver.ext"
        names = "kubernetes,kubernetes.default,kubernetes.default.svc,localhost"
        alt_names = ",".join(f"DNS:{name}" for name in names.split(","))
        extensions.write_text(
            f"subjectAltName={alt_names},IP:127.0.0.1,IP:10.0.0.1\n"
            "basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
        )
        _openssl("req", "-new", *ec, "-keyout", str(serving_key), "-out", str(csr),
                 "-subj", "/CN=kube-apiserver")  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "30", "-extfile", str(extensions),
            "-out", str(serving_cert),
        )  # fmt: skip
        sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
        _openssl("genrsa", "-out", str(sa_key), "2048")
        _openssl("rsa", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
        admin_token = os.urandom(24).hex()
        token_file = directory / "tokens.csv"
        token_file.write_text(f'{admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        for path in (ca_key, serving_key, sa_key, token_file):
            path.chmod(0o600)
        return cls(ca_cert, ca_key, serving_cert, serving_key, sa_key, sa_pub, token_file,
                   admin_token)  # fmt: skip


def write_kubeconfig(path: Path, server: str, ca_file: Path, token: str, user: str) -> Path:
    """A kubeconfig with one context: `user` authenticated by bearer `token`."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kubetest",
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "kubetest", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class Component:
    """One control-plane process: its own process group, killed with the
    thread that started it, output appended to `log_path`."""

    def __init__(self, name: str, command: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.command = list(command)
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Strip etcd's and client configuration from the environment, so that
        # nothing on this machine changes how a component runs.
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith("ETCD_") and key not in {"KUBECONFIG"}
        }
        with self.log_path.open("ab") as log:
            log.write(f"--- kubetest: starting {' '.join(self.command)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                die_with_parent(self.command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def check_alive(self) -> None:
        """Raise KubeClusterError with the log's tail if the process has exited."""
        if self._process is not None and self._process.poll() is not None:
            raise KubeClusterError(
                f"{self.name} exited with status {self._process.returncode}\n{self.log_tail()}"
            )

    def terminate(self) -> None:
        """Send SIGTERM to the process group (stop() waits for the end)."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s` (at once if 0):
        kube-apiserver waits up to 60 s for open watches after a SIGTERM."""
        process, self._process = self._process, None
        if process is None:
            return
        if grace_s > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return f"(no log at {self.log_path})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path}:\n{tail}"


class KubeCluster:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on
    127.0.0.1. `start()` returns once the apiserver is ready, the scheduler is
    healthy and the controller-manager has created the token of the default
    service account in `default` (its token and service-account controllers
    run). State lives in `work_dir` (a fresh temporary directory by default).

    Components are started by the calling thread and die with it (see
    `die_with_parent`): call start() and restart_apiserver() from a thread
    that outlives the cluster, e.g. the main thread."""

    def __init__(
        self,
        work_dir: Path | None = None,
        binaries: KubeBinaries | None = None,
        startup_timeout_s: float = 90.0,
    ) -> None:
        self.binaries = binaries or KubeBinaries.find()
        self._own_work_dir = work_dir is None
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="kubetest-"))
        self.startup_timeout_s = startup_timeout_s
        self.pki = Pki.create(self.work_dir / "pki")
        self.etcd_port = free_port()
        self.apiserver_port = free_port()
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        self.kubeconfig_path = write_kubeconfig(
            self.work_dir / "admin.kubeconfig",
            self.server,
            self.pki.ca_cert,
            self.pki.admin_token,
            ADMIN_USER,
        )
        logs = self.work_dir / "logs"
        logs.mkdir(exist_ok=True)
        self._etcd = Component("etcd", self._etcd_command(), logs / "etcd.log")
        self._apiserver = Component(
            "kube-apiserver", self._apiserver_command(), logs / "kube-apiserver.log"
        )
        self._scheduler_port = free_port()
        self._controller_manager = Component(
            "kube-controller-manager",
            self._controller_manager_command(),
            logs / "kube-controller-manager.log",
        )
        self._scheduler = Component(
            "kube-scheduler", self._scheduler_command(), logs / "kube-scheduler.log"
        )
        self._components = [self._etcd, self._apiserver, self._controller_manager, self._scheduler]

    # -- what tests use ------------------------------------------------------

    @property
    def ca_file(self) -> Path:
        return self.pki.ca_cert

    @property
    def admin_token(self) -> str:
        return self.pki.admin_token

    def kubeconfig_for_token(self, token: str, user: str = "kubetest-user") -> Path:
        """A kubeconfig file for another bearer token (e.g. a service account's)."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
        return write_kubeconfig(
            self.work_dir / f"{safe}.kubeconfig", self.server, self.ca_file, token, user
        )

    def service_account_kubeconfig(
        self, namespace: str, name: str, expiration_s: int = 3600
    ) -> Path:
        """A kubeconfig authenticating as service account `namespace/name`
        (which must exist), with a token from the TokenRequest API."""
        from kubernetes import client

        with self.api_client() as api:
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(
                    audiences=[SERVICE_ACCOUNT_ISSUER], expiration_seconds=expiration_s
                )
            )
            response = client.CoreV1Api(api).create_namespaced_service_account_token(
                name, namespace, request
            )
            token = response.status.token if response.status else None
        if not token:
            raise KubeClusterError(f"no token issued for service account {namespace}/{name}")
        return self.kubeconfig_for_token(token, f"system:serviceaccount:{namespace}:{name}")

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A new kubernetes.client.ApiClient for the admin (or `kubeconfig`);
        the caller closes it (it is a context manager)."""
        from kubernetes import config

        return config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig or self.kubeconfig_path), persist_config=False
        )

    def kubectl(
        self, *args: str, input_text: str | None = None, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl as the admin; the caller checks returncode."""
        return subprocess.run(
            [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig_path}", *args],
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start every component and wait until the cluster is usable."""
        try:
            self._etcd.start()
            self._wait_etcd()
            self._start_apiserver()
            self._controller_manager.start()
            self._scheduler.start()
            self._wait_scheduler()
            self._wait_default_service_account_token()
        except BaseException:
            self.stop()
            raise

    def restart_apiserver(self, grace_s: float = 0.0) -> None:
        """Stop kube-apiserver (SIGKILL, like a crash, unless `grace_s` > 0:
        then SIGTERM first) and start it again on the same port, waiting until
        it is ready; etcd, the controller-manager and the scheduler keep
        running and reconnect on their own."""
        self._apiserver.stop(grace_s)
        self._start_apiserver()

    def stop(self) -> None:
        """Stop every component (idempotent); a temporary work dir is removed."""
        for component in self._components:
            component.terminate()
        for component in reversed(self._components):
            component.stop()
        if self._own_work_dir and not os.environ.get("KUBETEST_KEEP"):
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> KubeCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> dict[str, Path]:
        """The log file of each component, by component name."""
        return {component.name: component.log_path for component in self._components}

    # -- internals -----------------------------------------------------------

    def _etcd_command(self) -> list[str]:
        client_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        return [
            str(self.binaries.etcd),
            "--name=kubetest",
            f"--data-dir={self.work_dir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=kubetest={peer_url}",
            "--initial-cluster-state=new",
            "--log-level=warn",
            "--logger=zap",
        ]

    def _apiserver_command(self) -> list[str]:
        pki = self.pki
        return [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            "--insecure-port=0",
            "--advertise-address=127.0.0.1",
            # The `kubernetes` service's endpoints would be 127.0.0.1, which
            # endpoint validation rejects (loopback): do not reconcile them.
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={pki.token_file}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--api-audiences={SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--cert-dir={self.work_dir / 'apiserver-certs'}",
            "--profiling=false",
            "--v=1",
        ]

    def _component_flags(self, name: str, port: int) -> list[str]:
        kubeconfig = self.kubeconfig_path
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--port=0",  # no insecure serving
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.work_dir / (name + '-certs')}",
            "--profiling=false",
            "--v=1",
        ]

    def _controller_manager_command(self) -> list[str]:
        pki = self.pki
        return [
            str(self.binaries.kube_controller_manager),
            *self._component_flags("controller-manager", free_port()),
            "--controllers=*",
            "--use-service-account-credentials",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}",
            f"--cluster-signing-key-file={pki.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
        ]

    def _scheduler_command(self) -> list[str]:
        return [
            str(self.binaries.kube_scheduler),
            *self._component_flags("scheduler", self._scheduler_port),
        ]

    def _start_apiserver(self) -> None:
        self._apiserver.start()
        ready = self._https_probe(self.server + "/readyz", self._apiserver)
        wait_until(ready, self.startup_timeout_s, "kube-apiserver /readyz", interval_s=0.2)

    def _wait_etcd(self) -> None:
        url = f"http://127.0.0.1:{self.etcd_port}/health"

        def healthy() -> bool:
            self._etcd.check_alive()
            try:
                with _opener().open(url, timeout=2) as response:
                    return bool(json.loads(response.read()).get("health") == "true")
            except (OSError, ValueError):
                return False

        self._wait(healthy, self._etcd, "etcd /health")

    def _wait_scheduler(self) -> None:
        probe = self._https_probe(
            f"https://127.0.0.1:{self._scheduler_port}/healthz", self._scheduler, verify=False
        )
        self._wait(probe, self._scheduler, "kube-scheduler /healthz")

    def _wait_default_service_account_token(self) -> None:
        """The token controller has populated the `default` service account:
        pods can be admitted in new namespaces from now on (once theirs is)."""
        url = f"{self.server}/api/v1/namespaces/default/serviceaccounts/default"
        context = ssl.create_default_context(cafile=str(self.ca_file))
        headers = {"Authorization": f"Bearer {self.admin_token}"}

        def populated() -> bool:
            self._controller_manager.check_alive()
            self._apiserver.check_alive()
            request = urllib.request.Request(url, headers=headers)
            try:
                with _opener(context).open(request, timeout=5) as response:
                    return bool(json.loads(response.read()).get("secrets"))
            except (OSError, ValueError):
                return False

        self._wait(populated, self._controller_manager, "the default service account's token")

    def _https_probe(
        self, url: str, component: Component, verify: bool = True
    ) -> Callable[[], bool]:
        if verify:
            context = ssl.create_default_context(cafile=str(self.ca_file))
        else:
            context = ssl.create_default_context()  # the scheduler's cert is self-signed
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        headers = {"Authorization": f"Bearer {self.admin_token}"} if verify else {}

        def probe() -> bool:
            component.check_alive()
            request = urllib.request.Request(url, headers=headers)
            try:
                with _opener(context).open(request, timeout=5) as response:
                    return bool(response.status == 200)
            except (OSError, ValueError):
                return False

        return probe

    def _wait(self, probe: Callable[[], bool], component: Component, what: str) -> None:
        try:
            wait_until(probe, self.startup_timeout_s, what, interval_s=0.2)
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}\n{component.log_tail()}") from None


def _opener(context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """Never through a proxy from the environment: everything is on 127.0.0.1."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)

"""Cluster DNS for the test kubelet's Pods, as /etc/hosts files.

There is no cluster DNS server: each Pod's /etc/hosts (see
`kubetest.sandbox`) names its own address, and every Service's ready (or
published not-ready) endpoints, as CoreDNS would answer for them:

    <ip>  <svc>.<ns>.svc.cluster.local <svc>.<ns>.svc <svc>.<ns> [<svc>]
    <ip>  <host>.<svc>.<ns>.svc.cluster.local <host>.<svc>.<ns>.svc [<host>.<svc>]

the short forms only for Services of the Pod's own namespace (its search
path). A Service with a cluster IP resolves to its Pods' IPs too: there is no
kube-proxy, so a client reaches the Pods directly (their targetPort must be
the Service's port). The names come from the Endpoints objects that the
controller-manager keeps, polled by `ServiceNames`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

LOG = logging.getLogger("kubetest.names")
CLUSTER_DOMAIN = "cluster.local"
POLL_S = 0.5

Json = dict[str, Any]


@dataclass(frozen=True, order=True)
class Endpoint:
    """One address of a Service's Endpoints."""

    namespace: str
    service: str
    ip: str
    hostname: str = ""  # the Pod's spec.hostname, when its subdomain is the Service


@dataclass(frozen=True)
class PodName:
    """What a Pod's own /etc/hosts line is made of."""

    namespace: str
    ip: str
    hostname: str
    subdomain: str = ""


def endpoints_of(listing: Json) -> frozenset[Endpoint]:
    """The endpoints in an EndpointsList (as the API serves it)."""
    found = set()
    for item in listing.get("items") or []:
        meta = item["metadata"]
        for subset in item.get("subsets") or []:
            addresses = [*(subset.get("addresses") or []), *(subset.get("notReadyAddresses") or [])]
            for address in addresses:
                hostname = address.get("hostname") or ""
                found.add(Endpoint(meta["namespace"], meta["name"], address["ip"], hostname))
    return frozenset(found)


def hosts_file(pod: PodName, endpoints: Iterable[Endpoint]) -> str:
    lines = [
        "# kubetest: this Pod and the cluster's Service endpoints",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    if pod.subdomain:
        fqdn = f"{pod.hostname}.{pod.subdomain}.{pod.namespace}.svc.{CLUSTER_DOMAIN}"
        lines.append(f"{pod.ip}\t{fqdn}\t{pod.hostname}")
    else:
        lines.append(f"{pod.ip}\t{pod.hostname}")
    for endpoint in sorted(endpoints):
        service = f"{endpoint.service}.{endpoint.namespace}"
        names = [f"{service}.svc.{CLUSTER_DOMAIN}", f"{service}.svc", service]
        if endpoint.namespace == pod.namespace:
            names.append(endpoint.service)
        lines.append(f"{endpoint.ip}\t{' '.join(names)}")
        if endpoint.hostname:
            host = f"{endpoint.hostname}.{service}.svc"
            names = [f"{host}.{CLUSTER_DOMAIN}", host]
            if endpoint.namespace == pod.namespace:
                names.append(f"{endpoint.hostname}.{endpoint.service}")
            lines.append(f"{endpoint.ip}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, text: str) -> None:
    """Replace the file's content without replacing the file: a Pod's
    /etc/hosts is a bind mount of this inode. One write from offset 0, padded
    with a comment to at least the old length, so that a reader never meets
    an empty or cut file, only the old or the new one (a page at most)."""
    data = text.encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        shortfall = os.fstat(fd).st_size - len(data)
        if shortfall > 0:
            data += b"#" * (shortfall - 1) + b"\n"
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


class ServiceNames:
    """Polls the Endpoints of every namespace; calls `on_change` with the
    whole set whenever it changes (from its own thread)."""

    def __init__(
        self,
        core: Any,
        on_change: Callable[[frozenset[Endpoint]], None],
        interval_s: float = POLL_S,
    ) -> None:
        self._core = core
        self._on_change = on_change
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._endpoints: frozenset[Endpoint] = frozenset()
        self._thread = threading.Thread(target=self._run, name="kubetest-names", daemon=True)

    def current(self) -> frozenset[Endpoint]:
        with self._lock:
            return self._endpoints

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def refresh(self) -> None:
        """Read the Endpoints now; raises what the API call raises."""
        response = self._core.list_endpoints_for_all_namespaces(
            _preload_content=False, _request_timeout=10
        )
        endpoints = endpoints_of(json.loads(response.data))
        with self._lock:
            changed, self._endpoints = endpoints != self._endpoints, endpoints
        if changed:
            self._on_change(endpoints)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.refresh()
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                LOG.debug("listing endpoints (polling again): %s", exc)  # the server is away

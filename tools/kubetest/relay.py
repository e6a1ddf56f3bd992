"""The kube-apiserver inside each Pod's network namespace, at the address it
has on this machine: 127.0.0.1:<its port>.

A Pod has a loopback of its own, and the apiserver listens on this machine's
loopback only. The kubelet listens on the same port of each Pod's loopback
and relays every connection to the apiserver, byte for byte (TLS goes
through untouched, so the serving certificate for 127.0.0.1 and the
kubeconfig that names it hold inside the Pod too). One thread accepts per
Pod; two threads copy per connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from pathlib import Path

from kubetest.network import listen_in

LOG = logging.getLogger("kubetest.relay")
CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 10.0


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class ApiRelay:
    """Relays `host:port` of each Pod's namespace to `host:port` here."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._listeners: dict[Path, socket.socket] = {}
        self._connections: dict[Path, set[socket.socket]] = {}

    def serve(self, netns: Path) -> None:
        """Start relaying inside the network namespace at `netns`."""
        listener = listen_in(netns, self.host, self.port)
        with self._lock:
            self._listeners[netns] = listener
            self._connections[netns] = set()
        threading.Thread(
            target=self._accept, args=(netns, listener), name="kubetest-relay", daemon=True
        ).start()

    def close(self, netns: Path) -> None:
        """Stop relaying there and cut its open connections."""
        with self._lock:
            listener = self._listeners.pop(netns, None)
            connections = self._connections.pop(netns, set())
        if listener is not None:
            _shut(listener)  # wakes its accept() (Linux)
        for sock in connections:
            _shut(sock)

    def close_all(self) -> None:
        with self._lock:
            namespaces = list(self._listeners)
        for netns in namespaces:
            self.close(netns)

    def _accept(self, netns: Path, listener: socket.socket) -> None:
        while True:
            try:
                inside, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                outside = socket.create_connection((self.host, self.port), CONNECT_TIMEOUT_S)
            except OSError as exc:
                LOG.warning("relay to the apiserver at %s:%d: %s", self.host, self.port, exc)
                _shut(inside)
                continue
            outside.settimeout(None)
            with self._lock:
                connections = self._connections.get(netns)
                if connections is None:  # closed meanwhile
                    _shut(inside)
                    _shut(outside)
                    return
                connections |= {inside, outside}
            for source, sink in ((inside, outside), (outside, inside)):
                threading.Thread(
                    target=self._copy, args=(netns, source, sink), name="kubetest-relay-copy",
                    daemon=True,
                ).start()  # fmt: skip

    def _copy(self, netns: Path, source: socket.socket, sink: socket.socket) -> None:
        """One direction of a connection; its end ends both directions."""
        with contextlib.suppress(OSError):  # either end gone: the connection is over
            while data := source.recv(CHUNK):
                sink.sendall(data)
        with self._lock:
            connections = self._connections.get(netns, set())
            connections.discard(source)
            connections.discard(sink)
        _shut(source)
        _shut(sink)

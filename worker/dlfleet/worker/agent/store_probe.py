"""Can this node reach its round's process-group store?

The store listens on the address the round's leader published. When that
address does not reach this node (a wrong --local-addr there, a firewall, an
interface of a network this node is not on), the workers would wait on it
silently until the process group's timeout. The agent dials it instead, as
soon as the round forms: an answer, even a refusal (the host is there, the
store not up yet), settles it; no route for UNREACHABLE_S ends the node with
a line naming the address and what to change.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from dlfleet.api.addresses import with_port

UNREACHABLE_S = 10.0
RETRY_S = 0.5
Connect = Callable[[tuple[str, int], float], socket.socket]


class StoreProbe:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        unreachable_s: float = UNREACHABLE_S,
        retry_s: float = RETRY_S,
        connect: Connect = socket.create_connection,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = with_port(host, port)
        self._target = (host, port)
        self._unreachable_s = unreachable_s
        self._retry_s = retry_s
        self._connect = connect
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-probe", daemon=True)
        self.problem: str | None = None  # set once, when the store is unreachable
        self.reached = threading.Event()  # the leader's host answered

    def start(self) -> StoreProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        first_failure: float | None = None
        while not self._stop.is_set():
            try:
                self._connect(self._target, 2.0).close()
            except ConnectionRefusedError:
                pass  # the leader's host answered (its store is not up yet): reached
            except OSError as error:
                now = self._clock()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure >= self._unreachable_s:
                    self.problem = self._describe(error)
                    return
                self._stop.wait(self._retry_s)
                continue
            self.reached.set()
            return

    def _describe(self, error: OSError) -> str:
        why = error.strerror or type(error).__name__
        return (
            f"this node cannot reach its round's process-group store at {self.address} "
            f"(the address the round's leader published) for {self._unreachable_s:g}s: {why}. "
            "Start that node's dlworker with --local-addr set to an address this node reaches, "
            "and let TCP through between the nodes"
        )

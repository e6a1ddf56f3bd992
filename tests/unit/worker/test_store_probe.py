"""The agent's dial of its round's store: a refusal is an answer, no route
for the bound is the end of the node, with the address and the flag."""

from __future__ import annotations

import errno
import socket

import pytest

from dlfleet.worker.agent.store_probe import StoreProbe


class Script:
    """Stands in for socket.create_connection: raises what it is given in
    turn, then connects; advances a fake clock one second per call."""

    def __init__(self, *outcomes: OSError | None) -> None:
        self.outcomes = list(outcomes)
        self.now = 0.0

    def connect(self, target: tuple[str, int], timeout: float) -> socket.socket:
        self.now += 1.0
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if outcome is not None:
            raise outcome
        a, b = socket.socketpair()
        b.close()
        return a

    def clock(self) -> float:
        return self.now


def probe(script: Script, bound: float = 3.0) -> StoreProbe:
    done = StoreProbe(
        "10.0.0.2",
        29500,
        unreachable_s=bound,
        retry_s=0,
        connect=script.connect,
        clock=script.clock,
    ).start()
    done._thread.join(10)
    return done


def test_a_store_that_answers_is_reached() -> None:
    done = probe(Script(None))
    assert done.reached.is_set() and done.problem is None


def test_a_refusal_means_the_host_is_there_and_the_store_not_up_yet() -> None:
    script = Script(ConnectionRefusedError(), OSError(errno.EHOSTUNREACH, "never asked"))
    done = probe(script)
    assert done.reached.is_set() and done.problem is None and script.now == 1.0


@pytest.mark.parametrize("code", [errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT])
def test_no_route_for_the_bound_names_the_address_and_the_flag(code: int) -> None:
    unreachable = [OSError(code, "No route to host") for _ in range(10)]
    done = probe(Script(*unreachable), bound=3.0)
    assert done.problem is not None
    assert "10.0.0.2:29500" in done.problem and "--local-addr" in done.problem


def test_a_blip_shorter_than_the_bound_is_forgiven() -> None:
    done = probe(Script(OSError(errno.EHOSTUNREACH, "x"), OSError(errno.EHOSTUNREACH, "x"), None))
    assert done.reached.is_set() and done.problem is None

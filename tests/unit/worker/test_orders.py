"""The agent's bookkeeping of attached worker processes (in-process restarts):
orders reach the right process in order, an order for a process that has not
attached yet waits for it, and `wait_left` tells which processes did not leave
an aborted round."""

from __future__ import annotations

import threading
import time

from dlfleet.api.v1 import checkpoint_pb2
from dlfleet.worker.agent.orders import WorkerOrders
from dlfleet.worker.elastic.channel import Abort, Run, WorkState, order_from_wire


def run(round_: int) -> Run:
    return Run(checkpoint_pb2.RunOrder(round=round_))


def abort(round_: int) -> Abort:
    return Abort(round_, "")


def test_orders_reach_an_attached_process_in_the_order_they_were_sent() -> None:
    orders = WorkerOrders()
    line = orders.open_line(10, spare=False)
    assert orders.send(10, run(1)) and orders.send(10, abort(1)) and orders.send(10, run(2))
    orders.close_line(line)
    got = [order_from_wire(order) for order in orders.orders_of(line)]
    assert got == [run(1), abort(1), run(2)]


def test_an_order_for_a_process_that_has_not_attached_is_delivered_when_it_does() -> None:
    orders = WorkerOrders()
    orders.expect(11, run(3))
    assert not orders.attached(11)
    line = orders.open_line(11, spare=False)
    delivered = line.orders.get_nowait()
    assert delivered == run(3)
    assert orders.state(11) == (WorkState.ORDERED, 3)


def test_a_process_that_is_gone_is_sent_nothing() -> None:
    orders = WorkerOrders()
    line = orders.open_line(12, spare=True)
    orders.close_line(line)
    assert not orders.send(12, run(1))
    assert orders.spares() == []


def test_a_spare_given_a_rank_is_no_longer_a_spare() -> None:
    orders = WorkerOrders()
    orders.open_line(13, spare=True)
    orders.open_line(14, spare=True)
    assert orders.spares() == [13, 14]
    orders.send(13, run(2))
    assert orders.spares() == [14]


def test_wait_left_names_the_processes_still_in_the_aborted_round() -> None:
    orders = WorkerOrders()
    for pid in (20, 21, 22):
        orders.open_line(pid, spare=False)
        orders.send(pid, run(4))
        orders.report(pid, 4, "running", "")
    orders.report(20, 4, "aborted", "")

    def leave_later() -> None:
        time.sleep(0.05)
        orders.report(21, 4, "aborted", "")

    threading.Thread(target=leave_later).start()
    stuck = orders.wait_left([20, 21, 22], 4, timeout_s=0.5)
    assert stuck == {22}


def test_a_newer_line_of_the_same_process_replaces_the_older_one() -> None:
    orders = WorkerOrders()
    old = orders.open_line(30, spare=False)
    new = orders.open_line(30, spare=False)
    assert old.orders.get_nowait() is None  # the old stream ends
    orders.close_line(old)  # late: must not forget the new line
    assert orders.attached(30)
    orders.close_line(new)
    assert not orders.attached(30)


def test_a_report_of_a_state_the_agent_does_not_know_changes_nothing() -> None:
    orders = WorkerOrders()
    orders.open_line(13, spare=False)
    orders.report(13, 5, "dancing", "")
    assert orders.state(13) == (WorkState.ATTACHED, 0)
    orders.report(13, 5, "running", "")
    assert orders.state(13) == (WorkState.RUNNING, 5)

"""The node check's measurements, in torch: a matmul on this node's device
(CUDA when there is one, else the CPU), and all-reduces with one peer in a
two-process group of its own (gloo; NCCL when the master says both sides
have CUDA), over a TCPStore that rank 0 hosts on the port it offered.

Both are small on purpose (a 512 x 512 matmul, a 4 MiB all-reduce, chosen by
the master): the check must cost seconds, and relative numbers are enough to
find a node much slower than the others. Lives in the check process only.
"""

from __future__ import annotations

import datetime
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # exported at run time only
    PrefixStore,
    TCPStore,
)

from dlfleet.api.v1 import nodecheck_pb2

WARMUP = 2  # all-reduces before the timed ones: connection set-up, first allocations


class Probe:
    def __init__(self, slowdown: float = 1.0) -> None:
        """`slowdown`: the test hook's factor (`dlfleet.worker.nodecheck`)."""
        self.slowdown = slowdown
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    @property
    def device_name(self) -> str:
        return str(self.device)

    def compute(self, size: int, repeats: int) -> float:
        """The fastest of `repeats` size x size float32 matmuls, in ms (after
        one untimed run)."""
        a = torch.randn(size, size, device=self.device)
        b = torch.randn(size, size, device=self.device)
        best = math.inf
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            torch.mm(a, b)
            self._sync()
            elapsed = self._drag(time.perf_counter() - start)
            if attempt:
                best = min(best, elapsed)
        return best * 1000

    def pair(self, order: nodecheck_pb2.PairOrder) -> tuple[bool, float, str]:
        """(ok, the median all-reduce iteration in ms, why not): this side of
        `order`'s pair, given up after its timeout."""
        deadline = time.monotonic() + order.timeout_ms / 1000
        store: TCPStore | None = None
        try:
            store = TCPStore(
                order.store_host,
                order.store_port,
                2,
                order.rank == 0,
                timeout=datetime.timedelta(milliseconds=order.timeout_ms),
            )
            left = max(1.0, deadline - time.monotonic())
            dist.init_process_group(
                order.backend or "gloo",
                store=PrefixStore(f"nodecheck/{order.check_id}/{order.pair}", store),
                rank=order.rank,
                world_size=2,
                timeout=datetime.timedelta(seconds=left),
            )
            on = self.device if order.backend == "nccl" else torch.device("cpu")
            tensor = torch.ones(order.numel, dtype=torch.float32, device=on)
            for _ in range(WARMUP):
                dist.all_reduce(tensor)
            times = []
            for _ in range(order.iterations):
                start = time.perf_counter()
                dist.all_reduce(tensor)
                self._sync()
                times.append(self._drag(time.perf_counter() - start))
            return True, statistics.median(times) * 1000, ""
        except (RuntimeError, ValueError) as error:  # store, connection, timeout, backend
            return False, 0.0, f"{type(error).__name__}: {str(error).strip()[:500]}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            del store

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _drag(self, elapsed: float) -> float:
        """The test hook: as if this node were `slowdown` times slower."""
        if self.slowdown <= 1.0:
            return elapsed
        time.sleep((self.slowdown - 1.0) * elapsed)
        return elapsed * self.slowdown

"""DDP over gloo on a small MLP, forever (whoever started it ends it), each
step padded to STEP_S; every rank appends
`<wall time> <world size> <rank> <step> <host> <pid>` to OUT/steps-<host>-<pid>
after each step: which machines trained together, and when. The same script
under dlworker and under torchrun (tests/e2e/test_across_machines.py,
bench/machines.py).

    host_steps.py OUT STEP_S

`read_steps(OUT)` reads them back (torch is imported only to train).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path


def read_steps(out: Path) -> list[tuple[float, int, str]]:
    """(wall time, world size, hostname) of every step logged in `out`, in time order."""
    found = []
    for path in out.glob("steps-*"):
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                found.append((float(fields[0]), int(fields[1]), fields[4]))
    return sorted(found)


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    out, step_s = Path(sys.argv[1]), float(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    host = socket.gethostname()
    log = (out / f"steps-{host}-{os.getpid()}").open("a")
    step = 0
    while True:
        started = time.monotonic()
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log.write(f"{time.time():.3f} {world} {rank} {step} {host} {os.getpid()}\n")
        log.flush()
        step += 1
        time.sleep(max(0.0, step_s - (time.monotonic() - started)))


if __name__ == "__main__":
    main()

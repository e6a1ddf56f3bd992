"""The training script of the diagnosis benchmark (bench/diagnosis.py).

A small DDP job over gloo (an MLP of ~0.3 M parameters), trained through
`dlfleet.elastic.run` and checkpointed in memory with `dlfleet.Checkpointer`
after every step, each step padded to `--step-ms`. It appends
`<wall time> <round> <rank> <step> <node id>` to `--step-log` after every
step (one `write()` per line, O_APPEND).

The injected fault, a machine whose GPU broke: once the file `--fault-file`
exists, every process of the node named `--bad-node` (its DLFLEET_NODE_ID
starts with `<bad node>#`) fails at its next step, or at once when it starts,
as a process on a broken GPU does: the driver's Xid line on stderr, then a
CUDA error raised. A restart on that node cannot help; a process anywhere
else trains on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

from dlfleet.api.env import NODE_ID_ENV


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--step-log", required=True, help="the trial's step log (appended to)")
    parser.add_argument("--fault-file", required=True, help="exists once the fault is injected")
    parser.add_argument("--bad-node", required=True, help="the node whose 'GPU' breaks")
    parser.add_argument("--steps", type=int, default=100_000, help="train until this step")
    parser.add_argument("--step-ms", type=float, default=50.0, help="wall time of one step")
    return parser.parse_args()


def broken_gpu(args: argparse.Namespace) -> None:
    """Fail as a process on a GPU that fell off the bus, if this is one."""
    node = os.environ.get(NODE_ID_ENV, "")
    if node.startswith(f"{args.bad_node}#") and os.path.exists(args.fault_file):
        print("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", file=sys.stderr)
        sys.stderr.flush()
        raise RuntimeError("CUDA error: unspecified launch failure")


def main() -> int:
    args = parse_args()
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from dlfleet import Checkpointer, elastic

    torch.set_num_threads(1)
    log = os.open(args.step_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    node = os.environ.get(NODE_ID_ENV, "?")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU()
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    checkpointer = Checkpointer()
    step_s = args.step_ms / 1000.0

    def train(attempt: elastic.Attempt) -> None:
        broken_gpu(args)
        restored = checkpointer.load({"model": model.state_dict()})
        first = restored.step + 1 if restored else 0
        ddp = DistributedDataParallel(model)
        generator = torch.Generator().manual_seed(attempt.rank)
        for step in range(first, args.steps):
            started = time.monotonic()
            broken_gpu(args)
            loss = ddp(torch.randn(8, 32, generator=generator)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            checkpointer.save(step, {"model": model.state_dict()})
            line = f"{time.time():.6f} {attempt.round} {attempt.rank} {step} {node}\n"
            os.write(log, line.encode())
            left = step_s - (time.monotonic() - started)
            if left > 0:
                time.sleep(left)

    elastic.run(train, backend="gloo", timeout=timedelta(seconds=30))
    checkpointer.close()
    os.close(log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

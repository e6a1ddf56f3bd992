"""A rank SIGKILLed while its save's overlapped copy is under way, for the
checkpoint e2e test.

    killed_mid_copy.py OUT_DIR KILL_AT LAST

One rank, no process group. A 64 MB parameter that the optimizer (SGD, lr 1,
gradient -1) raises by one per step, so the image of step s holds s + 1 in
every element: a copy taken half before and half after an optimizer step
would show two values. Every step is saved with overlap (`{"model": model,
"optim": optimizer}`). A fresh start kills itself (SIGKILL) right after
save(KILL_AT) returned, while the parameter is still being copied (it
writes whether the image was still unfinished); a restart restores, writes
{"restored", "values"} to OUT_DIR/restores.jsonl and trains on to LAST.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from dlfleet.worker.checkpoint.checkpointer import Checkpointer


def main() -> None:
    out, kill_at, last = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    model = torch.nn.Linear(4096, 4096, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with Checkpointer() as checkpointer:
        restored = checkpointer.load()
        start = 0
        if restored is not None:
            weight = restored.state["model"]["weight"]
            model.weight.data.copy_(weight)
            start = restored.step + 1
            line = {"restored": restored.step, "values": sorted(set(weight.unique().tolist()))}
            with (out / "restores.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        for step in range(start, last + 1):
            model.weight.grad = torch.full_like(model.weight, -1.0)
            optimizer.step()  # the weight is step + 1 everywhere
            checkpointer.save(step, {"model": model, "optim": optimizer})
            if step == kill_at and restored is None:
                unfinished = checkpointer.image_times(step) is None
                (out / "killed.json").write_text(json.dumps({"unfinished": unfinished}))
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
